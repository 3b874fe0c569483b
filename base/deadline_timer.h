// DeadlineTimer: runs callbacks at given times on one background thread, so
// that thousands of pending timeouts cost one thread, not one each. Every
// DeadlineTimer alive in the process shares that thread (the store's,
// membership's and rendezvous's timeouts): it starts with the first and is
// joined with the last, so a process with no timers has no timer thread.
#ifndef COHORT_BASE_DEADLINE_TIMER_H_
#define COHORT_BASE_DEADLINE_TIMER_H_

#include <cstdint>
#include <functional>

#include "absl/time/time.h"

namespace cohort::base {

class DeadlineTimer {
 public:
  using TimerId = uint64_t;

  DeadlineTimer();
  // Cancels this timer's pending callbacks and waits for one of them that
  // is running; the last timer alive also joins the shared thread.
  // REQUIRES: not called from a timer callback.
  ~DeadlineTimer();

  DeadlineTimer(const DeadlineTimer&) = delete;
  DeadlineTimer& operator=(const DeadlineTimer&) = delete;

  // Runs `fn` on the timer thread at `when` (at once if it is in the past).
  // Callbacks run one at a time and must not block.
  TimerId Schedule(absl::Time when, std::function<void()> fn);

  // Removes a pending callback. Returns false if it already ran or is
  // running.
  bool Cancel(TimerId id);

  struct Shared;

 private:
  Shared* shared_;
};

}  // namespace cohort::base

#endif  // COHORT_BASE_DEADLINE_TIMER_H_
