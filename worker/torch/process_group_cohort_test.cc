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
void RunRanks(int size, const std::function<void(TorchBackend&)>& body) {
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
  RunRanks(2, [](TorchBackend& group) {
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
  RunRanks(3, [](TorchBackend& group) {
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
  RunRanks(2, [](TorchBackend& group) {
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
  RunRanks(2, [](TorchBackend& group) {
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

// A list whose tensors are views of one flat tensor is gathered straight
// into it (and a list that is not, through a staging copy): the same result.
TEST(ProcessGroupCohortTest, ListsThatAreViewsOfOneBufferAndListsThatAreNot) {
  RunRanks(2, [](TorchBackend& group) {
    const int rank = group.getRank();
    at::Tensor flat = at::zeros({6}, at::kLong);
    std::vector<std::vector<at::Tensor>> views = {flat.chunk(2)};
    std::vector<at::Tensor> input = {at::full({3}, rank + 1, at::kLong)};
    group.allgather(views, input, c10d::AllgatherOptions())->wait();
    EXPECT_TRUE(flat.equal(at::tensor({1, 1, 1, 2, 2, 2}, at::kLong)));
    // Every other element: not consecutive.
    at::Tensor strided = at::zeros({12}, at::kLong);
    std::vector<std::vector<at::Tensor>> apart = {
        {strided.slice(0, 0, 3), strided.slice(0, 6, 9)}};
    group.allgather(apart, input, c10d::AllgatherOptions())->wait();
    EXPECT_TRUE(apart[0][1].equal(at::full({3}, 2, at::kLong)));
    EXPECT_EQ(strided.sum().item<int64_t>(), 9);
  });
}

#if COHORT_TORCH_BACKEND
TEST(ProcessGroupCohortTest, PremulSumIsTheSumTimesTheFactor) {
  RunRanks(2, [](TorchBackend& group) {
    const int rank = group.getRank();
    c10d::AllreduceOptions half;
    half.reduceOp = c10d::makeNCCLPreMulSum(0.5);
    std::vector<at::Tensor> t = {at::full({4}, rank + 1.0)};
    group.allreduce(t, half)->wait();
    EXPECT_TRUE(t[0].equal(at::full({4}, 1.5)));

    c10d::ReduceScatterOptions quarter;
    quarter.reduceOp = c10d::makeNCCLPreMulSum(at::full({1}, 0.25));
    at::Tensor in = at::arange(4, at::kFloat) + rank;  // sum: 1, 3, 5, 7
    at::Tensor out = at::zeros({2});
    group._reduce_scatter_base(out, in, quarter)->wait();
    EXPECT_TRUE(out.equal(rank == 0 ? at::tensor({0.25f, 0.75f})
                                    : at::tensor({1.25f, 1.75f})));

    std::vector<at::Tensor> ints = {at::ones({2}, at::kInt)};
    EXPECT_THAT(ErrorOf([&] { group.allreduce(ints, half); }),
                HasSubstr("allreduce does not support ReduceOp.PREMUL_SUM on "
                          "dtype Int"));
  });
}

TEST(ProcessGroupCohortTest, CoalescedFormsFillEveryOutputInOneWork) {
  RunRanks(2, [](TorchBackend& group) {
    const int rank = group.getRank();
    std::vector<at::Tensor> inputs = {at::full({2}, rank, at::kByte),
                                      at::full({1}, 10 + rank, at::kByte)};
    std::vector<at::Tensor> outputs = {at::zeros({4}, at::kByte),
                                       at::zeros({2}, at::kByte)};
    c10::intrusive_ptr<c10d::Work> work = group.allgather_into_tensor_coalesced(
        outputs, inputs, c10d::AllgatherOptions());
    work->wait();
    EXPECT_TRUE(outputs[0].equal(at::tensor({0, 0, 1, 1}, at::kByte)));
    EXPECT_TRUE(outputs[1].equal(at::tensor({10, 11}, at::kByte)));
    EXPECT_EQ(work->getFuture()->value().toTensorVector().size(), 2u);

    std::vector<at::Tensor> big = {at::arange(4, at::kDouble),
                                   at::arange(2, at::kDouble)};
    std::vector<at::Tensor> small = {at::zeros({2}, at::kDouble),
                                     at::zeros({1}, at::kDouble)};
    c10d::ReduceScatterOptions avg;
    avg.reduceOp = c10d::ReduceOp::AVG;
    group.reduce_scatter_tensor_coalesced(small, big, avg)->wait();
    EXPECT_TRUE(
        small[0].equal(at::arange(2 * rank, 2 * rank + 2, at::kDouble)));
    EXPECT_TRUE(small[1].equal(at::full({1}, rank, at::kDouble)));
  });
}

// batch_isend_irecv's path: a ring of sends and receives between
// startCoalescing and endCoalescing, none of which blocks.
TEST(ProcessGroupCohortTest, CoalescingWorkCompletesWhenEveryOpHas) {
  RunRanks(2, [](TorchBackend& group) {
    const int rank = group.getRank();
    const int peer = 1 - rank;
    std::vector<at::Tensor> send = {at::full({3}, rank + 1.0)};
    std::vector<at::Tensor> recv = {at::zeros({3})};
    group.startCoalescing();
    group.recv(recv, peer, 0);
    group.send(send, peer, 0);
    c10::intrusive_ptr<c10d::Work> all = group.endCoalescing();
    all->wait();
    EXPECT_TRUE(recv[0].equal(at::full({3}, peer + 1.0)));
    EXPECT_THAT(ErrorOf([&] { group.endCoalescing(); }),
                HasSubstr("endCoalescing without startCoalescing"));
  });
}
#endif

}  // namespace
}  // namespace cohort
