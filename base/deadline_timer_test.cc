#include "base/deadline_timer.h"

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace cohort::base {
namespace {

TEST(DeadlineTimerTest, RunsInDeadlineOrder) {
  DeadlineTimer timer;
  absl::Mutex mu;
  std::vector<int> order;
  absl::Notification last;
  const absl::Time now = absl::Now();
  timer.Schedule(now + absl::Milliseconds(60), [&] {
    absl::MutexLock l(&mu);
    order.push_back(3);
    last.Notify();
  });
  timer.Schedule(now + absl::Milliseconds(20), [&] {
    absl::MutexLock l(&mu);
    order.push_back(1);
  });
  timer.Schedule(now + absl::Milliseconds(40), [&] {
    absl::MutexLock l(&mu);
    order.push_back(2);
  });
  ASSERT_TRUE(last.WaitForNotificationWithTimeout(absl::Seconds(5)));
  absl::MutexLock l(&mu);
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
  EXPECT_GE(absl::Now() - now, absl::Milliseconds(60));
}

TEST(DeadlineTimerTest, CancelledCallbackNeverRuns) {
  DeadlineTimer timer;
  std::atomic<bool> ran{false};
  const absl::Time now = absl::Now();
  auto id = timer.Schedule(now + absl::Milliseconds(30), [&] { ran = true; });
  EXPECT_TRUE(timer.Cancel(id));
  EXPECT_FALSE(timer.Cancel(id));
  // Callbacks run in deadline order on one thread: once a later one has
  // run, the cancelled one would have run before it.
  absl::Notification later;
  timer.Schedule(now + absl::Milliseconds(60), [&] { later.Notify(); });
  later.WaitForNotification();
  EXPECT_FALSE(ran);
}

TEST(DeadlineTimerTest, PastDeadlineRunsAtOnce) {
  DeadlineTimer timer;
  // Pending first: the timer thread may already sleep until its deadline.
  timer.Schedule(absl::Now() + absl::Hours(1), [] { std::abort(); });
  absl::Notification done;
  timer.Schedule(absl::Now() - absl::Seconds(1), [&] { done.Notify(); });
  // Runs without waiting for the hour: a timer that slept on or dropped it
  // hangs here until the test's timeout.
  done.WaitForNotification();
}

int Threads() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

TEST(DeadlineTimerTest, TimersShareOneThreadThatEndsWithTheLast) {
  const int before = Threads();
  {
    DeadlineTimer a;
    DeadlineTimer b;
    EXPECT_EQ(Threads(), before + 1);
    // A callback of one may run while the other is destroyed.
    absl::Notification a_ran, b_ran;
    a.Schedule(absl::Now(), [&] { a_ran.Notify(); });
    {
      DeadlineTimer c;
      c.Schedule(absl::Now() + absl::Hours(1), [] { std::abort(); });
    }
    b.Schedule(absl::Now(), [&] { b_ran.Notify(); });
    EXPECT_TRUE(a_ran.WaitForNotificationWithTimeout(absl::Seconds(5)));
    EXPECT_TRUE(b_ran.WaitForNotificationWithTimeout(absl::Seconds(5)));
  }
  // None left: no timer thread either (a process may fork now).
  EXPECT_EQ(Threads(), before);
  DeadlineTimer again;
  absl::Notification ran;
  again.Schedule(absl::Now(), [&] { ran.Notify(); });
  EXPECT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(5)));
}

}  // namespace
}  // namespace cohort::base
