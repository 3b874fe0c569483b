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

uint64_t WireBytes(Traffic kind, uint64_t bytes, int size) {
  if (size <= 1) return 0;
  const uint64_t share =
      bytes * static_cast<uint64_t>(size - 1) / static_cast<uint64_t>(size);
  return kind == Traffic::kAllReduce ? 2 * share : share;
}

}  // namespace cohort
