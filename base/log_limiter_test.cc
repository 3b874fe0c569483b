#include "base/log_limiter.h"

#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace cohort::base {
namespace {

TEST(LogLimiterTest, OneLineAnIntervalThenTheCountLeftOut) {
  std::vector<std::string> lines;
  LogLimiter limited([&](absl::string_view l) { lines.emplace_back(l); },
                     absl::Milliseconds(200));
  limited.Log("first");
  limited.Log("second");
  limited.Log("third");
  EXPECT_EQ(lines, std::vector<std::string>{"first"});
  absl::SleepFor(absl::Milliseconds(250));
  limited.Log("fourth");
  limited.Log("fifth");
  absl::SleepFor(absl::Milliseconds(250));
  limited.Log("sixth");
  EXPECT_EQ(lines,
            (std::vector<std::string>{
                "first", "fourth (and 2 more such lines since the last one)",
                "sixth (and 1 more such lines since the last one)"}));
}

TEST(LogLimiterTest, ZeroIntervalPassesEverythingAndNullSinkNothing) {
  std::vector<std::string> lines;
  LogLimiter all([&](absl::string_view l) { lines.emplace_back(l); },
                 absl::ZeroDuration());
  all.Log("a");
  all.Log("b");
  EXPECT_EQ(lines, (std::vector<std::string>{"a", "b"}));
  LogLimiter none(nullptr, absl::ZeroDuration());
  none.Log("dropped");
}

}  // namespace
}  // namespace cohort::base
