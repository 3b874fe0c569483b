#include "base/log_limiter.h"

#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace cohort::base {
namespace {

TEST(LogLimiterTest, OneLineAnIntervalThenTheCountLeftOut) {
  std::vector<std::string> lines;
  // The test's own clock: which lines fall in one interval depends on it
  // alone, not on how fast this thread runs.
  absl::Time now = absl::UnixEpoch();
  LogLimiter limited([&](absl::string_view l) { lines.emplace_back(l); },
                     absl::Milliseconds(200), [&] { return now; });
  limited.Log("first");
  now += absl::Milliseconds(199);
  limited.Log("second");
  limited.Log("third");
  EXPECT_EQ(lines, std::vector<std::string>{"first"});
  now += absl::Milliseconds(1);
  limited.Log("fourth");
  now += absl::Milliseconds(150);
  limited.Log("fifth");
  now += absl::Milliseconds(50);
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
