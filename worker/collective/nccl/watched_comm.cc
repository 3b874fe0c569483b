#include "worker/collective/nccl/watched_comm.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace cohort {
namespace {

// Polling backoff: spin this long with yields (an op of a few microseconds
// completes without a sleep), then sleep from 10 us doubling up to 1 ms.
constexpr absl::Duration kSpin = absl::Microseconds(50);
constexpr absl::Duration kMaxSleep = absl::Milliseconds(1);

class Backoff {
 public:
  void Pause() {
    const absl::Time now = absl::Now();
    if (now - start_ < kSpin) {
      std::this_thread::yield();
      return;
    }
    absl::SleepFor(sleep_);
    sleep_ = std::min(sleep_ * 2, kMaxSleep);
  }

 private:
  const absl::Time start_ = absl::Now();
  absl::Duration sleep_ = absl::Microseconds(10);
};

}  // namespace

WatchedComm::WatchedComm(std::unique_ptr<NcclCommunicator> comm,
                         std::string where, WatchdogOptions options)
    : where_(std::move(where)),
      options_(std::move(options)),
      comm_(std::move(comm)) {
  watchdog_ = std::thread([this] { RunWatchdog(); });
}

WatchedComm::~WatchedComm() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  watchdog_.join();
}

absl::Status WatchedComm::Call(
    absl::FunctionRef<absl::Status(NcclCommunicator&)> call) {
  absl::MutexLock serialized(&call_mu_);
  absl::Status failed;
  {
    absl::MutexLock lock(&mu_);
    if (!aborted_.ok()) return aborted_;
    absl::Status status = call(*comm_);
    if (status.ok()) {
      absl::StatusOr<bool> ready = comm_->Ready();
      if (ready.ok() && *ready) return absl::OkStatus();
      status = ready.status();
    }
    if (!status.ok()) {
      failed = absl::Status(status.code(),
                            absl::StrCat(where_, ": ", status.message()));
      if (!AbortLocked(failed)) return aborted_;
    }
  }
  if (!failed.ok()) {
    Report(failed);
    AbortNccl();
    return failed;
  }
  // NCCL left the call in progress: poll it to the end, letting the
  // watchdog in between.
  Backoff backoff;
  while (true) {
    backoff.Pause();
    absl::MutexLock lock(&mu_);
    if (!aborted_.ok()) return aborted_;
    absl::StatusOr<bool> ready = comm_->Ready();
    if (ready.ok() && *ready) return absl::OkStatus();
    if (!ready.ok()) {
      failed =
          absl::Status(ready.status().code(),
                       absl::StrCat(where_, ": ", ready.status().message()));
      if (!AbortLocked(failed)) return aborted_;
      break;
    }
  }
  Report(failed);
  AbortNccl();
  return failed;
}

absl::Status WatchedComm::Await(NcclEvent& event) {
  Backoff backoff;
  while (true) {
    absl::Status why = aborted();
    if (!why.ok()) return why;
    absl::StatusOr<bool> fired = event.Query();
    if (fired.ok() && *fired) return absl::OkStatus();
    if (!fired.ok()) {
      absl::Status failed(fired.status().code(),
                          absl::StrCat(where_, ": ", fired.status().message()));
      Abort(failed);
      return aborted();
    }
    backoff.Pause();
  }
}

WatchedComm::Watch::Watch(WatchedComm& comm, std::string name,
                          absl::Duration timeout, absl::Time deadline)
    : comm_(comm) {
  absl::MutexLock lock(&comm_.mu_);
  id_ = comm_.next_watch_++;
  comm_.deadlines_[id_] = Deadline{std::move(name), timeout, deadline};
}

WatchedComm::Watch::~Watch() {
  absl::MutexLock lock(&comm_.mu_);
  comm_.deadlines_.erase(id_);
}

void WatchedComm::Abort(absl::Status why) {
  bool aborted;
  {
    absl::MutexLock lock(&mu_);
    aborted = AbortLocked(why);
  }
  if (aborted) {
    Report(why);
    AbortNccl();
  }
}

absl::Status WatchedComm::aborted() const {
  absl::MutexLock lock(&mu_);
  return aborted_;
}

bool WatchedComm::AbortLocked(const absl::Status& why) {
  if (!aborted_.ok()) return false;
  aborted_ = why;
  return true;
}

// Without mu_: ncclCommAbort may wait for the communicator's stream, which
// may itself wait for work outside NCCL (a caller's stream it was made to
// wait for, a kernel that never ends), and nothing that only reads the
// status (Await, Call, aborted()) may wait behind it. Only the one thread
// whose AbortLocked returned true comes here, and once aborted_ is set no
// other thread calls into the communicator, so nothing races with it; the
// destructor joins the watchdog, which may be the thread in here.
void WatchedComm::AbortNccl() ABSL_NO_THREAD_SAFETY_ANALYSIS {
  comm_->Abort();
}

void WatchedComm::Report(const absl::Status& why) {
  if (options_.on_abort) options_.on_abort(why);
}

void WatchedComm::RunWatchdog() {
  while (true) {
    absl::Status why;
    {
      absl::MutexLock lock(&mu_);
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_;
      };
      mu_.AwaitWithTimeout(absl::Condition(&stopping), options_.interval);
      if (stopping_) return;
      if (!aborted_.ok()) continue;
      absl::StatusOr<bool> ready = comm_->Ready();
      if (!ready.ok()) {
        why = absl::Status(
            ready.status().code(),
            absl::StrCat(where_,
                         ": the watchdog aborted the NCCL communicator on an "
                         "asynchronous error (a peer or the network failed): ",
                         ready.status().message()));
      } else {
        const absl::Time now = absl::Now();
        for (const auto& [id, op] : deadlines_) {
          if (now < op.deadline) continue;
          why = absl::DeadlineExceededError(absl::StrCat(
              op.name, " did not complete within ",
              absl::FormatDuration(op.timeout), " (peers did not take part): ",
              "the watchdog aborted the NCCL communicator of ", where_));
          break;
        }
      }
      if (why.ok() || !AbortLocked(why)) continue;
    }
    Report(why);
    AbortNccl();
  }
}

}  // namespace cohort
