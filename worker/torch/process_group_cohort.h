// ProcessGroupCohort: torch.distributed's backend "cohort" over a cohort
// ProcessGroup (worker/collective/process_group.h), so that torch code, DDP,
// FSDP and the rest included, runs its collectives on cohort's engine and
// Gloo backend. Built twice from these sources: for PyTorch 2.x as a
// c10d::Backend (the venv's torch; TORCH_VERSION_MAJOR >= 2), and for
// Debian's PyTorch 1.13 as a c10d::ProcessGroup. cohort_torch (module.cc)
// registers it as "cohort", for CPU tensors.
//
// Tensors: dense CPU tensors of cohort's dtypes (float32, float64, float16,
// bfloat16, int8, uint8, int32, int64), one per op and process (torch's
// rule for CPU groups). A non-contiguous tensor is copied into a contiguous
// one for the op and the result copied back. Anything else, and reduce ops
// other than SUM, PRODUCT, MIN, MAX, AVG and (2.x) PREMUL_SUM, throw a
// c10::Error (a Python RuntimeError) naming the op and what it refused,
// before anything is sent. PREMUL_SUM(f), which only floating dtypes take,
// is f times the SUM (the factor scales the reduced result, in the tensor's
// dtype): NCCL's sum of f * x up to rounding, exactly so when f is a power
// of two (FSDP2's 1 / world size for worlds 2, 4, 8...).
//
// Every op returns at once a TorchWork (torch_work.h) that completes when
// cohort's op does; the output tensors are filled by then. Ops whose torch
// signature is a list of tensors (allgather, gather, scatter,
// reduce_scatter, alltoall, allreduce_coalesced) run on the list's memory
// directly when its tensors lie end to end in one buffer, in order (views of
// one flat tensor), and on one flat staging tensor they are copied from and
// to otherwise; the other ops read and write the caller's tensors in place.
// The *_coalesced forms issue one cohort op per tensor (pair) and return
// one Work for all. Errors of the op itself (a timeout, a dead peer, ranks
// issuing different ops) are cohort's statuses, thrown by wait(): see
// process_group.h for what each code means. Per-op timeouts in torch's
// options are ignored: the group's timeout bounds every op.
//
// Send and recv are posted to the transport when issued and never block
// the caller (batch_isend_irecv in a pipeline schedule issues a ring of
// them). On 2.x the backend supports torch's coalescing API: the Work that
// endCoalescing returns completes when every op issued since
// startCoalescing has.
//
// Timelines: with COHORT_TRACE=DIR the process writes DIR/trace-rank<R>.json
// (worker/collective/trace/timeline.h; R is $RANK, else the first group's
// rank), every group of the backend a thread "comm pg<N>" (N counting the
// groups this process made, in order) with its ops from cohort's flight
// recorder. Communication only: torch's compute, and the time backward
// spends waiting for DDP's buckets, happen in torch where the backend cannot
// see them, so the file has no compute or step spans (docs/debugging.md).
// Written every 5 s, when a group is destroyed and at exit.
#ifndef COHORT_WORKER_TORCH_PROCESS_GROUP_COHORT_H_
#define COHORT_WORKER_TORCH_PROCESS_GROUP_COHORT_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "torch/csrc/api/include/torch/version.h"
#include "torch/csrc/distributed/c10d/Store.hpp"
#include "worker/collective/process_group.h"

#if TORCH_VERSION_MAJOR >= 2
#define COHORT_TORCH_BACKEND 1
#include "torch/csrc/distributed/c10d/Backend.hpp"
#else
#define COHORT_TORCH_BACKEND 0
#include "torch/csrc/distributed/c10d/ProcessGroup.hpp"
#endif

namespace cohort {

// What a torch backend derives from: c10d::Backend in 2.x, the
// ProcessGroup itself in 1.13.
#if COHORT_TORCH_BACKEND
using TorchBackend = c10d::Backend;
#else
using TorchBackend = c10d::ProcessGroup;
#endif

class ProcessGroupCohort final : public TorchBackend {
 public:
  // Creates the group of `rank` of `size` with cohort's Gloo backend
  // (CreateGlooGroup, gloo_group.h), bootstrapping through `store`
  // (TorchStore, torch_store.h). Blocks until every rank has arrived or
  // `timeout` passes, which also bounds every op. Throws a c10::Error with
  // cohort's message on failure.
  static c10::intrusive_ptr<ProcessGroupCohort> Create(
      const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
      std::chrono::milliseconds timeout);

