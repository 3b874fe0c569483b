#include "worker/collective/process_group.h"

#include <thread>

#include "gtest/gtest.h"

namespace cohort {
namespace {

TEST(WorkTest, DoneIsCompleted) {
  std::shared_ptr<Work> work = Work::Done(absl::InvalidArgumentError("bad"));
  EXPECT_TRUE(work->IsCompleted());
  EXPECT_EQ(work->status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(work->Wait().code(), absl::StatusCode::kInvalidArgument);
}

TEST(WorkTest, WaitTimesOutWhileRunning) {
  Work work;
  EXPECT_FALSE(work.IsCompleted());
  EXPECT_EQ(work.status().code(), absl::StatusCode::kUnknown);
  EXPECT_EQ(work.Wait(absl::Milliseconds(10)).code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST(WorkTest, WaitReturnsOnCompletionAndFirstCompletionWins) {
  Work work;
  std::thread completer([&] {
    absl::SleepFor(absl::Milliseconds(20));
    work.Complete(absl::OkStatus());
  });
  EXPECT_TRUE(work.Wait(absl::Seconds(10)).ok());
  completer.join();
  work.Complete(absl::InternalError("late"));
  EXPECT_TRUE(work.status().ok());
}

TEST(BufferViewTest, OfTypedMemory) {
  int64_t values[3] = {};
  BufferView view = BufferView::Of(values, 3);
  EXPECT_EQ(view.dtype, Dtype::kI64);
  EXPECT_EQ(view.bytes(), 24u);
}

}  // namespace
}  // namespace cohort
