#include "worker/parallel/testing/device_ranks.h"

#include <string>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/testing/in_process_store.h"
#include "worker/collective/nccl/nccl_process_group.h"

namespace cohort::testing {

DeviceRanks::DeviceRanks(int n) : n_(n) {
  auto store = std::make_shared<InProcessStore>();
  auto world = NewFakeNcclWorld();
  for (int r = 0; r < n; ++r) {
    apis_.push_back(std::make_shared<FakeNcclApi>(world));
    apis_.back()->RequireDeviceMemory();
  }
  groups_.resize(n);
  RunAll([&](int r) {
    NcclOptions options;
    options.group.timeout = absl::Seconds(20);
    options.group.verify_ops = false;
    options.api = apis_[r];
    auto group = NcclProcessGroup::Create(store, r, n_, options);
    ASSERT_TRUE(group.ok()) << group.status();
    groups_[r] = std::move(*group);
  });
}

void DeviceRanks::RunAll(const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n_; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

size_t DeviceRanks::BytesToHost(int r, size_t from) {
  return BytesCopied(r, from, "device to host");
}

size_t DeviceRanks::BytesToDevice(int r, size_t from) {
  return BytesCopied(r, from, "host to device");
}

// The fake logs a copy as "Copy(<n> bytes, <direction>)".
size_t DeviceRanks::BytesCopied(int r, size_t from,
                                absl::string_view direction) {
  const std::string suffix = absl::StrCat(" bytes, ", direction, ")");
  size_t total = 0;
  std::vector<std::string> calls = api(r).calls();
  for (size_t i = from; i < calls.size(); ++i) {
    if (!absl::EndsWith(calls[i], suffix)) continue;
    std::vector<std::string> parts = absl::StrSplit(calls[i], '(');
    size_t bytes = 0;
    EXPECT_TRUE(absl::SimpleAtoi(
        std::vector<std::string>(absl::StrSplit(parts[1], ' '))[0], &bytes));
    total += bytes;
  }
  return total;
}

float* DeviceRanks::DeviceFloats(int r, size_t n) {
  return static_cast<float*>(*api(r).Alloc(0, n * sizeof(float)));
}

}  // namespace cohort::testing
