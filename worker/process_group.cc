#include "worker/process_group.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace cohort {

std::shared_ptr<Work> Work::Done(absl::Status status) {
  auto work = std::make_shared<Work>();
  work->Complete(std::move(status));
  return work;
}

absl::Status Work::Wait(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  const absl::Condition completed(&completed_);
  if (!mu_.AwaitWithTimeout(completed, timeout)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "op still running after waiting ", absl::FormatDuration(timeout)));
  }
  return status_;
}

bool Work::IsCompleted() const {
  absl::MutexLock lock(&mu_);
  return completed_;
}

absl::Status Work::status() const {
  absl::MutexLock lock(&mu_);
  if (!completed_) return absl::UnknownError("op still running");
  return status_;
}

void Work::Complete(absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (completed_) return;
  completed_ = true;
  status_ = std::move(status);
}

}  // namespace cohort
