#include "worker/torch/torch_work.h"

#include <atomic>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace cohort {
namespace {

TEST(TorchWorkTest, FinishRunsBeforeTheWorkAndItsFutureComplete) {
  auto work = std::make_shared<Work>();
  at::Tensor out = at::zeros({3});
  at::Tensor staging = at::full({3}, 7.0);
  std::atomic<bool> finished{false};
  c10::intrusive_ptr<TorchWork> wrapped = TorchWork::Wrap(
      work, /*rank=*/0, c10d::OpType::ALLGATHER, {out}, {out, staging}, [&] {
        out.copy_(staging);
        finished = true;
      });
  EXPECT_FALSE(wrapped->isCompleted());
  EXPECT_FALSE(wrapped->getFuture()->completed());

  std::thread backend([&] { work->Complete(absl::OkStatus()); });
  wrapped->wait(std::chrono::milliseconds(10000));
  EXPECT_TRUE(finished);
  EXPECT_TRUE(wrapped->isCompleted());
  EXPECT_TRUE(wrapped->isSuccess());
  EXPECT_TRUE(out.equal(staging));
  std::vector<at::Tensor> value =
      wrapped->getFuture()->value().toTensorVector();
  ASSERT_EQ(value.size(), 1u);
  EXPECT_TRUE(value[0].is_same(out));
  EXPECT_TRUE(wrapped->result()[0].is_same(out));
  backend.join();
}

// As PowerSGD's DDP hook does: a callback on one op's future waits for the
// next op, which the same backend thread completes. The callback must not
// run on that thread (it would wait for itself).
TEST(TorchWorkTest, AFutureCallbackMayWaitForTheNextOpOfTheBackendThread) {
  auto first = std::make_shared<Work>();
  auto second = std::make_shared<Work>();
  c10::intrusive_ptr<TorchWork> wrapped_first =
      TorchWork::Wrap(first, 0, c10d::OpType::ALLREDUCE, {}, {});
  c10::intrusive_ptr<TorchWork> wrapped_second =
      TorchWork::Wrap(second, 0, c10d::OpType::ALLREDUCE, {}, {});
  std::promise<void> waited;
  wrapped_first->getFuture()->addCallback([&](c10::ivalue::Future&) {
    wrapped_second->getFuture()->wait();
    waited.set_value();
  });
  std::thread backend([&] {
    first->Complete(absl::OkStatus());
    second->Complete(absl::OkStatus());
  });
  backend.join();
  // Fails rather than hangs if the callback is stuck.
  EXPECT_EQ(waited.get_future().wait_for(std::chrono::seconds(60)),
            std::future_status::ready);
}

TEST(TorchWorkTest, AFailedOpIsARuntimeErrorWithCohortsStatus) {
  auto work = std::make_shared<Work>();
  bool finished = false;
  c10::intrusive_ptr<TorchWork> wrapped = TorchWork::Wrap(
      work, 1, c10d::OpType::ALLREDUCE, {}, {}, [&] { finished = true; });
  work->Complete(absl::UnavailableError("AllReduce SUM of 4 f32: gone"));
  EXPECT_FALSE(finished);  // Nothing to copy out of a failed op.
  EXPECT_TRUE(wrapped->isCompleted());
  EXPECT_FALSE(wrapped->isSuccess());
  try {
    wrapped->wait(::kNoTimeout);
    FAIL() << "wait() did not throw";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()),
              "cohort: UNAVAILABLE: AllReduce SUM of 4 f32: gone");
  }
  EXPECT_TRUE(wrapped->getFuture()->hasError());
}

TEST(TorchWorkTest, AFinishThatThrowsFailsTheWork) {
  c10::intrusive_ptr<TorchWork> wrapped =
      TorchWork::Wrap(Work::Done(absl::OkStatus()), 0, c10d::OpType::GATHER, {},
                      {}, [] { throw std::runtime_error("copy failed"); });
  EXPECT_TRUE(wrapped->isCompleted());
  EXPECT_FALSE(wrapped->isSuccess());
  EXPECT_THROW(wrapped->wait(::kNoTimeout), std::runtime_error);
}

TEST(TorchWorkTest, WaitTimesOutWhileTheOpRuns) {
  auto work = std::make_shared<Work>();
  c10::intrusive_ptr<TorchWork> wrapped =
      TorchWork::Wrap(work, 0, c10d::OpType::BARRIER, {}, {});
  EXPECT_THROW(wrapped->wait(std::chrono::milliseconds(10)), c10::Error);
  EXPECT_FALSE(wrapped->isCompleted());
  work->Complete(absl::OkStatus());
  EXPECT_TRUE(wrapped->wait(::kNoTimeout));
}

}  // namespace
}  // namespace cohort
