#include "proto/flight/diagnose.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace cohort::flight {
namespace {

using cohort::v1::FlightDump;
using cohort::v1::FlightOp;

constexpr int64_t kT0 = 1'800'000'000'000'000;  // Microseconds.

FlightOp* Add(FlightDump& d, uint64_t seq, const std::string& state,
              int64_t started_us, const std::string& op = "AllReduce",
              uint64_t count = 1048576) {
  FlightOp* o = d.add_ops();
  o->set_seq(seq);
  o->set_op(op);
  o->set_dtype("f32");
  o->set_reduce(op == "AllReduce" ? "SUM" : "");
  o->set_root(op == "Broadcast" ? 0 : -1);
  o->set_count(count);
  o->set_enqueued_us(started_us);
  o->set_started_us(state == "queued" ? 0 : started_us);
  o->set_ended_us(state == "done" ? started_us + 100 : 0);
  o->set_state(state);
  return o;
}

// `world` ranks that all completed seqs 0..done-1, rank r entering each at
// kT0 + seq * 1000 + late(r) microseconds.
std::vector<FlightDump> Ranks(int world, int done,
                              int64_t (*late)(int rank) = nullptr) {
  std::vector<FlightDump> dumps(world);
  for (int r = 0; r < world; ++r) {
    dumps[r].set_rank(r);
    dumps[r].set_world_size(world);
    dumps[r].set_group("0");
    for (int s = 0; s < done; ++s) {
      Add(dumps[r], s, "done", kT0 + s * 1000 + (late ? late(r) : 0));
    }
  }
  return dumps;
}

TEST(DiagnoseTest, RankRangesCollapseRuns) {
  EXPECT_EQ(RankRanges({4, 0, 1, 2, 6, 7, 2}), "0-2,4,6-7");
  EXPECT_EQ(RankRanges({3}), "3");
  EXPECT_EQ(RankRanges({}), "");
}

TEST(DiagnoseTest, NamesTheRankThatNeverEnteredTheOp) {
  std::vector<FlightDump> dumps = Ranks(8, 1042);
  for (int r = 0; r < 8; ++r) {
    if (r != 3) Add(dumps[r], 1042, "running", kT0 + 5'000'000);
  }
  const Diagnosis d = Diagnose(dumps, {{3, Liveness{true, absl::Seconds(2)}}});
  ASSERT_FALSE(d.findings.empty());
  const Finding& f = d.findings[0];
  EXPECT_EQ(f.kind, Finding::Kind::kHang);
  EXPECT_EQ(f.ranks, std::vector<int>{3});
  EXPECT_EQ(f.seq, 1042u);
  EXPECT_NE(f.sentence.find("ranks 0-2,4-7 are in AllReduce #1042 of group 0 "
                            "(SUM, f32, 1048576 elements) since "),
            std::string::npos)
      << f.sentence;
  EXPECT_NE(f.sentence.find("rank 3 last completed #1041 and has not entered "
                            "#1042 (its last heartbeat was 2 s ago)"),
            std::string::npos)
      << f.sentence;
}

TEST(DiagnoseTest, ADeadRankIsNamedAsTheCulpritAndAsDead) {
  std::vector<FlightDump> dumps = Ranks(3, 5);
  Add(dumps[0], 5, "running", kT0 + 9000);
  Add(dumps[1], 5, "running", kT0 + 9000);
  dumps.pop_back();  // Rank 2 died: no records.
  const Diagnosis d = Diagnose(dumps, {{2, Liveness{false, absl::Seconds(31)}}},
                               {.world_size = 3});
  ASSERT_GE(d.findings.size(), 2u);
  EXPECT_EQ(d.findings[0].kind, Finding::Kind::kHang);
  EXPECT_EQ(d.findings[0].ranks, std::vector<int>{2});
  EXPECT_NE(d.findings[0].sentence.find(
                "rank 2 sent no flight records (dead in membership; its last "
                "heartbeat was 31 s ago)"),
            std::string::npos)
      << d.findings[0].sentence;
  EXPECT_EQ(d.findings.back().kind, Finding::Kind::kDead);
}

TEST(DiagnoseTest, DifferentOpsAtOneSeqAreAMismatch) {
  std::vector<FlightDump> dumps = Ranks(3, 7);
  Add(dumps[0], 7, "running", kT0 + 8000);
  Add(dumps[1], 7, "running", kT0 + 8000);
  Add(dumps[2], 7, "running", kT0 + 8000, "Broadcast");
  const Diagnosis d = Diagnose(dumps, {});
  ASSERT_FALSE(d.findings.empty());
  EXPECT_EQ(d.findings[0].kind, Finding::Kind::kMismatch);
  EXPECT_EQ(d.findings[0].ranks, std::vector<int>{2});
  EXPECT_NE(d.findings[0].sentence.find(
                "ops differ at #7 of group 0: ranks 0-1 issued AllReduce (SUM, "
                "f32, 1048576 elements); rank 2 issued Broadcast (root 0, f32, "
                "1048576 elements)"),
            std::string::npos)
      << d.findings[0].sentence;
}

TEST(DiagnoseTest, TheSameOpWithAnotherSizeIsAnArgumentMismatch) {
  std::vector<FlightDump> dumps = Ranks(2, 3);
  Add(dumps[0], 3, "running", kT0 + 4000, "AllReduce", 1024);
  Add(dumps[1], 3, "running", kT0 + 4000, "AllReduce", 512);
  const Diagnosis d = Diagnose(dumps, {});
  ASSERT_FALSE(d.findings.empty());
  EXPECT_EQ(d.findings[0].kind, Finding::Kind::kArgumentMismatch);
  EXPECT_NE(d.findings[0].sentence.find("arguments differ at #3"),
            std::string::npos);
  EXPECT_NE(d.findings[0].sentence.find("512 elements"), std::string::npos);
}

TEST(DiagnoseTest, AFailedOpIsReportedWithItsError) {
  std::vector<FlightDump> dumps = Ranks(2, 2);
  FlightOp* op = Add(dumps[1], 2, "failed", kT0 + 3000);
  op->set_error("DEADLINE_EXCEEDED: waited 30 s for rank 0");
  Add(dumps[0], 2, "done", kT0 + 3000);
  const Diagnosis d = Diagnose(dumps, {});
  ASSERT_EQ(d.findings.size(), 1u);
  EXPECT_EQ(d.findings[0].kind, Finding::Kind::kFailed);
  EXPECT_EQ(d.findings[0].sentence,
            "rank 1's AllReduce #2 failed: DEADLINE_EXCEEDED: waited 30 s for "
            "rank 0");
}

TEST(DiagnoseTest, RanksThatTimedOutWaitingNameTheRankThatNeverCame) {
  std::vector<FlightDump> dumps = Ranks(3, 4);
  for (int r : {0, 2}) {
    Add(dumps[r], 4, "failed", kT0 + 9000)
        ->set_error("DEADLINE_EXCEEDED: waited 5 s");
  }
  const Diagnosis d = Diagnose(dumps, {});
  ASSERT_EQ(d.findings.size(), 2u);
  EXPECT_EQ(d.findings[0].kind, Finding::Kind::kHang);
  EXPECT_EQ(d.findings[0].ranks, std::vector<int>{1});
  EXPECT_NE(d.findings[0].sentence.find(
                "ranks 0,2 failed in AllReduce #4 of group 0 (SUM, f32, "
                "1048576 elements), entered at "),
            std::string::npos)
      << d.findings[0].sentence;
  EXPECT_NE(d.findings[0].sentence.find(
                "; rank 1 last completed #3 and has not entered #4"),
            std::string::npos)
      << d.findings[0].sentence;
  EXPECT_EQ(d.findings[1].kind, Finding::Kind::kFailed);
}

TEST(DiagnoseTest, OneFailedOpOnManyRanksIsOneFinding) {
  std::vector<FlightDump> dumps = Ranks(5, 2);
  for (int r : {0, 1, 2, 4}) {
    Add(dumps[r], 2, "failed", kT0 + 3000)
        ->set_error(absl::StrCat("UNAVAILABLE: rank ", r, " lost rank 3"));
  }
  Add(dumps[3], 2, "done", kT0 + 3000);
  const Diagnosis d = Diagnose(dumps, {});
  ASSERT_EQ(d.findings.size(), 1u);
  EXPECT_EQ(d.findings[0].ranks, (std::vector<int>{0, 1, 2, 4}));
  EXPECT_EQ(d.findings[0].sentence,
            "AllReduce #2 failed on ranks 0-2,4; rank 0's error: UNAVAILABLE: "
            "rank 0 lost rank 3");
}

TEST(DiagnoseTest, TheRankThatEntersLastIsTheStraggler) {
  const std::vector<FlightDump> dumps =
      Ranks(4, 60, [](int r) -> int64_t { return r == 2 ? 12'000 : 100 * r; });
  const Diagnosis d = Diagnose(dumps, {});
  ASSERT_EQ(d.findings.size(), 1u);
  EXPECT_EQ(d.findings[0].kind, Finding::Kind::kStraggler);
  EXPECT_EQ(d.findings[0].ranks, std::vector<int>{2});
  EXPECT_EQ(d.findings[0].sentence,
            "rank 2 is the straggler of group 0: it entered last in 50 of the "
            "last 50 collectives, on average 12.0 ms after the first rank");
}

TEST(DiagnoseTest, AHealthyGroupHasNothingToReport) {
  const Diagnosis d = Diagnose(Ranks(4, 20), {});
  EXPECT_TRUE(d.findings.empty());
  EXPECT_EQ(d.Text(),
            "no problem found: the ranks' records agree and no op is stuck\n");
}

TEST(DiagnoseTest, PointToPointOpsDoNotShiftTheCollectives) {
  std::vector<FlightDump> dumps = Ranks(2, 3);
  // Rank 0 sent twice, rank 1 received once: their Send/Recv seqs differ,
  // and the collectives still line up.
  FlightOp* send = Add(dumps[0], 0, "done", kT0, "Send", 16);
  send->set_root(1);
  Add(dumps[0], 1, "done", kT0, "Send", 16)->set_root(1);
  Add(dumps[1], 0, "done", kT0, "Recv", 16)->set_root(0);
  EXPECT_TRUE(Diagnose(dumps, {}).findings.empty());
}

}  // namespace
}  // namespace cohort::flight
