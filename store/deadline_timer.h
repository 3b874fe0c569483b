// DeadlineTimer: runs callbacks at given times on one background thread, so
// that thousands of pending timeouts cost one thread, not one each. Every
// DeadlineTimer in the process shares that thread (the store's, membership's
// and rendezvous's timeouts), which starts on first use.
#ifndef COHORT_STORE_DEADLINE_TIMER_H_
#define COHORT_STORE_DEADLINE_TIMER_H_

#include <cstdint>
#include <functional>

#include "absl/time/time.h"

namespace cohort::store {

class DeadlineTimer {
 public:
  using TimerId = uint64_t;

  DeadlineTimer();
  // Cancels this timer's pending callbacks and waits for one of them that
  // is running. REQUIRES: not called from this timer's callback.
  ~DeadlineTimer();

  DeadlineTimer(const DeadlineTimer&) = delete;
  DeadlineTimer& operator=(const DeadlineTimer&) = delete;

  // Runs `fn` on the timer thread at `when` (at once if it is in the past).
  // Callbacks run one at a time and must not block.
  TimerId Schedule(absl::Time when, std::function<void()> fn);

  // Removes a pending callback. Returns false if it already ran or is
  // running.
  bool Cancel(TimerId id);
};

}  // namespace cohort::store

#endif  // COHORT_STORE_DEADLINE_TIMER_H_
