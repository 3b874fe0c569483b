// Test support: the ranks of an NcclProcessGroup over the fake NCCL
// (fake_nccl_api.h), as threads of the test, strict about device memory:
// any buffer that is not "device" memory (a host pointer handed to a
// collective, a copy or a kernel) fails the call as a GPU would fault.
// The fake's device memory is host memory, so a test may fill and read it
// directly, as a kernel would, and read the calls each rank made.
#ifndef COHORT_WORKER_PARALLEL_TESTING_DEVICE_RANKS_H_
#define COHORT_WORKER_PARALLEL_TESTING_DEVICE_RANKS_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <vector>

#include "absl/strings/string_view.h"
#include "worker/collective/nccl/fake_nccl_api.h"
#include "worker/collective/process_group.h"

namespace cohort::testing {

class DeviceRanks {
 public:
  // Creates the `n` groups (timeout 20 s, verify_ops off: it stages its
  // small op descriptions through the host, and the tests count every
  // byte to the host as data). A failure to create one is a gtest failure.
  explicit DeviceRanks(int n);

  // Runs fn(r) for every rank r, each on its own thread; returns when all
  // have.
  void RunAll(const std::function<void(int)>& fn);

  std::shared_ptr<ProcessGroup> group(int r) { return groups_[r]; }
  FakeNcclApi& api(int r) { return *apis_[r]; }

  // Bytes copied device to host (host to device) by rank r from its call
  // number `from` on.
  size_t BytesToHost(int r, size_t from = 0);
  size_t BytesToDevice(int r, size_t from = 0);
  size_t CallCount(int r) { return api(r).calls().size(); }

  // `n` f32 of rank r's device memory (free with api(r).Free).
  float* DeviceFloats(int r, size_t n);

 private:
  size_t BytesCopied(int r, size_t from, absl::string_view direction);

  const int n_;
  std::vector<std::shared_ptr<FakeNcclApi>> apis_;
  std::vector<std::shared_ptr<ProcessGroup>> groups_;
};

}  // namespace cohort::testing

#endif  // COHORT_WORKER_PARALLEL_TESTING_DEVICE_RANKS_H_
