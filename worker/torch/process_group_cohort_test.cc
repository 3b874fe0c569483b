#include "worker/torch/process_group_cohort.h"

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"

namespace cohort {
namespace {

using ::testing::HasSubstr;

// Runs `body` on `size` ranks, each a thread with its own group, all
// bootstrapping through one torch HashStore. The body sees the group as
// torch's callers do, through the base class (and its default options).
void RunRanks(int size, const std::function<void(c10d::ProcessGroup&)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      c10::intrusive_ptr<ProcessGroupCohort> group = ProcessGroupCohort::Create(
          store, rank, size, std::chrono::seconds(20));
      body(*group);
    });
  }
  for (std::thread& thread : threads) thread.join();
}

std::string ErrorOf(const std::function<void()>& call) {
  try {
    call();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(ProcessGroupCohortTest, AllReduceInPlaceAndThroughAContiguousCopy) {
  RunRanks(2, [](c10d::ProcessGroup& group) {
    const int rank = group.getRank();
    std::vector<at::Tensor> flat = {at::full({4}, rank + 1.0)};
    group.allreduce(flat, c10d::AllreduceOptions())->wait();
    EXPECT_TRUE(flat[0].equal(at::full({4}, 3.0)));

    // A transposed view: reduced in a contiguous copy, written back.
    at::Tensor base = at::arange(6, at::kLong).view({2, 3}) * (rank + 1);
    std::vector<at::Tensor> view = {base.t()};
    ASSERT_FALSE(view[0].is_contiguous());
    c10d::AllreduceOptions max;
    max.reduceOp = c10d::ReduceOp::MAX;
    group.allreduce(view, max)->wait();
    EXPECT_TRUE(base.equal(at::arange(6, at::kLong).view({2, 3}) * 2));

    c10d::AllreduceOptions avg;
    avg.reduceOp = c10d::ReduceOp::AVG;
    std::vector<at::Tensor> halves = {at::full({3}, rank * 2.0, at::kHalf)};
    group.allreduce(halves, avg)->wait();
    EXPECT_TRUE(halves[0].equal(at::full({3}, 1.0, at::kHalf)));
  });
}

TEST(ProcessGroupCohortTest, ListOutputsAreFilledWhenTheWorkCompletes) {
  RunRanks(3, [](c10d::ProcessGroup& group) {
    const int rank = group.getRank();
    // Rank r contributes r + 1 elements of value r.
    std::vector<at::Tensor> input = {at::full({rank + 1}, rank, at::kInt)};
    std::vector<std::vector<at::Tensor>> output(1);
    for (int r = 0; r < 3; ++r)
      output[0].push_back(at::zeros({r + 1}, at::kInt));
    c10::intrusive_ptr<c10d::Work> work =
        group.allgather(output, input, c10d::AllgatherOptions());
    c10::intrusive_ptr<c10::ivalue::Future> future = work->getFuture();
    future->wait();
    EXPECT_TRUE(work->isCompleted());
    EXPECT_TRUE(work->isSuccess());
    for (int r = 0; r < 3; ++r) {
      EXPECT_TRUE(output[0][r].equal(at::full({r + 1}, r, at::kInt))) << r;
    }
    std::vector<at::Tensor> value = future->value().toTensorVector();
    ASSERT_EQ(value.size(), 3u);
    EXPECT_TRUE(value[2].is_same(output[0][2]));
  });
}

TEST(ProcessGroupCohortTest, RefusesWhatCohortCannotMoveBeforeSending) {
  RunRanks(2, [](c10d::ProcessGroup& group) {
    std::vector<at::Tensor> flags = {at::ones({2}, at::kBool)};
    EXPECT_THAT(ErrorOf([&] { group.allreduce(flags); }),
                HasSubstr("allreduce does not support dtype Bool"));
    c10d::AllreduceOptions band;
    band.reduceOp = c10d::ReduceOp::BAND;
    std::vector<at::Tensor> ints = {at::ones({2}, at::kInt)};
    EXPECT_THAT(ErrorOf([&] { group.allreduce(ints, band); }),
                HasSubstr("does not support ReduceOp.BAND"));
    std::vector<at::Tensor> two = {at::ones({2}), at::ones({2})};
    EXPECT_THAT(ErrorOf([&] { group.broadcast(two); }),
                HasSubstr("broadcast takes one tensor per process, got 2"));
    EXPECT_THAT(ErrorOf([&] { group.recvAnysource(ints, 0); }),
                HasSubstr("cohort does not support recvAnysource"));
    // Nothing was sent: the group still works.
    group.barrier()->wait();
  });
}

TEST(ProcessGroupCohortTest, AnOpThatFailsThrowsCohortsStatusFromWait) {
  RunRanks(2, [](c10d::ProcessGroup& group) {
    const int rank = group.getRank();
    std::vector<at::Tensor> tensors = {at::ones({4 + rank})};
    c10::intrusive_ptr<c10d::Work> work = group.allreduce(tensors);
    EXPECT_THAT(ErrorOf([&] { work->wait(); }),
                HasSubstr("cohort: INVALID_ARGUMENT: AllReduce SUM"));
    EXPECT_TRUE(work->isCompleted());
    EXPECT_FALSE(work->isSuccess());
    EXPECT_TRUE(work->getFuture()->hasError());
  });
}

}  // namespace
}  // namespace cohort
