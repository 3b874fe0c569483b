#include "worker/collective/op_checks.h"

#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cohort {
namespace {

MATCHER_P(IsInvalid, words, "") {
  return arg.code() == absl::StatusCode::kInvalidArgument &&
         absl::StrContains(arg.message(), words);
}

constexpr GroupShape kRank1Of4 = {.rank = 1, .size = 4};

TEST(OpChecksTest, BuffersNeedData) {
  EXPECT_TRUE(CheckBuffer("Op", "input", {nullptr, 0, Dtype::kF32}).ok());
  EXPECT_THAT(CheckBuffer("Op", "input", {nullptr, 2, Dtype::kF32}),
              IsInvalid("Op: input has 2 elements but no data"));
  float f = 0;
  EXPECT_THAT(CheckBuffer("Op", "input", {&f, ~size_t{0}, Dtype::kF32}),
              IsInvalid("too large"));
}

TEST(OpChecksTest, RootsAndPeersAreRanksOfTheGroup) {
  float f[8] = {};
  EXPECT_TRUE(CheckBroadcast(kRank1Of4, BufferView::Of(f, 8), 3).ok());
  EXPECT_THAT(CheckBroadcast(kRank1Of4, BufferView::Of(f, 8), 4),
              IsInvalid("Broadcast: root 4 is not a rank of a group of 4"));
  EXPECT_THAT(CheckReduce(kRank1Of4, BufferView::Of(f, 8), -1),
              IsInvalid("root -1"));
  EXPECT_TRUE(
      CheckPointToPoint(kRank1Of4, "Send", BufferView::Of(f, 8), 0).ok());
  EXPECT_THAT(CheckPointToPoint(kRank1Of4, "Send", BufferView::Of(f, 8), 1),
              IsInvalid("another rank"));
  EXPECT_THAT(CheckPointToPoint(kRank1Of4, "Recv", BufferView::Of(f, 8), 4),
              IsInvalid("another rank"));
}

TEST(OpChecksTest, GatherAndScatterShapes) {
  float f[8] = {};
  double d[8] = {};
  EXPECT_TRUE(
      CheckAllGather(kRank1Of4, BufferView::Of(f, 2), BufferView::Of(f, 8))
          .ok());
  EXPECT_THAT(
      CheckAllGather(kRank1Of4, BufferView::Of(f, 2), BufferView::Of(f, 6)),
      IsInvalid("output has 6 elements; 4 ranks of 2 each need 8"));
  EXPECT_THAT(
      CheckAllGather(kRank1Of4, BufferView::Of(f, 2), BufferView::Of(d, 8)),
      IsInvalid("input is f32 but output is f64"));
  EXPECT_THAT(
      CheckReduceScatter(kRank1Of4, BufferView::Of(f, 7), BufferView::Of(f, 2)),
      IsInvalid("input has 7 elements"));
  // Gather's output and Scatter's input matter on the root only.
  EXPECT_TRUE(CheckGather(kRank1Of4, BufferView::Of(f, 2),
                          BufferView{nullptr, 0, Dtype::kF64}, 0)
                  .ok());
  EXPECT_THAT(
      CheckGather(kRank1Of4, BufferView::Of(f, 2), BufferView::Of(f, 2), 1),
      IsInvalid("output has 2 elements"));
  EXPECT_TRUE(
      CheckScatter(kRank1Of4, BufferView{}, BufferView::Of(f, 2), 3).ok());
  EXPECT_THAT(
      CheckScatter(kRank1Of4, BufferView::Of(d, 8), BufferView::Of(f, 2), 1),
      IsInvalid("input is f64 but output is f32"));
}

TEST(OpChecksTest, VariableCounts) {
  float f[8] = {};
  const std::vector<size_t> counts = {1, 2, 0, 3};
  EXPECT_TRUE(CheckAllGatherV(kRank1Of4, BufferView::Of(f, 2),
                              BufferView::Of(f, 6), counts)
                  .ok());
  EXPECT_THAT(CheckAllGatherV(kRank1Of4, BufferView::Of(f, 1),
                              BufferView::Of(f, 6), counts),
              IsInvalid("input has 1 elements but counts[1] is 2"));
  EXPECT_THAT(CheckAllGatherV(kRank1Of4, BufferView::Of(f, 2),
                              BufferView::Of(f, 6), {1, 2, 3}),
              IsInvalid("3 counts for a group of 4"));
  EXPECT_TRUE(CheckAllToAllV(kRank1Of4, BufferView::Of(f, 6), counts,
                             BufferView::Of(f, 8), {2, 2, 2, 2})
                  .ok());
  EXPECT_THAT(CheckAllToAllV(kRank1Of4, BufferView::Of(f, 6), counts,
                             BufferView::Of(f, 8), {2, 2, 2, 1}),
              IsInvalid("recv counts sum to 7 but the buffer has 8"));
  EXPECT_THAT(
      CheckAllToAll(kRank1Of4, BufferView::Of(f, 6), BufferView::Of(f, 6)),
      IsInvalid("a multiple of the group's size 4"));
}

TEST(CheckSameOpTest, NamesEveryRankThatIssuedAnotherOpAndSkipsEmptyNames) {
  EXPECT_TRUE(CheckSameOp("Barrier", {{0, "Barrier"}, {1, ""}}).ok());
  absl::Status s = CheckSameOp("AllReduce SUM of 4 f32",
                               {{0, "AllReduce SUM of 4 f32"},
                                {3, "Barrier"},
                                {5, "AllReduce SUM of 8 f32"}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "the ranks issued different ops: rank 3 issued 'Barrier', rank 5 "
            "issued 'AllReduce SUM of 8 f32'");
}

}  // namespace
}  // namespace cohort
