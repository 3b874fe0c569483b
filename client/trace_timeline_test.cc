#include "client/trace_timeline.h"

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"

namespace cohort {
namespace {

// A rank's file as a Timeline writes it (timeline.h), from event bodies
// without pid.
std::string RankFile(int rank, const std::vector<std::string>& events,
                     int dropped_ops = 0) {
  std::vector<std::string> all = {
      absl::StrCat(R"({"ph":"M","pid":)", rank,
                   R"(,"name":"process_name","args":{"name":"rank )", rank,
                   R"("}})"),
      absl::StrCat(
          R"({"ph":"M","pid":)", rank,
          R"(,"tid":1,"name":"thread_name","args":{"name":"compute"}})")};
  for (const std::string& e : events) {
    all.push_back(absl::StrCat(R"({"pid":)", rank, ",", e, "}"));
  }
  return absl::StrCat(
      R"({"traceEvents":[)", absl::StrJoin(all, ",\n"),
      R"(],"displayTimeUnit":"ms","otherData":{"cohort_trace":1,"rank":)", rank,
      R"(,"world_size":2,"dropped_ops":)", dropped_ops, "}}");
}

std::string Step(int step, int64_t ts, int64_t dur) {
  return absl::StrCat(R"("ph":"X","tid":1,"cat":"step","name":"step","ts":)",
                      ts, R"(,"dur":)", dur, R"(,"args":{"step":)", step, "}");
}
std::string Compute(int64_t ts, int64_t dur) {
  return absl::StrCat(
      R"("ph":"X","tid":1,"cat":"compute","name":"forward","ts":)", ts,
      R"(,"dur":)", dur, R"(,"args":{"step":1})");
}
std::string Comm(int64_t ts, int64_t dur, const std::string& op = "AllReduce",
                 int bytes = 4000, int ranks = 4,
                 const std::string& state = "done") {
  return absl::StrCat(R"("ph":"X","tid":10,"cat":"comm","name":")", op,
                      R"(","ts":)", ts, R"(,"dur":)", dur, R"(,"args":{"op":")",
                      op, R"(","seq":0,"dtype":"f32","count":)", bytes / 4,
                      R"(,"bytes":)", bytes, R"(,"ranks":)", ranks,
                      R"(,"queued_us":0,"state":")", state, R"("})");
}

// Two ranks of one step with figures worked out by hand (below).
std::vector<TraceText> TwoRanks() {
  return {
      {"rank0.json",
       RankFile(0,
                {Step(1, 1000, 1000), Compute(1000, 300), Compute(1400, 200),
                 Comm(1250, 250), Comm(1700, 200),
                 Comm(1950, 150, "AllReduce", 4000, 4, "failed"),
                 Comm(100, 100, "Broadcast", 8000, 2),
                 Comm(2100, 50, "AllGather", 1000, 4),
                 Comm(2500, 10, "AllReduce", 4000, 4, "running")},
                /*dropped_ops=*/2)},
      {"rank1.json", RankFile(1, {Step(1, 1000, 2000), Compute(1000, 1000),
                                  Comm(1500, 1000)})},
  };
}

