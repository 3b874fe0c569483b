#include "client/flight_report.h"

#include "client/flight_catalog.h"
#include "gtest/gtest.h"
#include "tests/testing/in_process_store.h"

namespace cohort {
namespace {

// Rank `rank` of 3 in round 2, done with collectives 0..done-1, and
// inside collective `done` when `running`.
v1::FlightDump Dump(int rank, int done, bool running) {
  v1::FlightDump d;
  d.set_run("job");
  d.set_round(2);
  d.set_group("0");
  d.set_rank(rank);
  d.set_world_size(3);
  d.set_node(rank == 2 ? "node-b" : "node-a");
  for (int i = 0; i <= done; ++i) {
    if (i == done && !running) break;
    auto* op = d.add_ops();
    op->set_seq(i);
    op->set_op("AllReduce");
    op->set_dtype("f32");
    op->set_reduce("SUM");
    op->set_count(1024);
    op->set_root(-1);
    op->set_enqueued_us(1'700'000'000'000'000 + i * 1000);
    op->set_started_us(op->enqueued_us());
    if (i < done) {
      op->set_ended_us(op->started_us() + 10);
      op->set_state("done");
    } else {
      op->set_state("running");
    }
  }
  return d;
}

TEST(FlightReportTest, DiagnosisNamesTheRankThatNeverEnteredAndItsNode) {
  InProcessStore store;
  FlightCatalog catalog(&store, "job");
  ASSERT_TRUE(catalog.Publish(Dump(0, 5, true)).ok());
  ASSERT_TRUE(catalog.Publish(Dump(1, 5, true)).ok());
  ASSERT_TRUE(catalog.Publish(Dump(2, 5, false)).ok());
  FlightReportOptions options;
  options.request = false;
  auto text = DiagnoseReport(store, nullptr, "job", options);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_NE(text->find("run job round 2 group 0 (3 ranks dumped):"),
            std::string::npos)
      << *text;
  EXPECT_NE(text->find("ranks 0-1 are in AllReduce #5"), std::string::npos)
      << *text;
  EXPECT_NE(text->find("rank 2 last completed #4"), std::string::npos) << *text;
}

TEST(FlightReportTest, LivenessComesFromTheListedMembers) {
  const std::vector<Member> members = {
      Member{"node-a", 1, 0, "host-a", absl::Seconds(2)}};
  auto by_node = LivenessByNode(members, {"node-a", "node-b", ""});
  ASSERT_EQ(by_node.size(), 2u);
  EXPECT_TRUE(by_node["node-a"].alive);
  EXPECT_EQ(by_node["node-a"].since_heartbeat, absl::Seconds(2));
  EXPECT_FALSE(by_node["node-b"].alive);
  EXPECT_FALSE(by_node["node-b"].heartbeat_known);
  EXPECT_TRUE(LivenessByNode({}, {"node-a"}).empty());
}

TEST(FlightReportTest, ADumpRequestNamesWhoDidNotAnswer) {
  InProcessStore store;
  FlightCatalog catalog(&store, "job");
  auto d0 = Dump(0, 1, false);
  d0.set_request(1);  // Answers the request DumpReport is about to make.
  ASSERT_TRUE(catalog.Publish(d0).ok());
  ASSERT_TRUE(catalog.Publish(Dump(1, 1, false)).ok());
  FlightReportOptions options;
  options.answer_timeout = absl::Milliseconds(100);
  auto text = DumpReport(store, "job", options);
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_NE(text->find("round 2 group 0: rank 0 dumped (request 1)"),
            std::string::npos)
      << *text;
  EXPECT_NE(text->find("no answer to request 1 from group 0: ranks 1,2"),
            std::string::npos)
      << *text;
}

TEST(FlightReportTest, ARunWithoutDumpsIsNotFound) {
  InProcessStore store;
  FlightReportOptions options;
  options.answer_timeout = absl::Milliseconds(10);
  auto text = DiagnoseReport(store, nullptr, "nobody", options);
  EXPECT_EQ(text.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(text.status().message().find("runs/nobody/flight/"),
            std::string::npos);
}

}  // namespace
}  // namespace cohort
