// TorchWork: a torch c10d::Work over a cohort Work (process_group.h), as
// ProcessGroupCohort's ops return it.
//
// It completes when the cohort op does. On the backend thread that ends it,
// first `finish` runs (it copies results out of staging buffers into the
// caller's tensors), then the work's own state is set; then the future
// completes with the output tensors (or the error) on a thread of its own,
// not the backend's: the future runs its callbacks there, and torch's may
// issue another op of the group and wait for it (DDP's PowerSGD hook does),
// which needs the backend's threads free. So whoever sees the work complete
// (isCompleted(), the future) sees the outputs filled, and wait() returns
// once the future is done too. A failed op is a std::runtime_error
// ("cohort: DEADLINE_EXCEEDED: AllReduce SUM of 4 f32 on rank 1 of 2:
// ..."), thrown by wait() and held by exception() and the future; Python
// sees a RuntimeError.
#ifndef COHORT_WORKER_TORCH_TORCH_WORK_H_
#define COHORT_WORKER_TORCH_TORCH_WORK_H_

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "ATen/ATen.h"
#include "ATen/core/ivalue.h"
#include "torch/csrc/distributed/c10d/Work.hpp"
#include "worker/collective/process_group.h"

namespace cohort {

class TorchWork final : public c10d::Work {
 public:
  // Finishes an op whose results are in the caller's tensors once it ends
  // well; may throw (the work then fails with what it threw).
  using Finish = std::function<void()>;

  // Wraps `work`, issued by `rank` for an op of `type`. `outputs` are what
  // result() and the future's value are; `keep` holds every tensor the op
  // reads or writes (the caller's and staging ones) until it ends.
  static c10::intrusive_ptr<TorchWork> Wrap(std::shared_ptr<cohort::Work> work,
                                            int rank, c10d::OpType type,
                                            std::vector<at::Tensor> outputs,
                                            std::vector<at::Tensor> keep,
                                            Finish finish = nullptr);

  // Waits until the futures of the ops that have completed have run their
  // callbacks, or `timeout` passes; whether they have. cohort_torch calls it
  // (without the GIL) before Python finalizes: a callback still running
  // then, on its own thread, dies trying to take the GIL and aborts the
  // process (as it would on torch's gloo's threads).
  static bool WaitForFutures(std::chrono::milliseconds timeout);

  // Use Wrap: it also ties the new object to `work`'s completion.
  TorchWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
            std::vector<at::Tensor> keep, Finish finish);

  // Whether the op has completed and its outputs are filled (the future
  // completes right after, on another thread).
  bool isCompleted() override;
  // c10d::Work's wait (throws the op's error), then until the future is
  // complete. isSuccess and exception are c10d::Work's.
  bool wait(std::chrono::milliseconds timeout) override;
  std::vector<at::Tensor> result() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  // Runs once, on the thread that completes the cohort op.
  void Complete(const absl::Status& status);

  const std::vector<at::Tensor> outputs_;
  // Touched only by Complete, which runs once.
  std::vector<at::Tensor> keep_;
  Finish finish_;
  const c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace cohort

#endif  // COHORT_WORKER_TORCH_TORCH_WORK_H_