TEST(TraceTimelineTest, SummaryFiguresAreTheSpansUnionsAndIntersections) {
  absl::StatusOr<std::string> merged = MergeTraces(TwoRanks());
  ASSERT_TRUE(merged.ok()) << merged.status();
  absl::StatusOr<google::protobuf::Struct> trace =
      ParseTrace("merged", *merged);
  ASSERT_TRUE(trace.ok()) << trace.status();
  absl::StatusOr<TraceSummary> s = SummarizeTrace(*trace);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->ranks, (std::vector<int>{0, 1}));
  EXPECT_TRUE(s->has_compute);
  EXPECT_EQ(s->dropped_ops, 2u);
  EXPECT_EQ(s->unfinished_ops, 1);
  EXPECT_EQ(s->failed_ops, 1);

  // Rank 0, step [1000, 2000]: compute [1000,1300] + [1400,1600] = 500;
  // comm [1250,1500] + [1700,1900] + the failed op's [1950,2000] (clipped
  // to the step) = 500; overlap [1250,1300] + [1400,1500] = 150; exposed
  // 350; other 1000 - 500 - 350 = 150. Its comm outside the step counts in
  // all_comm alone: 100 + 250 + 200 + 150 + 50 = 750.
  ASSERT_EQ(s->per_rank.size(), 2u);
  const RankSummary& r0 = s->per_rank[0];
  EXPECT_EQ(r0.steps, 1);
  EXPECT_EQ(r0.total.step_us, 1000);
  EXPECT_EQ(r0.total.compute_us, 500);
  EXPECT_EQ(r0.total.comm_us, 500);
  EXPECT_EQ(r0.total.overlap_us, 150);
  EXPECT_EQ(r0.total.exposed_us, 350);
  EXPECT_EQ(r0.total.other_us, 150);
  EXPECT_EQ(r0.all_comm_us, 750);
  EXPECT_EQ(r0.span_us, 2510 - 100);
  // Rank 1, step [1000, 3000]: compute 1000, comm 1000, overlap 500.
  const RankSummary& r1 = s->per_rank[1];
  EXPECT_EQ(r1.total.compute_us, 1000);
  EXPECT_EQ(r1.total.comm_us, 1000);
  EXPECT_EQ(r1.total.overlap_us, 500);
  EXPECT_EQ(r1.total.exposed_us, 500);
  EXPECT_EQ(r1.total.other_us, 500);

  ASSERT_EQ(s->steps.size(), 1u);
  const StepSummary& step = s->steps[0];
  EXPECT_EQ(step.step, 1);
  EXPECT_EQ(step.ranks, 2);
  EXPECT_EQ(step.mean.step_us, 1500);
  EXPECT_EQ(step.mean.compute_us, 750);
  EXPECT_EQ(step.mean.comm_us, 750);
  EXPECT_EQ(step.mean.overlap_us, 325);
  EXPECT_EQ(step.mean.exposed_us, 425);
  EXPECT_EQ(step.mean.other_us, 325);

  // Ops that ended OK, by op: AllGather 1000 B x 4 ranks in 50 us: algbw
  // 4000 B / 50 us = 0.08 GB/s, busbw x 3/4; AllReduce spans 250, 200 and
  // 1000 us, median 250: 4000 B / 250 us = 0.016 GB/s, busbw x 2(3)/4;
  // Broadcast 8000 B / 100 us, busbw x 1.
  ASSERT_EQ(s->ops.size(), 3u);
  EXPECT_EQ(s->ops[0].op, "AllGather");
  EXPECT_DOUBLE_EQ(*s->ops[0].algbw_gbps, 0.08);
  EXPECT_DOUBLE_EQ(*s->ops[0].busbw_gbps, 0.06);
  EXPECT_EQ(s->ops[1].op, "AllReduce");
  EXPECT_EQ(s->ops[1].calls, 3);
  EXPECT_EQ(s->ops[1].median_us, 250);
  EXPECT_EQ(s->ops[1].total_us, 1450);
  EXPECT_DOUBLE_EQ(*s->ops[1].algbw_gbps, 0.016);
  EXPECT_DOUBLE_EQ(*s->ops[1].busbw_gbps, 0.024);
  EXPECT_EQ(s->ops[2].op, "Broadcast");
  EXPECT_DOUBLE_EQ(*s->ops[2].busbw_gbps, 0.08);

  const std::string text = FormatSummary(*s);
  EXPECT_TRUE(absl::StrContains(text, "2 rank(s) (0,1), 1 step(s)")) << text;
  EXPECT_TRUE(absl::StrContains(
      text,
      "         1      1.500      0.750      0.750      0.425      0.325"))
      << text;
  EXPECT_TRUE(absl::StrContains(text, "AllReduce")) << text;
  EXPECT_FALSE(absl::StrContains(text, "cannot be told")) << text;
}

