// ProcessGroup: collective and point-to-point communication among the
// ranks of a job, as torch.distributed's ProcessGroup. Backends implement it
// over the op engine (op_engine.h), which keeps the rules below for them:
// Gloo in gloo/gloo_process_group.h, NCCL in nccl/nccl_process_group.h.
//
// Every op is asynchronous: it validates its arguments, queues the work and
// returns a Work handle at once. Ops run on the backend's own threads.
//
// The rules every caller follows, on every rank:
//  - Issue the collectives of a group in the same order on every rank, with
//    the same dtype, op, root and element counts. Backends pair the n-th
//    collective of one rank with the n-th of the others.
//  - Keep every buffer passed to an op alive and untouched until its Work
//    completes (the op reads and writes it from another thread).
//  - Every op ends: with OK, or with an error status on its Work.
//    INVALID_ARGUMENT: bad arguments (found before any byte is sent), or
//    ranks that issued different collectives (ProcessGroupOptions::
//    verify_ops). DEADLINE_EXCEEDED: peers did not take part within the
//    group's timeout. UNAVAILABLE: the connection to a peer broke (it
//    died). After a failure other than INVALID_ARGUMENT the group is
//    unusable (peers may be mid-op): later ops end with FAILED_PRECONDITION
//    naming the first failure.
#ifndef COHORT_WORKER_COLLECTIVE_PROCESS_GROUP_H_
#define COHORT_WORKER_COLLECTIVE_PROCESS_GROUP_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "worker/collective/dtype.h"
#include "worker/collective/elementwise.h"

namespace cohort {

// A view of caller-owned memory: `count` elements of `dtype` at `data`.
// The caller keeps the memory alive until the op using it completes.
struct BufferView {
  void* data = nullptr;
  size_t count = 0;
  Dtype dtype = Dtype::kF32;

  size_t bytes() const { return count * DtypeSize(dtype); }

  // A view of `count` elements of a C++ type with a Dtype (dtype.h).
  template <typename T>
  static BufferView Of(T* data, size_t count) {
    return BufferView{data, count, DtypeOf<T>()};
  }
};

// The completion of one asynchronous op. Shared between the caller and the
// backend thread that runs the op; thread-safe.
class Work {
 public:
  Work() = default;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  // A Work that is already complete with `status` (for ops rejected before
  // they were queued).
  static std::shared_ptr<Work> Done(absl::Status status);

  // Blocks until the op completes or `timeout` passes. Returns the op's
  // status, or DEADLINE_EXCEEDED if it is still running then; the op goes
  // on and its own timeout still bounds it.
  absl::Status Wait(absl::Duration timeout = absl::InfiniteDuration());

  // Whether the op has completed, successfully or not. Never blocks.
  bool IsCompleted() const;

  // The op's status once completed; UNKNOWN ("still running") before.
  absl::Status status() const;

  using Callback = std::function<void(const absl::Status& status)>;
  // Calls `callback` with the op's status once the op has completed (its
  // buffers are the caller's again): at once, on this thread, if it already
  // has; else on the thread that completes it, a backend thread, after the
  // waiters are woken. Callbacks added before completion run in the order
  // they were added, outside any lock of the group's. Keep them short, and
  // never wait in one for another op of the same group: the backend thread
  // that would run that op may be the one running the callback.
  void OnComplete(Callback callback);

  // For backends: records the outcome, wakes the waiters and runs the
  // callbacks. Only the first call counts.
  void Complete(absl::Status status);

