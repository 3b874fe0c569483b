// FakeNccl: an NcclApi for tests, with no GPU and no NCCL. The ranks of a
// test are threads of one process, each with its own FakeNcclApi over one
// FakeNcclWorld; "device memory" is host memory, so a test can fill and
// check buffers directly.
//
// It behaves as NCCL's nonblocking communicators do where the backend
// depends on it: an init is in progress until every rank of the
// communicator has called it (a rank that never comes leaves the others in
// progress for ever); a collective's n-th call on each rank is matched with
// the others' n-th and runs (on the host, with reduce.h's arithmetic, AVG
// as a sum divided by the ranks) once all have made it; Send and Recv match
// in issue order per pair of ranks; an event fires once every call before
// it on its communicator has run; Abort() makes the events fire. Tests
// inject an asynchronous error (Ready() then reports it) or a hang (calls
// are matched but never run, as a stuck kernel) per rank, and read the
// calls each rank made.
#ifndef COHORT_WORKER_COLLECTIVE_NCCL_FAKE_NCCL_API_H_
#define COHORT_WORKER_COLLECTIVE_NCCL_FAKE_NCCL_API_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/collective/nccl/nccl_api.h"

namespace cohort {

class FakeNcclWorld;

class FakeNcclApi final : public NcclApi {
 public:
  // `devices`: what DeviceCount() reports; 0 fails it as CUDA does on a
  // machine without a GPU.
  FakeNcclApi(std::shared_ptr<FakeNcclWorld> world, int devices = 1);
  ~FakeNcclApi() override;

  absl::StatusOr<int> DeviceCount() override;
  absl::StatusOr<NcclUniqueId> GetUniqueId() override;
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> InitRank(
      int device, int nranks, int rank,
      absl::Span<const NcclUniqueId> ids) override;
  absl::StatusOr<std::unique_ptr<DeviceStream>> NewStream(int device) override;
  absl::StatusOr<void*> Alloc(int device, size_t bytes) override;
  void Free(void* device_memory) override;

  // From now on every buffer passed to a collective, a copy or a kernel
  // must lie in memory Alloc() returned (and not freed), as on a GPU, where
  // a host pointer faults: other calls fail with INVALID_ARGUMENT and are
  // counted. By default the fake takes host pointers too.
  void RequireDeviceMemory();
  // Calls refused so under RequireDeviceMemory.
  int host_pointer_calls() const;

  // From now on every communicator of this api reports `error` from
  // Ready(), as NCCL does when a peer or the network failed.
  void InjectAsyncError(absl::Status error);
  // From now on the calls of this api's communicators are matched but
  // never run: their events never fire until an abort.
  void Hang();
  bool hanging() const;

  // The calls made on this api's communicators, in order: "InitRank(nranks=
  // 4, rank=1, ids=1, device=0)", "AllReduce(count=4, f32, SUM)",
  // "GroupStart", "Send(count=2, f32, peer=1)", "Abort", ...
  std::vector<std::string> calls() const;
  // From now on Abort() blocks until ReleaseAborts(), as ncclCommAbort
  // does while the communicator's stream waits for work outside NCCL.
  void HoldAborts();
  void ReleaseAborts();
  // How many of its communicators were aborted (Abort called, held or
  // not), and unique ids it made.
  int aborts() const;
  // Waits until aborts() >= n, at most `limit` (an abort decided by the
  // watchdog is carried out on its thread, just after the status that
  // ends the waits is set); returns aborts().
  int AwaitAborts(int n, absl::Duration limit = absl::Seconds(30));
  int unique_ids() const;
  // Bytes allocated and not freed; Alloc calls made.
  size_t allocated_bytes() const;
  int allocations_made() const;

 private:
  friend class FakeCommunicator;
  friend class FakeDeviceStream;
  void Log(std::string call);
  // A copy or memset on the host, logged and checked as a stream's would
  // be (communicators and DeviceStreams alike).
  absl::Status FakeCopy(void* dst, const void* src, size_t bytes,
                        CopyKind kind);
  absl::Status FakeMemset(void* dst, int value, size_t bytes);
  // OK unless RequireDeviceMemory() and [p, p + bytes) is not inside one
  // allocation.
  absl::Status CheckDevice(absl::string_view call, const void* p, size_t bytes);

  const std::shared_ptr<FakeNcclWorld> world_;
  const int devices_;
  mutable absl::Mutex mu_;
  std::vector<std::string> calls_ ABSL_GUARDED_BY(mu_);
  absl::Status async_error_ ABSL_GUARDED_BY(mu_);
  bool hang_ ABSL_GUARDED_BY(mu_) = false;
  bool hold_aborts_ ABSL_GUARDED_BY(mu_) = false;
  int aborts_ ABSL_GUARDED_BY(mu_) = 0;
  int unique_ids_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<void*, size_t> allocations_ ABSL_GUARDED_BY(mu_);
  bool require_device_memory_ ABSL_GUARDED_BY(mu_) = false;
  int host_pointer_calls_ ABSL_GUARDED_BY(mu_) = 0;
  int allocations_made_ ABSL_GUARDED_BY(mu_) = 0;
};

// The state shared by the ranks of a test: communicators by unique id and
// the calls waiting for their peers. Create one per test.
std::shared_ptr<FakeNcclWorld> NewFakeNcclWorld();

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_NCCL_FAKE_NCCL_API_H_
