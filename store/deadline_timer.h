// DeadlineTimer: runs callbacks at given times on one background thread, so
// that thousands of pending timeouts cost one thread, not one each.
#ifndef COHORT_STORE_DEADLINE_TIMER_H_
#define COHORT_STORE_DEADLINE_TIMER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace cohort::store {

class DeadlineTimer {
 public:
  using TimerId = uint64_t;

  DeadlineTimer();
  // Cancels whatever is pending and joins the thread. REQUIRES: not called
  // from a timer callback.
  ~DeadlineTimer();

  DeadlineTimer(const DeadlineTimer&) = delete;
  DeadlineTimer& operator=(const DeadlineTimer&) = delete;

  // Runs `fn` on the timer thread at `when` (at once if it is in the past).
  // Callbacks run one at a time and must not block.
  TimerId Schedule(absl::Time when, std::function<void()> fn);

  // Removes a pending callback. Returns false if it already ran or is
  // running.
  bool Cancel(TimerId id);

 private:
  void Loop();

  absl::Mutex mu_;
  std::map<std::pair<absl::Time, TimerId>, std::function<void()>> queue_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<TimerId, absl::Time> when_ ABSL_GUARDED_BY(mu_);
  TimerId next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace cohort::store

#endif  // COHORT_STORE_DEADLINE_TIMER_H_
