// DDP: data-parallel training where every rank holds a full replica of the
// model and gradients are averaged across ranks during backward, as
// torch.nn.parallel.DistributedDataParallel does. Framework-agnostic: the
// Reducer owns the gradient storage of the parameters it is given (by
// element count, in parameter order) and the caller's backward writes each
// gradient into grad(i) and calls MarkReady(i) when it is done.
//
//   auto reducer = cohort::Reducer::Create(group, sizes).value();
//   BroadcastFromRank0(*group, param_views);  // same start everywhere
//   for (step...) {
//     reducer->ZeroGrad();
//     for (i = last param .. first) {         // backward
//       WriteGradient(reducer->grad(i));
//       reducer->MarkReady(i);                // may start an all_reduce
//     }
//     reducer->Finish();                      // grads now averaged
//     optimizer->Step(...reducer->grad(i)...);
//   }
//
// Buckets. Gradients live in flat per-bucket buffers (grad(i) is a view, no
// copies): the parameters are packed in reverse order (backward produces
// the last layers' gradients first), and a bucket is closed as soon as it
// holds at least first_bucket_bytes (the first) or bucket_cap_bytes (the
// others), as torch does: parameters are never split, so a bucket exceeds
// its limit by less than its last parameter. A small first bucket starts
// communication early in backward. A bucket's all_reduce (AVG) starts as
// soon as all of its gradients are ready and all earlier buckets have
// started, so communication overlaps the rest of backward; every rank starts
// the buckets in the same order.
//
// Rebuild. The first Finish() that completes (normally the first
// iteration's) rebuilds the buckets in the order the gradients actually
// became ready on rank 0 (rank 0 broadcasts its order, so all ranks agree).
// Gradient values are carried over. grad(i) views taken before that
// Finish() are invalid afterwards.
//
// no_sync. Inside a NoSyncScope, MarkReady and Finish reduce nothing:
// gradients accumulate locally (backward adds into grad(i)). The first
// iteration after the scope reduces the accumulated sums. (When the very
// first iteration runs under no_sync, its Finish still broadcasts rank 0's
// ready order for the rebuild.) Whether an iteration synchronizes is decided
// at its first MarkReady, so it is reduced entirely or not at all.
//
// Every rank must mark every parameter ready exactly once per iteration.
//
// Device memory. On a group whose buffers are device memory (NCCL:
// ProcessGroup::device_memory()), the buckets are allocated on the group's
// device and grad(i) points there: the caller's backward kernels write it
// (order them with NcclProcessGroup::WaitForStream), and the host must not
// dereference it. Zeroing, the rebuild's copies and the compression hooks'
// casts are cudaMemsetAsync, cudaMemcpyAsync and kernels on the group's
// device (group_memory.h); no gradient is staged through the host. Only the
// rebuild's ready order (4 bytes a parameter, once) crosses it.
//
// Caller bugs, as in fsdp.h: methods that return a Status report them
// (INVALID_ARGUMENT, FAILED_PRECONDITION); grad(), which has no status to
// return, aborts the process with a message naming the call.
#ifndef COHORT_WORKER_PARALLEL_DDP_H_
#define COHORT_WORKER_PARALLEL_DDP_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/collective/process_group.h"

namespace cohort {

// One bucket of a Reducer's layout: the parameters it holds, in layout
// order, and where each starts, in elements from the bucket's start.
// Parameters are packed without gaps: parameter params[k] holds the
// elements from offsets[k] to offsets[k + 1] (or to `elements`).
struct ReducerBucket {
  std::vector<int> params;
  std::vector<size_t> offsets;
  size_t elements = 0;
};

// How a bucket's gradients are reduced. Launch starts the reduction and
// returns its Work; after that Work completes OK, Finalize runs on the
// thread calling Reducer::Finish(). When Finalize returns, `grads` must
// hold the average over ranks of every rank's `grads` (approximately, for
// compressing hooks). Launch is called once per bucket per synchronized
// iteration, in bucket order, identically on every rank; every bucket's
// Work has completed before the first Finalize, and the Finalizes run in
// bucket order, so a hook may issue (and wait for) more collectives there.
// A hook object serves one Reducer (the built-in ones keep per-bucket
// scratch).
class CommHook {
 public:
  virtual ~CommHook() = default;
  virtual std::string name() const = 0;
  virtual std::shared_ptr<Work> Launch(ProcessGroup& group, int bucket,
                                       BufferView grads) = 0;
  virtual absl::Status Finalize(int bucket, BufferView grads) {
    return absl::OkStatus();
  }

  // The Reducer's bucket layout, `buckets[b]` being bucket b's: called by
  // Reducer::Create once the layout is built, and again after the
  // first-iteration rebuild, each time before any Launch with that layout
  // and between iterations. A hook that needs to know which parameter lies
  // where (PowerSGD: each parameter is a matrix) sizes its scratch here. An
  // error fails Create (returned, prefixed "Reducer::Create: ") or the
  // rebuilding Finish (and the Reducer, as any failed reduction does).
  virtual absl::Status OnLayout(absl::Span<const ReducerBucket> buckets) {
    return absl::OkStatus();
  }

