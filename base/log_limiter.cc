#include "base/log_limiter.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace cohort::base {

void LogLimiter::Log(absl::string_view line) {
  if (!sink_) return;
  const absl::Time now = now_();
  if (now - last_ < every_) {
    ++left_out_;
    return;
  }
  last_ = now;
  if (left_out_ == 0) {
    sink_(line);
    return;
  }
  sink_(absl::StrCat(line, " (and ", left_out_,
                     " more such lines since the last one)"));
  left_out_ = 0;
}

}  // namespace cohort::base
