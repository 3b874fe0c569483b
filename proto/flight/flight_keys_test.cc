#include "proto/flight/flight_keys.h"

#include "gtest/gtest.h"

namespace cohort::flight {
namespace {

cohort::v1::FlightDump DumpWithOps(int rank, int ops, int64_t round = 3) {
  cohort::v1::FlightDump dump;
  dump.set_rank(rank);
  dump.set_world_size(2);
  dump.set_group("0");
  dump.set_round(round);
  dump.set_node(rank == 0 ? "node-a" : "node-b");
  dump.set_recorded(ops);
  for (int i = 0; i < ops; ++i) {
    auto* op = dump.add_ops();
    op->set_seq(i);
    op->set_op("AllReduce");
    op->set_dtype("f32");
    op->set_count(1024);
    op->set_state("done");
    op->set_enqueued_us(1000 + i);
    op->set_started_us(1000 + i);
    op->set_ended_us(1001 + i);
  }
  return dump;
}

TEST(FlightKeysTest, KeysSitUnderTheRunsPrefixWithRoundsInOrder) {
  EXPECT_EQ(FlightRequestKey("job"), "runs/job/flight/request");
  EXPECT_EQ(FlightDumpKey("job", 7, "0", 3),
            "runs/job/flight/dumps/000000000007/0/3");
  EXPECT_LT(FlightDumpKey("job", 9, "0", 0), FlightDumpKey("job", 10, "0", 0));
}

TEST(FlightKeysTest, EncodeDecodeRoundTrips) {
  const auto dump = DumpWithOps(1, 5);
  const std::string json = EncodeFlightDump(dump);
  auto back = DecodeFlightDump("k", json);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), dump.SerializeAsString());
}

TEST(FlightKeysTest, AnOversizedDumpKeepsItsNewestOps) {
  const auto dump = DumpWithOps(0, 2000);
  const std::string json = EncodeFlightDump(dump, 16 * 1024);
  EXPECT_LE(json.size(), 16u * 1024);
  auto back = DecodeFlightDump("k", json);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_GT(back->ops_size(), 10);
  ASSERT_LT(back->ops_size(), 2000);
  EXPECT_EQ(back->ops(back->ops_size() - 1).seq(), 1999u);
  EXPECT_EQ(back->recorded(), 2000u);
}

TEST(FlightKeysTest, AnAnswerSaysWhatTheDumpAnswered) {
  auto dump = DumpWithOps(1, 3);
  dump.set_request(7);
  dump.set_reason("timeout");
  const std::string key = FlightAnswerKey("job", 3, "0", 1);
  EXPECT_EQ(key, "runs/job/flight/answers/000000000003/0/1");
  auto a = DecodeFlightAnswer("job", key, EncodeFlightAnswer(dump));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->round, 3);
  EXPECT_EQ(a->group, "0");
  EXPECT_EQ(a->rank, 1);
  EXPECT_EQ(a->request, 7);
  EXPECT_EQ(a->reason, "timeout");
  EXPECT_EQ(a->world_size, 2);
  for (const auto& [k, v] : std::vector<std::pair<std::string, std::string>>{
           {key, "7 timeout"},
           {key, "x timeout 2"},
           {"runs/job/flight/answers/000000000003/1", "7 timeout 2"},
           {"runs/other/flight/answers/000000000003/0/1", "7 timeout 2"}}) {
    auto bad = DecodeFlightAnswer("job", k, v);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss) << k << " " << v;
  }
}

TEST(FlightKeysTest, GarbageIsDataLossNamingTheKey) {
  auto bad = DecodeFlightDump("runs/j/flight/dumps/x", "{not json");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(bad.status().message().find("runs/j/flight/dumps/x"),
            std::string::npos);
}

TEST(FlightKeysTest, DiagnoseRunReadsTheNewestRoundAndNodeLiveness) {
  // Round 2: both ranks fine. Round 3: rank 1 is one op behind, and its
  // node is dead in membership.
  std::vector<cohort::v1::FlightDump> dumps = {DumpWithOps(0, 4, 2),
                                               DumpWithOps(1, 4, 2)};
  auto r0 = DumpWithOps(0, 5);
  r0.mutable_ops(4)->set_state("running");
  r0.mutable_ops(4)->set_ended_us(0);
  dumps.push_back(r0);
  dumps.push_back(DumpWithOps(1, 4));
  std::map<std::string, Liveness> by_node;
  by_node["node-b"].alive = false;
  const auto groups = DiagnoseRun(dumps, by_node);
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].round, 3);
  EXPECT_EQ(groups[0].ranks_dumped, 2);
  bool dead = false;
  for (const auto& f : groups[0].diagnosis.findings) {
    if (f.kind == Finding::Kind::kDead) {
      dead = true;
      EXPECT_EQ(f.ranks, std::vector<int>{1});
    }
  }
  EXPECT_TRUE(dead) << groups[0].diagnosis.Text();
}

}  // namespace
}  // namespace cohort::flight

namespace cohort::flight {
namespace {

TEST(FlightKeysTest, AStartDumpGivesLivenessButNoRecords) {
  // Rank 1 only ever published its start dump: it is silent, and its node
  // is dead in membership.
  auto r0 = DumpWithOps(0, 5);
  r0.mutable_ops(4)->set_state("running");
  r0.mutable_ops(4)->set_ended_us(0);
  auto r1 = DumpWithOps(1, 0);
  r1.set_reason(kStartReason);
  std::map<std::string, Liveness> by_node;
  by_node["node-b"] = Liveness{false, absl::ZeroDuration(), false};
  const auto groups = DiagnoseRun({r0, r1}, by_node);
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].ranks_dumped, 1);
  const std::string text = groups[0].diagnosis.Text();
  EXPECT_NE(text.find("rank 1 sent no flight records (dead in membership)"),
            std::string::npos)
      << text;
}

TEST(FlightKeysTest, DiagnoseRunTakesTheRoundAskedFor) {
  const auto groups = DiagnoseRun(
      {DumpWithOps(0, 3, 1), DumpWithOps(1, 3, 1), DumpWithOps(0, 2, 2)}, {},
      {}, 1);
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].round, 1);
  EXPECT_EQ(groups[0].ranks_dumped, 2);
}

}  // namespace
}  // namespace cohort::flight
