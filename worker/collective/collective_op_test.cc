#include "worker/collective/collective_op.h"


#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace cohort {
namespace {

constexpr GroupShape kRank1Of2 = {.rank = 1, .size = 2};

TEST(CollectiveOpTest, NamesSayWhatEveryRankMustAgreeOn) {
  float f[4] = {};
  double d[8] = {};
  const size_t counts[2] = {3, 1};
  EXPECT_EQ(CollectiveOp::Broadcast(BufferView::Of(f, 4), 1).Name(),
            "Broadcast of 4 f32 from root 1");
  EXPECT_EQ(
      CollectiveOp::AllReduce(BufferView::Of(f, 4), ReduceOp::kSum).Name(),
      "AllReduce SUM of 4 f32");
  EXPECT_EQ(
      CollectiveOp::Reduce(BufferView::Of(d, 2), 0, ReduceOp::kMax).Name(),
      "Reduce MAX of 2 f64 to root 0");
  EXPECT_EQ(CollectiveOp::AllGather(BufferView::Of(d, 4), BufferView::Of(d, 8))
                .Name(),
            "AllGather of 4 f64");
  EXPECT_EQ(CollectiveOp::AllGatherV(BufferView::Of(f, 1), BufferView::Of(f, 4),
                                     counts)
                .Name(),
            "AllGatherV of 4 f32");
  EXPECT_EQ(CollectiveOp::Gather(BufferView::Of(f, 2), BufferView::Of(f, 4), 0)
                .Name(),
            "Gather of 2 f32 to root 0");
  EXPECT_EQ(CollectiveOp::Scatter(BufferView::Of(f, 4), BufferView::Of(f, 2), 1)
                .Name(),
            "Scatter of 2 f32 from root 1");
  EXPECT_EQ(
      CollectiveOp::AllToAll(BufferView::Of(f, 4), BufferView::Of(f, 4)).Name(),
      "AllToAll of 4 f32");
  // Send counts differ from rank to rank: the name leaves them out.
  EXPECT_EQ(CollectiveOp::AllToAllV(BufferView::Of(f, 4), counts,
                                    BufferView::Of(f, 4), counts)
                .Name(),
            "AllToAllV of f32");
  EXPECT_EQ(CollectiveOp::ReduceScatter(BufferView::Of(f, 4),
                                        BufferView::Of(f, 2), ReduceOp::kAvg)
                .Name(),
            "ReduceScatter AVG of 4 f32");
  EXPECT_EQ(CollectiveOp::Barrier().Name(), "Barrier");
  EXPECT_EQ((PointToPointOp{true, BufferView::Of(f, 4), 3, 7}.Name()),
            "Send to rank 3 with tag 7");
  EXPECT_EQ((PointToPointOp{false, BufferView::Of(f, 4), 1, 9}.Name()),
            "Recv from rank 1 with tag 9");
}

TEST(CollectiveOpTest, KindsAndEmptiness) {
  float f[4] = {};
  const CollectiveOp all_reduce =
      CollectiveOp::AllReduce(BufferView::Of(f, 4), ReduceOp::kSum);
  EXPECT_TRUE(all_reduce.in_place());
  EXPECT_TRUE(all_reduce.is_reduction());
  EXPECT_EQ(all_reduce.input.data, all_reduce.output.data);
  EXPECT_FALSE(all_reduce.empty());
  const CollectiveOp reduce_scatter = CollectiveOp::ReduceScatter(
      BufferView::Of(f, 4), BufferView::Of(f, 2), ReduceOp::kSum);
  EXPECT_FALSE(reduce_scatter.in_place());
  EXPECT_TRUE(reduce_scatter.is_reduction());
  EXPECT_FALSE(CollectiveOp::Broadcast(BufferView::Of(f, 4), 0).is_reduction());

  EXPECT_TRUE(
      CollectiveOp::AllGather(BufferView::Of(f, 0), BufferView::Of(f, 0))
          .empty());
  // Scatter's input is the root's alone: the output says what moves.
  EXPECT_TRUE(
      CollectiveOp::Scatter(BufferView::Of(f, 4), BufferView::Of(f, 0), 0)
          .empty());
  EXPECT_FALSE(CollectiveOp::Barrier().empty());
  const size_t none[2] = {0, 0};
  EXPECT_FALSE(
      CollectiveOp::AllGatherV(BufferView::Of(f, 0), BufferView::Of(f, 0), none)
          .empty())
      << "other ranks may send";
}

TEST(CollectiveOpTest, CheckIsTheKindsCheck) {
  float f[4] = {};
  absl::Status bad_root =
      CollectiveOp::Broadcast(BufferView::Of(f, 4), 2).Check(kRank1Of2);
  EXPECT_EQ(bad_root.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad_root.message(), "root 2")) << bad_root;
  absl::Status bad_blocks =
      CollectiveOp::ReduceScatter(BufferView::Of(f, 4), BufferView::Of(f, 1),
                                  ReduceOp::kSum)
          .Check(kRank1Of2);
  EXPECT_EQ(bad_blocks.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CollectiveOp::Barrier().Check(kRank1Of2).ok());
  absl::Status self =
      PointToPointOp{true, BufferView::Of(f, 4), 1, 0}.Check(kRank1Of2);
  EXPECT_TRUE(absl::StrContains(self.message(), "Send to rank 1 with tag 0"))
      << self;
}

}  // namespace
}  // namespace cohort
