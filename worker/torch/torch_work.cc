#include "worker/torch/torch_work.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>

#include "ATen/core/grad_mode.h"
#include "absl/strings/str_cat.h"

namespace cohort {
namespace {

// Runs each task on a thread that is not running another: an idle one, or
// a new one when none is. A task may block for as long as it likes (a
// future callback that issues another op and waits for it, as PowerSGD's
// do) without holding up the tasks after it, among them the completion it
// waits for. Threads idle for a while exit.
class Completer {
 public:
  static Completer& Get() {
    static Completer* const completer = new Completer();  // Never destroyed.
    return *completer;
  }

  void Run(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(task));
    if (idle_ > 0) {
      // Claims one idle thread for this task.
      --idle_;
      ++wakeups_;
      cv_.notify_one();
    } else {
      std::thread([this] { Loop(); }).detach();
    }
  }

  // Waits until no task is queued or running, or `timeout` passes.
  bool Drain(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return drained_.wait_for(
        lock, timeout, [this] { return tasks_.empty() && running_ == 0; });
  }

 private:
  static constexpr std::chrono::seconds kIdle{10};

  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      // There are at least as many threads here and claimed as tasks
      // queued, so a task never waits for a running one.
      while (!tasks_.empty()) {
        std::function<void()> task = std::move(tasks_.front());
        tasks_.pop_front();
        ++running_;
        lock.unlock();
        task();
        task = nullptr;  // What it holds goes without the lock too.
        lock.lock();
        if (--running_ == 0 && tasks_.empty()) drained_.notify_all();
      }
      ++idle_;
      if (!cv_.wait_for(lock, kIdle, [this] { return wakeups_ > 0; })) {
        --idle_;
        return;
      }
      --wakeups_;
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable drained_;
  std::deque<std::function<void()>> tasks_;
  int running_ = 0;
  int idle_ = 0;     // Threads waiting and not claimed.
  int wakeups_ = 0;  // Claims not yet taken up by a waiting thread.
};

}  // namespace

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

bool TorchWork::WaitForFutures(std::chrono::milliseconds timeout) {
  return Completer::Get().Drain(timeout);
}

bool TorchWork::isCompleted() { return c10d::Work::isCompleted(); }

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
  // The future completes right after the work's own state, on another
  // thread: after wait(), its value is there too.
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
  // The future runs its callbacks on the thread that completes it, and
  // torch's may issue another op of the group and wait for it (PowerSGD's
  // hook does): never on this backend thread, which that op may need.
  Completer::Get().Run([future = future_, outputs = outputs_, error] {
    if (error) {
      future->setError(error);
    } else {
      future->markCompleted(c10::IValue(outputs));
    }
  });
}

}  // namespace cohort
