#include "worker/collective/process_group.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
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

TEST(WorkTest, OnCompleteRunsOnceCompletedInOrder) {
  Work work;
  std::vector<std::string> calls;
  work.OnComplete([&](const absl::Status& s) {
    calls.push_back(absl::StrCat("first ", s.message()));
  });
  work.OnComplete([&](const absl::Status& s) {
    calls.push_back(absl::StrCat("second ", s.message()));
  });
  EXPECT_TRUE(calls.empty());
  std::thread completer([&] { work.Complete(absl::UnavailableError("gone")); });
  completer.join();
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0], "first gone");
  EXPECT_EQ(calls[1], "second gone");
  work.Complete(absl::OkStatus());  // Ignored: no callback runs again.
  EXPECT_EQ(calls.size(), 2u);
}

TEST(WorkTest, OnCompleteAfterCompletionRunsAtOnce) {
  std::shared_ptr<Work> work = Work::Done(absl::OkStatus());
  bool called = false;
  work->OnComplete([&](const absl::Status& s) { called = s.ok(); });
  EXPECT_TRUE(called);
}

TEST(BufferViewTest, OfTypedMemory) {
  int64_t values[3] = {};
  BufferView view = BufferView::Of(values, 3);
  EXPECT_EQ(view.dtype, Dtype::kI64);
  EXPECT_EQ(view.bytes(), 24u);
}

}  // namespace
}  // namespace cohort
