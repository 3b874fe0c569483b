// ProcessGroupCohort: torch.distributed's c10d::ProcessGroup (PyTorch 1.13)
// over a cohort ProcessGroup (worker/collective/process_group.h), so that
// torch code, DDP included, runs its collectives on cohort's engine and
// Gloo backend. cohort_torch (module.cc) registers it as the c10d backend
// "cohort".
//
// Tensors: dense CPU tensors of cohort's dtypes (float32, float64, float16,
// bfloat16, int8, uint8, int32, int64), one per op and process (torch's
// rule for CPU groups). A non-contiguous tensor is copied into a contiguous
// one for the op and the result copied back. Anything else, and reduce ops
// other than SUM, PRODUCT, MIN, MAX and AVG, throw a c10::Error (a Python
// RuntimeError) naming the op and what it refused, before anything is sent.
//
// Every op returns at once a TorchWork (torch_work.h) that completes when
// cohort's op does; the output tensors are filled by then. Ops whose torch
// signature is a list of tensors (allgather, gather, scatter,
// reduce_scatter, alltoall, allreduce_coalesced) run on one flat staging
// tensor and copy between it and the list; the others read and write the
// caller's tensors in place. Errors of the op itself (a timeout, a dead
// peer, ranks issuing different ops) are cohort's statuses, thrown by
// wait(): see process_group.h for what each code means. Per-op timeouts in
// torch's options are ignored: the group's timeout bounds every op.
#ifndef COHORT_WORKER_TORCH_PROCESS_GROUP_COHORT_H_
#define COHORT_WORKER_TORCH_PROCESS_GROUP_COHORT_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "torch/csrc/distributed/c10d/ProcessGroup.hpp"
#include "torch/csrc/distributed/c10d/Store.hpp"
#include "worker/collective/process_group.h"

namespace cohort {

class ProcessGroupCohort final : public c10d::ProcessGroup {
 public:
  // Creates the group of `rank` of `size` with cohort's Gloo backend,
  // bootstrapping through `store` (TorchStore, torch_store.h). Blocks
  // until every rank has arrived or `timeout` passes, which also bounds
  // every op. Throws a c10::Error with cohort's message on failure.
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
  std::unique_ptr<cohort::ProcessGroup> group_;
};

}  // namespace cohort

#endif  // COHORT_WORKER_TORCH_PROCESS_GROUP_COHORT_H_
