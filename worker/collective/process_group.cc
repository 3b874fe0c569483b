#include "worker/collective/process_group.h"

#include <utility>
#include <vector>

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

void Work::OnComplete(Callback callback) {
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    if (!completed_) {
      callbacks_.push_back(std::move(callback));
      return;
    }
    status = status_;
  }
  callback(status);
}

void Work::Complete(absl::Status status) {
  std::vector<Callback> callbacks;
  {
    absl::MutexLock lock(&mu_);
    if (completed_) return;
    completed_ = true;
    status_ = status;
    callbacks.swap(callbacks_);
  }
  for (Callback& callback : callbacks) callback(status);
}

uint64_t WireBytes(Traffic kind, uint64_t bytes, int size) {
  if (size <= 1) return 0;
  const uint64_t share =
      bytes * static_cast<uint64_t>(size - 1) / static_cast<uint64_t>(size);
  return kind == Traffic::kAllReduce ? 2 * share : share;
}

absl::Status VerifySameSizes(ProcessGroup& group,
                             absl::Span<const size_t> sizes,
                             absl::string_view what) {
  const int n = group.size();
  if (n <= 1) return absl::OkStatus();
  // FNV-1a over the sizes in order: two different lists of the same count
  // and total still differ here.
  uint64_t fingerprint = 0xcbf29ce484222325ull;
  uint64_t total = 0;
  for (size_t size : sizes) {
    fingerprint = (fingerprint ^ size) * 0x100000001b3ull;
    total += size;
  }
  int64_t mine[3] = {static_cast<int64_t>(sizes.size()),
                     static_cast<int64_t>(total),
                     static_cast<int64_t>(fingerprint)};
  std::vector<int64_t> all(3 * static_cast<size_t>(n));
  absl::Status status;
  if (DeviceMemory* device = group.device_memory(); device != nullptr) {
    const size_t bytes = sizeof(mine) + all.size() * sizeof(int64_t);
    absl::StatusOr<void*> staging = device->Allocate(bytes);
    if (!staging.ok()) return staging.status();
    auto* up = static_cast<int64_t*>(*staging);
    status = device->CopyToDevice(up, mine, sizeof(mine));
    if (status.ok()) {
      status = group
                   .AllGather(BufferView::Of(up, 3),
                              BufferView::Of(up + 3, all.size()))
                   ->Wait();
    }
    if (status.ok()) {
      status =
          device->CopyToHost(all.data(), up + 3, all.size() * sizeof(int64_t));
    }
    device->Free(*staging);
  } else {
    status = group
                 .AllGather(BufferView::Of(mine, 3),
                            BufferView::Of(all.data(), all.size()))
                 ->Wait();
  }
  if (!status.ok()) return status;
  for (int r = 1; r < n; ++r) {
    const int64_t* theirs = &all[3 * static_cast<size_t>(r)];
    if (theirs[0] != all[0] || theirs[1] != all[1] || theirs[2] != all[2]) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": rank ", r, "'s parameter sizes differ from rank 0's (",
          theirs[0], " sizes summing to ", theirs[1], " against ", all[0],
          " summing to ", all[1],
          theirs[0] == all[0] && theirs[1] == all[1] ? ": the same sizes, "
                                                       "in another order"
                                                     : "",
          "); every rank must pass the same model"));
    }
  }
  return absl::OkStatus();
}

}  // namespace cohort
