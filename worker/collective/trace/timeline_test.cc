#include "worker/collective/trace/timeline.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"

namespace cohort {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

std::string TestDir(absl::string_view name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name, "-",
                      ::getpid());
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The file parsed by an independent JSON parser (protobuf's).
Struct Parse(const std::string& path) {
  Struct trace;
  const std::string text = ReadFile(path);
  const auto status = google::protobuf::util::JsonStringToMessage(text, &trace);
  EXPECT_TRUE(status.ok()) << status.ToString() << "\n" << text;
  return trace;
}

std::vector<Struct> Events(const Struct& trace, absl::string_view cat) {
  std::vector<Struct> out;
  for (const Value& v :
       trace.fields().at("traceEvents").list_value().values()) {
    const auto& f = v.struct_value().fields();
    if (cat.empty() ||
        (f.contains("cat") && f.at("cat").string_value() == cat)) {
      out.push_back(v.struct_value());
    }
  }
  return out;
}

double Num(const Struct& s, const std::string& key) {
  return s.fields().at(key).number_value();
}
std::string Str(const Struct& s, const std::string& key) {
  return s.fields().at(key).string_value();
}
const Struct& Args(const Struct& event) {
  return event.fields().at("args").struct_value();
}

// Options whose background thread never drains or flushes during a test.
TimelineOptions Quiet(absl::string_view name) {
  TimelineOptions options;
  options.dir = TestDir(name);
  options.rank = 3;
  options.world_size = 4;
  options.source = "test";
  options.drain_every = absl::Hours(1);
  options.flush_every = absl::Hours(1);
  return options;
}

void RunOp(FlightRecorder& recorder, float* data, size_t count) {
  const uint64_t i = recorder.Queued(
      CollectiveOp::AllReduce(BufferView::Of(data, count), ReduceOp::kAvg));
  recorder.Started(i);
  recorder.Ended(i, absl::OkStatus());
}

TEST(TimelineTest, WritesComputeStepsAndTheGroupsOps) {
  auto recorder = std::make_shared<FlightRecorder>(16);
  float data[8] = {};
  RunOp(*recorder, data, 8);  // Before AddGroup: not in the trace.
  const TimelineOptions options = Quiet("spans");
  auto timeline = Timeline::Open(options);
  ASSERT_TRUE(timeline.ok()) << timeline.status();
  const std::string path = (*timeline)->path();
  EXPECT_EQ(path, options.dir + "/trace-rank3.json");
  EXPECT_TRUE(Events(Parse(path), "").size() >= 1);  // Written at Open.

  EXPECT_EQ((*timeline)->AddGroup("world", recorder, 4), 0);
  const int64_t start = Timeline::NowMicros();
  (*timeline)->BeginStep(1, start);
  { ComputeSpan forward(timeline->get(), "forward", 1, 0); }
  RunOp(*recorder, data, 8);
  ASSERT_TRUE((*timeline)->Flush().ok());  // Drained while the step is open.
  RunOp(*recorder, data, 2);
  const int64_t end = Timeline::NowMicros();
  (*timeline)->EndStep(end);
  RunOp(*recorder, data, 1);  // After the step: no step.
  timeline->reset();

  const Struct trace = Parse(path);
  EXPECT_EQ(Str(trace, "displayTimeUnit"), "ms");
  const Struct& other = trace.fields().at("otherData").struct_value();
  EXPECT_EQ(Num(other, "rank"), 3);
  EXPECT_EQ(Num(other, "world_size"), 4);
  EXPECT_EQ(Str(other, "source"), "test");
  EXPECT_EQ(Num(other, "dropped_ops"), 0);

  std::vector<std::string> names;
  for (const Struct& e : Events(trace, "")) {
    EXPECT_EQ(Num(e, "pid"), 3);
    if (Args(e).fields().contains("name")) {
      names.push_back(Str(Args(e), "name"));
    }
  }
  EXPECT_NE(std::find(names.begin(), names.end(), "rank 3"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "compute"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "comm world"), names.end());

  const std::vector<Struct> compute = Events(trace, "compute");
  ASSERT_EQ(compute.size(), 1u);
  EXPECT_EQ(Str(compute[0], "name"), "forward");
  EXPECT_EQ(Str(compute[0], "ph"), "X");
  EXPECT_EQ(Num(Args(compute[0]), "step"), 1);
  EXPECT_EQ(Num(Args(compute[0]), "layer"), 0);
  EXPECT_GE(Num(compute[0], "ts"), start);
  const std::vector<Struct> steps = Events(trace, "step");
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(Num(steps[0], "ts"), start);
  EXPECT_EQ(Num(steps[0], "dur"), end - start);

  const std::vector<Struct> comm = Events(trace, "comm");
  ASSERT_EQ(comm.size(), 3u);
  const double counts[] = {8, 2, 1};
  for (int k = 0; k < 3; ++k) {
    const Struct& args = Args(comm[k]);
    EXPECT_EQ(Str(comm[k], "name"), "AllReduce");
    EXPECT_EQ(Str(args, "op"), "AllReduce");
    EXPECT_EQ(Num(args, "seq"), k + 1);  // seq 0 ran before AddGroup.
    EXPECT_EQ(Str(args, "dtype"), "f32");
    EXPECT_EQ(Num(args, "count"), counts[k]);
    EXPECT_EQ(Num(args, "bytes"), 4 * counts[k]);
    EXPECT_EQ(Num(args, "ranks"), 4);
    EXPECT_EQ(Str(args, "reduce"), "AVG");
    EXPECT_EQ(Str(args, "state"), "done");
    EXPECT_LE(Num(args, "queued_us"), Num(comm[k], "ts"));
    EXPECT_EQ(args.fields().contains("step"), k < 2) << k;
    EXPECT_NE(Num(comm[k], "tid"), Num(compute[0], "tid"));
  }
}

TEST(TimelineTest, AnOpInFlightIsWrittenAsRunningThenOnceWhenDone) {
  auto recorder = std::make_shared<FlightRecorder>(16);
  float data[4] = {};
  auto timeline = Timeline::Open(Quiet("in-flight"));
  ASSERT_TRUE(timeline.ok());
  (*timeline)->AddGroup("world", recorder, 2);
  const uint64_t slow = recorder->Queued(
      CollectiveOp::AllReduce(BufferView::Of(data, 4), ReduceOp::kSum));
  recorder->Started(slow);
  // The clock counts microseconds: apart, so that the spans overlap.
  absl::SleepFor(absl::Milliseconds(2));
  RunOp(*recorder, data, 2);  // Ends before the first one.
  absl::SleepFor(absl::Milliseconds(2));
  ASSERT_TRUE((*timeline)->Flush().ok());
  std::vector<Struct> comm = Events(Parse((*timeline)->path()), "comm");
  ASSERT_EQ(comm.size(), 2u);
  EXPECT_EQ(Num(Args(comm[0]), "seq"), 1);
  EXPECT_EQ(Str(Args(comm[0]), "state"), "done");
  EXPECT_EQ(Num(Args(comm[1]), "seq"), 0);
  EXPECT_EQ(Str(Args(comm[1]), "state"), "running");

  recorder->Ended(slow, absl::UnavailableError("peer gone"));
  ASSERT_TRUE((*timeline)->Flush().ok());
  ASSERT_TRUE((*timeline)->Flush().ok());
  const Struct trace = Parse((*timeline)->path());
  comm = Events(trace, "comm");
  ASSERT_EQ(comm.size(), 2u);  // Each op once.
  EXPECT_EQ(Num(Args(comm[1]), "seq"), 0);
  EXPECT_EQ(Str(Args(comm[1]), "state"), "failed");
  EXPECT_NE(Str(Args(comm[1]), "error").find("peer gone"), std::string::npos);
  // The two ran at once: on two lanes (threads), so that neither span
  // overlaps another on its thread, the second lane named "#2".
  EXPECT_NE(Num(comm[0], "tid"), Num(comm[1], "tid"));
  bool named = false;
  for (const Struct& e : Events(trace, "")) {
    if (Str(e, "ph") == "M" && e.fields().contains("tid") &&
        Num(e, "tid") == Num(comm[1], "tid") &&
        Args(e).fields().contains("name")) {
      named = Str(Args(e), "name") == "comm world #2";
    }
  }
  EXPECT_TRUE(named);
}

TEST(TimelineTest, OpsThatDoNotOverlapShareOneThread) {
  auto recorder = std::make_shared<FlightRecorder>(16);
  float data[1] = {};
  auto timeline = Timeline::Open(Quiet("one-lane"));
  ASSERT_TRUE(timeline.ok());
  (*timeline)->AddGroup("world", recorder, 2);
  for (int i = 0; i < 5; ++i) RunOp(*recorder, data, 1);
  ASSERT_TRUE((*timeline)->Flush().ok());
  const std::vector<Struct> comm = Events(Parse((*timeline)->path()), "comm");
  ASSERT_EQ(comm.size(), 5u);
  for (const Struct& e : comm) EXPECT_EQ(Num(e, "tid"), Num(comm[0], "tid"));
}

TEST(TimelineTest, CountsOpsTheRingDroppedBeforeTheyWereRead) {
  auto recorder = std::make_shared<FlightRecorder>(4);
  float data[1] = {};
  auto timeline = Timeline::Open(Quiet("dropped"));
  ASSERT_TRUE(timeline.ok());
  (*timeline)->AddGroup("world", recorder, 2);
  for (int i = 0; i < 10; ++i) RunOp(*recorder, data, 1);
  ASSERT_TRUE((*timeline)->Flush().ok());
  const Struct trace = Parse((*timeline)->path());
  const std::vector<Struct> comm = Events(trace, "comm");
  ASSERT_EQ(comm.size(), 4u);
  EXPECT_EQ(Num(Args(comm[0]), "seq"), 6);
  EXPECT_EQ(Num(trace.fields().at("otherData").struct_value(), "dropped_ops"),
            6);
}

TEST(TimelineTest, AStepReadsARingThatIsHalfFull) {
  auto recorder = std::make_shared<FlightRecorder>(8);
  float data[1] = {};
  auto timeline = Timeline::Open(Quiet("half-full"));
  ASSERT_TRUE(timeline.ok());
  (*timeline)->AddGroup("world", recorder, 2);
  for (int step = 1; step <= 5; ++step) {
    (*timeline)->BeginStep(step, Timeline::NowMicros());
    for (int i = 0; i < 5; ++i) RunOp(*recorder, data, 1);
    (*timeline)->EndStep(Timeline::NowMicros());
  }
  ASSERT_TRUE((*timeline)->Flush().ok());
  const Struct trace = Parse((*timeline)->path());
  EXPECT_EQ(Events(trace, "comm").size(), 25u);
  EXPECT_EQ(Num(trace.fields().at("otherData").struct_value(), "dropped_ops"),
            0);
}

TEST(TimelineTest, ARemovedGroupKeepsItsOpsInFlightAsTheyStood) {
  auto timeline = Timeline::Open(Quiet("removed"));
  ASSERT_TRUE(timeline.ok());
  {
    auto recorder = std::make_shared<FlightRecorder>(8);
    float data[1] = {};
    const int id = (*timeline)->AddGroup("pg \"0\"", recorder, 2);
    RunOp(*recorder, data, 1);
    recorder->Queued(CollectiveOp::Barrier());  // Never ends.
    (*timeline)->RemoveGroup(id);
  }
  EXPECT_EQ((*timeline)->AddGroup("none", nullptr, 2), -1);
  const std::string path = (*timeline)->path();
  timeline->reset();
  const Struct trace = Parse(path);
  const std::vector<Struct> comm = Events(trace, "comm");
  ASSERT_EQ(comm.size(), 2u);
  EXPECT_EQ(Str(Args(comm[1]), "op"), "Barrier");
  EXPECT_EQ(Str(Args(comm[1]), "state"), "queued");
  bool named = false;
  for (const Struct& e : Events(trace, "")) {
    if (Args(e).fields().contains("name") &&
        Str(Args(e), "name") == "comm pg \"0\"") {
      named = true;
    }
  }
  EXPECT_TRUE(named);
}

TEST(TimelineTest, TheBackgroundThreadFlushesPeriodically) {
  auto recorder = std::make_shared<FlightRecorder>(8);
  float data[1] = {};
  TimelineOptions options = Quiet("periodic");
  options.drain_every = absl::Milliseconds(5);
  options.flush_every = absl::Milliseconds(10);
  auto timeline = Timeline::Open(options);
  ASSERT_TRUE(timeline.ok());
  (*timeline)->AddGroup("world", recorder, 2);
  RunOp(*recorder, data, 1);
  // The file is rewritten without any call: wait for it (bounded).
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (ReadFile((*timeline)->path()).find("AllReduce") == std::string::npos &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(Events(Parse((*timeline)->path()), "comm").size(), 1u);
}

TEST(TimelineTest, KeepsAtMostMaxEvents) {
  TimelineOptions options = Quiet("max-events");
  options.max_events = 3;
  auto timeline = Timeline::Open(options);
  ASSERT_TRUE(timeline.ok());
  for (int i = 0; i < 5; ++i) (*timeline)->AddCompute("forward", 1, 2, i);
  ASSERT_TRUE((*timeline)->Flush().ok());
  const Struct trace = Parse((*timeline)->path());
  EXPECT_EQ(Events(trace, "compute").size(), 3u);
  EXPECT_EQ(
      Num(trace.fields().at("otherData").struct_value(), "dropped_events"), 2);
}

TEST(TimelineTest, FromEnvironmentIsNullWithoutCohortTrace) {
  unsetenv(kTraceEnv);
  auto none = Timeline::FromEnvironment(0, 1, "test");
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, nullptr);
  const std::string dir = TestDir("env") + "/a/b";
  setenv(kTraceEnv, dir.c_str(), 1);
  auto some = Timeline::FromEnvironment(1, 2, "test");
  unsetenv(kTraceEnv);
  ASSERT_TRUE(some.ok()) << some.status();
  ASSERT_NE(*some, nullptr);
  EXPECT_EQ((*some)->path(), dir + "/trace-rank1.json");
}

TEST(TimelineTest, RefusesAFolderItCannotMake) {
  TimelineOptions options = Quiet("refused");
  options.dir = "/proc/cohort-no-such-folder";
  EXPECT_FALSE(Timeline::Open(options).ok());
  options.dir = "";
  EXPECT_EQ(Timeline::Open(options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cohort
