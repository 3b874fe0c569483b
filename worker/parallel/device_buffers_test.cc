// DDP and FSDP keep their buckets, flat units and optimizer state in host
// memory. On a group whose buffers are device memory (NCCL) they refuse at
// once, saying so, instead of handing NCCL host pointers. The group here is
// an NcclProcessGroup over the fake NCCL (no GPU needed).
#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/in_process_store.h"
#include "worker/collective/nccl/fake_nccl_api.h"
#include "worker/collective/nccl/nccl_process_group.h"
#include "worker/parallel/ddp.h"
#include "worker/parallel/fsdp.h"

namespace cohort {
namespace {

using ::testing::HasSubstr;

std::shared_ptr<ProcessGroup> DeviceGroup() {
  NcclOptions options;
  options.api = std::make_shared<FakeNcclApi>(NewFakeNcclWorld());
  return std::move(NcclProcessGroup::Create(std::make_shared<InProcessStore>(),
                                            0, 1, options))
      .value();
}

TEST(DeviceBuffers, DdpAndFsdpRefuseADeviceGroupClearly) {
  std::shared_ptr<ProcessGroup> group = DeviceGroup();
  absl::Status ddp = Reducer::Create(group, {4, 4}).status();
  EXPECT_EQ(ddp.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(ddp.message(), HasSubstr("device memory (nccl)"));
  absl::Status fsdp = Fsdp::Create(group, {{4, 4}}).status();
  EXPECT_EQ(fsdp.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(fsdp.message(), HasSubstr("device memory (nccl)"));
  std::vector<float> x(4);
  BufferView view = BufferView::Of(x.data(), 4);
  EXPECT_EQ(BroadcastFromRank0(*group, {view}).code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace cohort