  // Over a group that is already connected. Use Create.
  explicit ProcessGroupCohort(std::unique_ptr<cohort::ProcessGroup> group);

  // Waits for the ops already issued to end (each bounded by the timeout),
  // inside the wait hook.
  ~ProcessGroupCohort() override;

  // Runs `wait`, which blocks until the group's backend threads are done,
  // after letting go of what they may need: the destroying thread may hold
  // Python's GIL (torch drops groups from Python and from DDP's Reducer with
  // it held), and a backend thread finishing an op may need it to free a
  // tensor whose Python object torch kept alive, or to run a Python future
  // callback. cohort_torch sets a hook that releases the GIL; without one,
  // `wait` runs as is.
  using WaitHook = void (*)(const std::function<void()>& wait);
  static void SetWaitHook(WaitHook hook);

  const std::string getBackendName() const override { return "cohort"; }
#if COHORT_TORCH_BACKEND
  bool supportsCoalescing() const override { return true; }
  // Ops issued between these two still run (and complete) on their own;
  // endCoalescing's Work completes once all of them have, with their
  // outputs as its result. REQUIRES: not already coalescing / coalescing.
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
#endif

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override;
  // Tensors of one dtype, reduced as one flat buffer.
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override;
  // Non-root ranks' tensors are left as they were.
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override;
  // Output tensor r gets rank r's input; ranks may pass inputs of different
  // sizes as long as every rank's output list has those sizes.
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::AllgatherOptions& opts) override;
  // One allgather per input, into the output list of the same index.
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& output_lists,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
#if COHORT_TORCH_BACKEND
  // One _allgather_base per (output, input) pair.
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
#endif
  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override;
#if COHORT_TORCH_BACKEND
  // One _reduce_scatter_base per (output, input) pair.
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
#endif
  // Splits count rows (dimension 0); empty splits are equal ones.
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output, at::Tensor& input,
      std::vector<int64_t>& output_split_sizes,
      std::vector<int64_t>& input_split_sizes,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& opts) override;
  // Tags are non-negative; a send matches the recv with the same peer and
  // tag, in issue order. recvAnysource is not supported.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors,
                                      int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors,
                                      int src_rank, int tag) override;

 private:
  struct Issued;  // An op handed to cohort (process_group_cohort.cc).

  // Several ops as one: done when all are, finished in order.
  static Issued Merge(std::vector<Issued> ops);
#if COHORT_TORCH_BACKEND
  // `issue` for each (output, input) pair, merged.
  Issued EachPair(std::vector<at::Tensor>& outputs,
                  std::vector<at::Tensor>& inputs, const char* op,
                  const std::function<Issued(at::Tensor&, at::Tensor&)>& issue);
#endif

  // The Work torch gets for `op`; while coalescing, also remembers it.
  c10::intrusive_ptr<c10d::Work> Submit(Issued op, c10d::OpType type);

  // The single-op bodies the coalesced forms repeat.
  Issued AllGatherList(std::vector<at::Tensor>& outputs, at::Tensor& input,
                       const char* op);
  Issued AllGatherFlat(at::Tensor& output, at::Tensor& input, const char* op);
  Issued ReduceScatterFlat(at::Tensor& output, at::Tensor& input,
                           const c10d::ReduceOp& reduce_op, const char* op);

  // A flat tensor of `numel` elements like `like`, for a list form's staging
  // copy: a view of the cached staging buffer when no op in flight holds it
  // (so a steady loop of list ops neither allocates nor page-faults its
  // staging memory again), else a new tensor. The cache keeps the largest
  // staging buffer asked for while free.
  at::Tensor Staging(int64_t numel, const at::Tensor& like);
  // The tensors of a list laid end to end in a Staging tensor.
  at::Tensor Flatten(const std::vector<at::Tensor>& tensors);

  std::unique_ptr<cohort::ProcessGroup> group_;
  int trace_id_ = -1;  // The group's in the process's timeline; -1: none.

  absl::Mutex staging_mu_;
  at::Tensor staging_ ABSL_GUARDED_BY(staging_mu_);  // bytes (kByte)

  // Between startCoalescing and endCoalescing: the ops issued meanwhile.
  absl::Mutex mu_;
  bool coalescing_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::shared_ptr<cohort::Work>> coalesced_works_
      ABSL_GUARDED_BY(mu_);
  std::vector<at::Tensor> coalesced_outputs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace cohort

#endif  // COHORT_WORKER_TORCH_PROCESS_GROUP_COHORT_H_