TEST(TraceTimelineTest, MergeMakesEachRankAProcessAndKeepsEveryEvent) {
  std::vector<TraceText> inputs = TwoRanks();
  // Timestamps in microseconds since the epoch survive exactly.
  inputs[1].json = RankFile(1, {Step(7, 1795827505480273, 12345)});
  absl::StatusOr<std::string> merged = MergeTraces(inputs);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_TRUE(absl::StrContains(*merged, "\"ts\":1795827505480273")) << *merged;
  auto trace = ParseTrace("merged", *merged);
  ASSERT_TRUE(trace.ok());
  int names = 0, events = 0;
  for (const auto& v :
       trace->fields().at("traceEvents").list_value().values()) {
    const auto& f = v.struct_value().fields();
    if (f.at("ph").string_value() == "X") ++events;
    if (f.at("name").string_value() == "process_name") {
      ++names;
      EXPECT_EQ(f.at("args").struct_value().fields().at("name").string_value(),
                absl::StrCat("rank ", f.at("pid").number_value()));
    }
  }
  EXPECT_EQ(names, 2);
  EXPECT_EQ(events, 9 + 1);
  const auto& other = trace->fields().at("otherData").struct_value().fields();
  EXPECT_TRUE(other.at("merged").bool_value());
  ASSERT_EQ(other.at("ranks").list_value().values_size(), 2);
  EXPECT_EQ(other.at("ranks")
                .list_value()
                .values(1)
                .struct_value()
                .fields()
                .at("file")
                .string_value(),
            "rank1.json");

  // A merged file merges again with another rank; a rank twice is refused.
  absl::StatusOr<std::string> again = MergeTraces(
      {{"merged.json", *merged}, {"rank2.json", RankFile(2, {Step(7, 1, 2)})}});
  ASSERT_TRUE(again.ok()) << again.status();
  auto three = ParseTrace("again", *again);
  ASSERT_TRUE(three.ok());
  EXPECT_EQ(SummarizeTrace(*three)->ranks, (std::vector<int>{0, 1, 2}));
  absl::StatusOr<std::string> twice =
      MergeTraces({{"merged.json", *merged}, {"rank1.json", inputs[1].json}});
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(twice.status().message(),
                                "rank 1 is in both merged.json and rank1.json"))
      << twice.status();
}

TEST(TraceTimelineTest, RefusesWhatIsNotACohortTimeline) {
  EXPECT_EQ(ParseTrace("a", "{not json").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(ParseTrace("a", "{}").status().message(),
                                "no traceEvents"));
  EXPECT_TRUE(absl::StrContains(
      ParseTrace("a", R"({"traceEvents":[]})").status().message(),
      "not a cohort timeline"));
  auto bad = ParseTrace(
      "a", R"({"traceEvents":[{"ph":"X","cat":"step","pid":0,"ts":1,"dur":1}],
              "otherData":{"cohort_trace":1,"rank":0}})");
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ(SummarizeTrace(*bad).status().code(),
            absl::StatusCode::kInvalidArgument);  // A step without its number.
}

TEST(TraceTimelineTest, ATraceWithoutComputeSaysWhatItCannotTell) {
  auto trace = ParseTrace(
      "torch", RankFile(0, {Comm(10, 100), Comm(200, 100), Comm(400, 100)}));
  ASSERT_TRUE(trace.ok());
  absl::StatusOr<TraceSummary> s = SummarizeTrace(*trace);
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE(s->has_compute);
  EXPECT_TRUE(s->steps.empty());
  EXPECT_EQ(s->per_rank[0].all_comm_us, 300);
  EXPECT_EQ(s->ops[0].calls, 3);
  const std::string text = FormatSummary(*s);
  EXPECT_TRUE(absl::StrContains(text, "cannot be told")) << text;
  EXPECT_FALSE(absl::StrContains(text, "per step")) << text;
}

TEST(TraceTimelineTest, BusBandwidthFactorsAreNcclTests) {
  EXPECT_DOUBLE_EQ(*BusBandwidthFactor("AllReduce", 8), 2.0 * 7 / 8);
  EXPECT_DOUBLE_EQ(*BusBandwidthFactor("AllGather", 8), 7.0 / 8);
  EXPECT_DOUBLE_EQ(*BusBandwidthFactor("ReduceScatter", 8), 7.0 / 8);
  EXPECT_DOUBLE_EQ(*BusBandwidthFactor("AllToAll", 8), 7.0 / 8);
  EXPECT_DOUBLE_EQ(*BusBandwidthFactor("Broadcast", 8), 1);
  EXPECT_DOUBLE_EQ(*BusBandwidthFactor("Reduce", 8), 1);
  EXPECT_DOUBLE_EQ(*BusBandwidthFactor("AllReduce", 1), 0);
  EXPECT_FALSE(BusBandwidthFactor("Barrier", 8).has_value());
  EXPECT_FALSE(BusBandwidthFactor("AllGatherV", 8).has_value());
}

}  // namespace
}  // namespace cohort