  // Bytes this hook has put on the wire so far, by WireBytes()
  // (process_group.h) for each collective it issued, for a hook whose
  // traffic is not the f32 bucket: Reducer::bytes_communicated() then counts
  // this (its growth since Create) instead of a bucket-sized all_reduce per
  // Launch. nullopt (the default): the Reducer assumes that each Launch
  // all_reduced the f32 bucket. A hook returns a value always or never.
  virtual std::optional<uint64_t> bytes_sent() const { return std::nullopt; }

  // Bytes of scratch the hook holds across iterations (in host or the
  // group's memory), for Reducer::grad_bytes(). Sized in OnLayout, so that
  // the figure is the steady state from Create on.
  virtual size_t scratch_bytes() const { return 0; }
};

// all_reduce(AVG) in place: the default.
std::shared_ptr<CommHook> AllReduceHook();
// Casts the bucket to f16 (divided by the world size first, so large sums
// do not overflow), all_reduces (SUM) the f16 copy and casts back: half the
// bytes on the wire, about 11 bits of precision. The copy and both casts
// stay in the buckets' memory (kernels on a device group).
std::shared_ptr<CommHook> Fp16CompressHook();
// The same with bf16: f32's range, about 8 bits of precision.
std::shared_ptr<CommHook> Bf16CompressHook();

struct ReducerOptions {
  size_t first_bucket_bytes = size_t{1} << 20;
  size_t bucket_cap_bytes = size_t{25} << 20;
  // Rebuild the buckets in ready order after the first iteration.
  bool rebuild_buckets = true;
  // false: start every bucket's reduction in Finish() instead of as soon as
  // it is ready (for measuring what the overlap hides).
  bool overlap = true;
  // Null means AllReduceHook().
  std::shared_ptr<CommHook> hook;
};

class Reducer {
 public:
  using Bucket = ReducerBucket;

  // `param_sizes[i]` is parameter i's element count (f32 gradients). A
  // collective: every rank calls it, and the ranks check that they all
  // passed the same sizes (VerifySameSizes). INVALID_ARGUMENT for no
  // parameters, a zero size, zero bucket sizes, or ranks that disagree.
  static absl::StatusOr<std::unique_ptr<Reducer>> Create(
      std::shared_ptr<ProcessGroup> group, std::vector<size_t> param_sizes,
      const ReducerOptions& options = {});

  // Waits for reductions still running.
  ~Reducer();

  int num_params() const;
  ProcessGroup& group() const;

  // Parameter i's gradient: a view into its bucket (in device memory on a
  // device group, see above). Valid until the next rebuild (see above).
  // Zero after Create and ZeroGrad(). REQUIRES:
  // 0 <= param < num_params(), else the process aborts (a wrong index would
  // write into another parameter's gradient).
  absl::Span<float> grad(int param);

  // Whether the buckets are in device memory (the group's).
  bool on_device() const;

  // Zeroes every gradient. REQUIRES: no iteration in progress. On a device
  // group a failed zeroing makes the reducer unusable, and the next
  // MarkReady or Finish reports it.
  void ZeroGrad();

  // Declares parameter `param`'s gradient final for this iteration.
  // INVALID_ARGUMENT for an index out of range, FAILED_PRECONDITION for a
  // parameter already marked in this iteration or a group that failed.
  absl::Status MarkReady(int param);

  // Waits for every bucket's reduction (starting those not started) and
  // ends the iteration; the gradients then hold the averages across ranks.
  // FAILED_PRECONDITION naming the parameters never marked ready; the
  // reduction's error otherwise (DEADLINE_EXCEEDED, UNAVAILABLE...).
  absl::Status Finish();

  // While alive, iterations accumulate gradients locally (see above).
  class NoSyncScope {
   public:
    explicit NoSyncScope(Reducer& reducer);
    ~NoSyncScope();
    NoSyncScope(const NoSyncScope&) = delete;
    NoSyncScope& operator=(const NoSyncScope&) = delete;

   private:
    Reducer& reducer_;
    bool previous_;
  };

  // The current bucket layout, in launch order.
  const std::vector<Bucket>& buckets() const;
  // Whether the first-iteration rebuild has happened.
  bool rebuilt() const;
  // Bytes this rank has sent, by WireBytes() (process_group.h): the ring
  // volume of each bucket's all_reduce as sent (after any compression; a
  // hook's own count where it keeps one, CommHook::bytes_sent()), plus the
  // rebuild's broadcast. 0 at world size 1.
  uint64_t bytes_communicated() const;
  // Bytes of gradient storage held (the buckets) plus hook scratch.
  size_t grad_bytes() const;

 private:
  struct State;
  explicit Reducer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// Makes every rank's `tensors` equal to rank 0's (DDP's initial parameter
// and buffer sync), coalescing them into broadcasts of up to `chunk_bytes`.
// Returns the first op's error. Tensors may have any dtypes. They are in
// the group's memory (device memory on NCCL), as is the packing buffer.
absl::Status BroadcastFromRank0(ProcessGroup& group,
                                absl::Span<const BufferView> tensors,
                                size_t chunk_bytes = size_t{25} << 20);

}  // namespace cohort

#endif  // COHORT_WORKER_PARALLEL_DDP_H_
