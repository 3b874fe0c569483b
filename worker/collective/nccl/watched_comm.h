// WatchedComm: one NCCL communicator under a watchdog. It serializes the
// calls into the communicator, keeps the deadline of every op in flight on
// it, and runs a thread that every `interval` polls the communicator for an
// asynchronous error (ncclCommGetAsyncError) and the deadlines. On an
// asynchronous error, an expired deadline or a failed call it aborts the
// communicator (ncclCommAbort: the communicator is nonblocking, so nothing
// waits on a peer) once, and from then on every call and every wait
// returns the status that aborted it. The first such status goes to
// `on_abort` (the group's error reporter). The status is set, and waits
// end with it, before ncclCommAbort is called: the abort itself can wait
// on the GPU (for a stream the communicator's waits on, seen on an H200),
// and an op's failure must not wait behind it.
#ifndef COHORT_WORKER_COLLECTIVE_NCCL_WATCHED_COMM_H_
#define COHORT_WORKER_COLLECTIVE_NCCL_WATCHED_COMM_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/collective/nccl/nccl_api.h"

namespace cohort {

struct WatchdogOptions {
  // How often the watchdog polls for asynchronous errors and deadlines.
  absl::Duration interval = absl::Milliseconds(100);
  // Called once with the status that aborted the communicator (on the
  // watchdog's thread, or on the thread whose call failed), with no lock
  // held. May be empty.
  std::function<void(const absl::Status&)> on_abort;
};

class WatchedComm {
 public:
  // `where` names the communicator in messages ("nccl process group
  // 'nccl' (communicator comm/0), rank 1 of 4").
  WatchedComm(std::unique_ptr<NcclCommunicator> comm, std::string where,
              WatchdogOptions options);
  // Stops the watchdog, then destroys the communicator.
  ~WatchedComm();

  WatchedComm(const WatchedComm&) = delete;
  WatchedComm& operator=(const WatchedComm&) = delete;

  // Runs `call` on the communicator, serialized with every other call, and
  // then polls it until NCCL has finished what the call left in progress.
  // The status that aborted the communicator if it was or gets aborted; a
  // failed call aborts it (NCCL leaves a communicator whose call failed
  // unusable). Waits on no peer: the deadline of the op the call belongs to
  // (Watch) bounds it through the watchdog.
  absl::Status Call(absl::FunctionRef<absl::Status(NcclCommunicator&)> call);

  // Polls `event` until it fires (OK), CUDA reports an error for the work
  // before it (which aborts the communicator), or the communicator is
  // aborted. Spins briefly, then sleeps in growing steps up to 1 ms.
  absl::Status Await(NcclEvent& event);

  // An op in flight: while a Watch lives, the watchdog aborts the
  // communicator once `deadline` passes, with DEADLINE_EXCEEDED saying
  // that `name` did not complete within `timeout`.
  class Watch {
   public:
    Watch(WatchedComm& comm, std::string name, absl::Duration timeout,
          absl::Time deadline);
    ~Watch();
    Watch(const Watch&) = delete;
    Watch& operator=(const Watch&) = delete;

   private:
    WatchedComm& comm_;
    int64_t id_;
  };

  // Aborts the communicator (once) because of `why`, which every later
  // call returns.
  void Abort(absl::Status why);
  // OK, or the status that aborted the communicator.
  absl::Status aborted() const;

  const std::string& where() const { return where_; }

 private:
  struct Deadline {
    std::string name;
    absl::Duration timeout;
    absl::Time deadline;
  };

  void RunWatchdog();
  // Aborts with `why` unless already aborted; returns whether it did (the
  // caller then reports `why` once the lock is released).
  bool AbortLocked(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ncclCommAbort, without mu_: by the thread whose AbortLocked returned
  // true, after it released mu_.
  void AbortNccl();
  void Report(const absl::Status& why);

  const std::string where_;
  const WatchdogOptions options_;

  // Held for a whole Call, polling included: NCCL takes no other call on a
  // communicator while one is in progress. Taken before mu_.
  absl::Mutex call_mu_;
  // Held for each call into the communicator (the watchdog's too).
  mutable absl::Mutex mu_ ABSL_ACQUIRED_AFTER(call_mu_);
  const std::unique_ptr<NcclCommunicator> comm_ ABSL_PT_GUARDED_BY(mu_);
  absl::Status aborted_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t next_watch_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int64_t, Deadline> deadlines_ ABSL_GUARDED_BY(mu_);

  std::thread watchdog_;
};

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_NCCL_WATCHED_COMM_H_