 private:
  mutable absl::Mutex mu_;
  bool completed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::vector<Callback> callbacks_ ABSL_GUARDED_BY(mu_);
};

// Options common to every backend. Defaults suit one job on one network.
struct ProcessGroupOptions {
  // Longest any op (and creating the group) may wait for its peers.
  absl::Duration timeout = absl::Seconds(300);
  // Threads that run ops. With one, ops run one at a time in issue order;
  // with more, up to that many consecutive ops run at once.
  int threads = 2;
  // Before each collective, the ranks compare what they are about to run
  // (op, dtype, element counts, root), so that ranks that disagree get
  // INVALID_ARGUMENT naming the difference instead of a hang, a wrong
  // result or a peer's bytes overrunning a buffer. Costs one small
  // all-gather (a round trip) per collective; turn off for speed once a
  // program is known to issue consistent ops.
  bool verify_ops = true;
  // Called, on the thread that ran it, with the status of each op that
  // fails (after the flight recorder has recorded the failure): the flight
  // dumper's trigger (init/flight_dumper.h). It must not block.
  std::function<void(const absl::Status&)> on_op_failure;
  // Ops the group's flight recorder keeps (flight_recorder.h); 0 keeps
  // none (and nothing is dumped). Each costs 64 bytes.
  size_t flight_records = 2000;
};

// The memory of a backend whose buffers the CPU cannot touch (NCCL's: GPU
// memory on the group's device). Each call returns once done. It is not
// queued behind the group's ops in flight (NCCL: it runs on a stream of its
// own), so REQUIRES: no pending op of the group uses the buffers a call
// touches (wait for its Work first). Host-memory backends have none.
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  virtual void Free(void* data) = 0;
  virtual absl::Status CopyToDevice(void* dst, const void* src,
                                    size_t bytes) = 0;
  virtual absl::Status CopyToHost(void* dst, const void* src, size_t bytes) = 0;
  virtual absl::Status CopyOnDevice(void* dst, const void* src,
                                    size_t bytes) = 0;
  virtual absl::Status Zero(void* data, size_t bytes) = 0;

  // The arithmetic DDP and FSDP run on their buffers without bringing them
  // to the host (device kernels, like the copies):
  // dst[i] += src[i] over `count` f32;
  virtual absl::Status AddF32(float* dst, const float* src, size_t count) = 0;
  // dst[i] = src[i] * scale, converted between f32, f16 and bf16 (rounding
  // to nearest even); equal counts, INVALID_ARGUMENT for other dtypes;
  virtual absl::Status Convert(BufferView dst, BufferView src, float scale) = 0;
  // one optimizer step (elementwise.h) on buffers in this memory.
  virtual absl::Status Update(const ElementwiseUpdate& update) = 0;
};

