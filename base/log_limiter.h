// LogLimiter: passes log lines on at most once per interval, so that a
// flood of refused connections or bad input costs a line a second, not a
// line each; the next line passed on says how many were left out.
//
//   LogLimiter limited(options.log, absl::Seconds(1));
//   limited.Log(absl::StrCat("closing connection from ", peer, ": ", why));
//
// Not thread-safe: each user (an event loop, an accept thread) owns one.
#ifndef COHORT_BASE_LOG_LIMITER_H_
#define COHORT_BASE_LOG_LIMITER_H_

#include <cstdint>
#include <functional>
#include <utility>

#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace cohort::base {

class LogLimiter {
 public:
  // A null `sink` drops every line. `every` zero passes every line on.
  // `now` is the clock the interval is measured on (tests pass their own).
  LogLimiter(std::function<void(absl::string_view)> sink, absl::Duration every,
             std::function<absl::Time()> now = absl::Now)
      : sink_(std::move(sink)), every_(every), now_(std::move(now)) {}

  // Passes `line` to the sink unless one was passed on less than `every`
  // ago; then it only counts it. A line passed on after some were counted
  // ends with "(and N more such lines since the last one)".
  void Log(absl::string_view line);

 private:
  const std::function<void(absl::string_view)> sink_;
  const absl::Duration every_;
  const std::function<absl::Time()> now_;
  absl::Time last_ = absl::InfinitePast();
  uint64_t left_out_ = 0;
};

}  // namespace cohort::base

#endif  // COHORT_BASE_LOG_LIMITER_H_
