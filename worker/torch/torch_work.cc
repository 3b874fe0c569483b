#include "worker/torch/torch_work.h"

#include <exception>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "absl/strings/str_cat.h"

namespace cohort {

c10::intrusive_ptr<TorchWork> TorchWork::Wrap(
    std::shared_ptr<cohort::Work> work, int rank, c10d::OpType type,
    std::vector<at::Tensor> outputs, std::vector<at::Tensor> keep,
    Finish finish) {
  auto wrapped = c10::make_intrusive<TorchWork>(
      rank, type, std::move(outputs), std::move(keep), std::move(finish));
  // The callback holds the TorchWork, and with it the tensors, until the op
  // ends; it runs at once if the op has already ended.
  work->OnComplete(
      [wrapped](const absl::Status& status) { wrapped->Complete(status); });
  return wrapped;
}

TorchWork::TorchWork(int rank, c10d::OpType type,
                     std::vector<at::Tensor> outputs,
                     std::vector<at::Tensor> keep, Finish finish)
    : c10d::Work(rank, type),
      outputs_(std::move(outputs)),
      keep_(std::move(keep)),
      finish_(std::move(finish)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {}

bool TorchWork::isCompleted() { return future_->completed(); }

bool TorchWork::wait(std::chrono::milliseconds timeout) {
  std::exception_ptr error;  // The op's, or a timeout of this wait.
  try {
    c10d::Work::wait(timeout);
  } catch (...) {
    error = std::current_exception();
  }
  bool completed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    completed = completed_;
  }
  // The future completes right after the work's own state, on the same
  // thread.
  if (completed) future_->wait();
  if (error) std::rethrow_exception(error);
  return true;
}

std::vector<at::Tensor> TorchWork::result() { return outputs_; }

c10::intrusive_ptr<c10::ivalue::Future> TorchWork::getFuture() {
  return future_;
}

void TorchWork::Complete(const absl::Status& status) {
  std::exception_ptr error;
  if (!status.ok()) {
    error = std::make_exception_ptr(
        std::runtime_error(absl::StrCat("cohort: ", status.ToString())));
  } else if (finish_) {
    try {
      // The copies are not part of any autograd graph, and may write into
      // leaves that require grad.
      at::NoGradGuard no_grad;
      finish_();
    } catch (...) {
      error = std::current_exception();
    }
  }
  finish_ = nullptr;
  keep_.clear();
  finish(error);
  if (error) {
    future_->setError(error);
  } else {
    future_->markCompleted(c10::IValue(outputs_));
  }
}

}  // namespace cohort
