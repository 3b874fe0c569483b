// CreateProcessGroup: ranks as threads of one process over an in-process
// store; Gloo over loopback TCP, NCCL over the fake NCCL.
#include "worker/collective/init/backend_factory.h"

#include <memory>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/in_process_store.h"
#include "worker/collective/nccl/fake_nccl_api.h"

namespace cohort {
namespace {

using ::testing::HasSubstr;

// Creates `n` ranks of `backend` on threads, `options_of(rank)` each, and
// all-reduces rank + 1 on each; returns each rank's status.
std::vector<absl::Status> SumOnThreads(
    absl::string_view backend, int n, std::shared_ptr<Store> store,
    const std::function<InitOptions(int)>& options_of) {
  std::vector<absl::Status> statuses(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      absl::StatusOr<std::unique_ptr<ProcessGroup>> group =
          CreateProcessGroup(backend, store, r, n, options_of(r));
      if (!group.ok()) {
        statuses[r] = group.status();
        return;
      }
      float value = r + 1;
      statuses[r] = (*group)
                        ->AllReduce(BufferView::Of(&value, 1), ReduceOp::kSum)
                        ->Wait(absl::Seconds(30));
      if (statuses[r].ok() && value != n * (n + 1) / 2.0f) {
        statuses[r] = absl::InternalError("wrong sum");
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return statuses;
}

TEST(CreateProcessGroup, GlooUsesItsOwnOptionsUnderItsStorePrefix) {
  auto store = std::make_shared<InProcessStore>();
  std::vector<absl::Status> statuses = SumOnThreads("gloo", 2, store, [](int) {
    InitOptions options;
    options.group.timeout = absl::Seconds(20);
    options.gloo.group.threads = 0;  // Not read: options.group is.
    options.gloo.store_prefix = "job9";
    options.gloo.bind_address = "127.0.0.1";
    options.gloo.shm.enabled = false;
    return options;
  });
  for (const absl::Status& s : statuses) EXPECT_TRUE(s.ok()) << s;
  // Gloo's rendezvous keys are the ranks, under the prefix given.
  EXPECT_THAT(store->Check({"job9/0", "job9/1"}), absl::StatusOr<bool>(true));
}

TEST(CreateProcessGroup, GroupOptionsReachTheBackend) {
  InitOptions options;
  options.group.threads = 0;
  absl::StatusOr<std::unique_ptr<ProcessGroup>> group = CreateProcessGroup(
      "gloo", std::make_shared<InProcessStore>(), 0, 1, options);
  EXPECT_EQ(group.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(group.status().message(), HasSubstr("threads (0)"));
}

TEST(CreateProcessGroup, NcclUsesItsOwnOptions) {
  std::shared_ptr<FakeNcclWorld> world = NewFakeNcclWorld();
  std::vector<absl::Status> statuses =
      SumOnThreads("nccl", 2, std::make_shared<InProcessStore>(), [&](int) {
        InitOptions options;
        options.group.timeout = absl::Seconds(20);
        options.nccl.api = std::make_shared<FakeNcclApi>(world);
        return options;
      });
  for (const absl::Status& s : statuses) EXPECT_TRUE(s.ok()) << s;
}

TEST(CreateProcessGroup, UnknownBackendIsInvalidArgument) {
  absl::StatusOr<std::unique_ptr<ProcessGroup>> group =
      CreateProcessGroup("mpi", std::make_shared<InProcessStore>(), 0, 1);
  EXPECT_EQ(group.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(group.status().message(), HasSubstr("unknown backend 'mpi'"));
  EXPECT_TRUE(CheckBackend("gloo").ok());
  EXPECT_TRUE(CheckBackend("nccl").ok());
}

}  // namespace
}  // namespace cohort