class FlightRecorder;  // flight_recorder.h

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;

  // The group's last ops (flight_recorder.h), or null for a group that
  // keeps none. Shared: readers may keep it after the group is gone.
  virtual std::shared_ptr<const FlightRecorder> flight_recorder() const {
    return nullptr;
  }

  // Null when the group's buffers are host memory (Gloo); else the memory
  // every BufferView passed to its ops must point into (NCCL: the GPU's).
  virtual DeviceMemory* device_memory() { return nullptr; }

  // This process's rank in the group, in [0, size()).
  virtual int rank() const = 0;
  // The number of ranks in the group.
  virtual int size() const = 0;

  // Copies `buffer` on rank `root` into `buffer` on every other rank.
  // INVALID_ARGUMENT if root is outside [0, size()).
  virtual std::shared_ptr<Work> Broadcast(BufferView buffer, int root) = 0;

  // Replaces `buffer` on every rank with the element-wise `op` of all
  // ranks' buffers (reduce.h defines the arithmetic; f16 and bf16 are
  // accumulated in f32 and rounded once).
  virtual std::shared_ptr<Work> AllReduce(BufferView buffer, ReduceOp op) = 0;

  // Reduces `buffer` across ranks with `op` into `buffer` on rank `root`;
  // the other ranks' buffers are left as they were.
  virtual std::shared_ptr<Work> Reduce(BufferView buffer, int root,
                                       ReduceOp op) = 0;

  // Writes every rank's `input` into `output`, rank r's at element
  // r * input.count. REQUIRES: output.count == input.count * size(), same
  // dtype (else INVALID_ARGUMENT).
  virtual std::shared_ptr<Work> AllGather(BufferView input,
                                          BufferView output) = 0;

  // AllGather with a count per rank: rank r contributes counts[r] elements
  // (its input.count), written at element counts[0] + ... + counts[r-1].
  // REQUIRES: counts.size() == size(), input.count == counts[rank()],
  // output.count == the sum of counts, same dtype.
  virtual std::shared_ptr<Work> AllGatherV(BufferView input, BufferView output,
                                           absl::Span<const size_t> counts) = 0;

  // Writes every rank's `input` into `output` on rank `root`, rank r's at
  // element r * input.count. `output` is ignored on other ranks.
  // REQUIRES on root: output.count == input.count * size(), same dtype.
  virtual std::shared_ptr<Work> Gather(BufferView input, BufferView output,
                                       int root) = 0;

  // Copies block r of `input` on rank `root` (size() blocks of
  // output.count elements) into `output` on rank r. `input` is ignored on
  // other ranks. REQUIRES on root: input.count == output.count * size().
  virtual std::shared_ptr<Work> Scatter(BufferView input, BufferView output,
                                        int root) = 0;

  // Block j of rank i's `input` goes to block i of rank j's `output`, the
  // blocks being input.count / size() elements. REQUIRES: input.count ==
  // output.count, a multiple of size(); same dtype.
  virtual std::shared_ptr<Work> AllToAll(BufferView input,
                                         BufferView output) = 0;

  // AllToAll with counts: this rank sends send_counts[j] elements to rank
  // j (the input's blocks in rank order) and receives recv_counts[j] from
  // rank j (the output's blocks in rank order). Rank i's send_counts[j]
  // must equal rank j's recv_counts[i]. REQUIRES: both spans have size()
  // entries summing to input.count and output.count; same dtype.
  virtual std::shared_ptr<Work> AllToAllV(
      BufferView input, absl::Span<const size_t> send_counts, BufferView output,
      absl::Span<const size_t> recv_counts) = 0;

  // Reduces `input` (size() blocks of output.count elements) across ranks
  // with `op` and leaves block r of the result in rank r's `output`.
  // REQUIRES: input.count == output.count * size(), same dtype.
  virtual std::shared_ptr<Work> ReduceScatter(BufferView input,
                                              BufferView output,
                                              ReduceOp op) = 0;

  // Completes once every rank has reached it.
  virtual std::shared_ptr<Work> Barrier() = 0;

  // Point-to-point. A Send to `dst_rank` with `tag` is matched with the
  // Recv from this rank with the same tag on `dst_rank`; messages with one
  // (peer, tag) pair match in issue order. Unlike collectives, Send and Recv
  // are posted to the transport when issued, not queued behind earlier ops:
  // wait for an earlier op writing `buffer` before sending it. The element
  // counts and dtypes of a matching Send and Recv must agree.
  // INVALID_ARGUMENT for a peer outside [0, size()) or equal to rank().
  virtual std::shared_ptr<Work> Send(BufferView buffer, int dst_rank,
                                     uint32_t tag) = 0;
  virtual std::shared_ptr<Work> Recv(BufferView buffer, int src_rank,
                                     uint32_t tag) = 0;
};

// Checks that every rank passed the same `sizes` (DDP and FSDP pass their
// parameters' element counts, so that ranks wrapping different models fail
// at once instead of reducing mismatched buffers). One all_gather of the
// count, the total and a fingerprint; call it on every rank. OK at world
// size 1. INVALID_ARGUMENT naming `what`, the first rank that differs from
// rank 0, and both sides' counts; the group's error if the exchange fails.
// On a group with device_memory() the exchange goes through a device buffer.
absl::Status VerifySameSizes(ProcessGroup& group,
                             absl::Span<const size_t> sizes,
                             absl::string_view what);

// The collectives whose traffic DDP and FSDP account.
enum class Traffic { kAllReduce, kAllGather, kReduceScatter, kBroadcast };

// The bytes each rank sends, on average, to run `kind` over `bytes` of data
// in a group of `size` ranks with a bandwidth-optimal (ring) algorithm:
// 2(n-1)/n x bytes for all_reduce, (n-1)/n x bytes for all_gather (bytes: the
// gathered output), reduce_scatter (bytes: the full input) and broadcast. 0 for
// one rank. DDP and FSDP report their traffic on this one scale, so that their
// figures compare (FSDP moves 1.5x DDP's bytes per step).
uint64_t WireBytes(Traffic kind, uint64_t bytes, int size);

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_PROCESS_GROUP_H_
