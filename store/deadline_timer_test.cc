#include "store/deadline_timer.h"

#include <atomic>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace cohort::store {
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
  auto id = timer.Schedule(absl::Now() + absl::Milliseconds(30),
                           [&] { ran = true; });
  EXPECT_TRUE(timer.Cancel(id));
  EXPECT_FALSE(timer.Cancel(id));
  absl::SleepFor(absl::Milliseconds(80));
  EXPECT_FALSE(ran);
}

TEST(DeadlineTimerTest, PastDeadlineRunsAtOnce) {
  DeadlineTimer timer;
  absl::Notification done;
  timer.Schedule(absl::Now() - absl::Seconds(1), [&] { done.Notify(); });
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(1)));
}

}  // namespace
}  // namespace cohort::store
