// The Timeline's threads at work: programs adding spans and steps from
// several threads while ops end on others and the background thread
// drains and rewrites the file every millisecond. Checks by counting the
// file's lines (one event a line, timeline.h), with no JSON library, so
// that it runs under TSan (tools/faults.sh), where protobuf's headers and
// its uninstrumented library disagree about a Map's layout.
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "worker/collective/trace/timeline.h"

namespace cohort {
namespace {

int CountLines(const std::string& path, absl::string_view part) {
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)),
                         std::istreambuf_iterator<char>());
  int count = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    count += absl::StrContains(line, part);
  }
  return count;
}

TEST(TimelineThreadsTest, SpansAndOpsFromManyThreadsAreEachWrittenOnce) {
  constexpr int kOpThreads = 3;
  constexpr int kOpsPerThread = 300;
  constexpr int kSteps = 200;
  const char* tmp = std::getenv("TEST_TMPDIR");
  TimelineOptions options;
  options.dir =
      absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/threads-", ::getpid());
  options.drain_every = absl::Milliseconds(1);
  options.flush_every = absl::Milliseconds(1);
  auto timeline = Timeline::Open(options);
  ASSERT_TRUE(timeline.ok()) << timeline.status();
  // A ring smaller than the ops, drained in time only because EndStep and
  // the thread read it often: what is dropped is counted, never repeated.
  auto recorder = std::make_shared<FlightRecorder>(64);
  (*timeline)->AddGroup("world", recorder, 2);

  std::vector<std::thread> threads;
  for (int t = 0; t < kOpThreads; ++t) {
    threads.emplace_back([&recorder] {
      float data[1] = {};
      for (int i = 0; i < kOpsPerThread; ++i) {
        const uint64_t op = recorder->Queued(
            CollectiveOp::AllReduce(BufferView::Of(data, 1), ReduceOp::kSum));
        recorder->Started(op);
        recorder->Ended(op, absl::OkStatus());
      }
    });
  }
  threads.emplace_back([&timeline] {
    for (int s = 1; s <= kSteps; ++s) {
      (*timeline)->BeginStep(s, Timeline::NowMicros());
      { ComputeSpan span(timeline->get(), "forward", s); }
      (*timeline)->EndStep(Timeline::NowMicros());
    }
  });
  for (std::thread& t : threads) t.join();
  const std::string path = (*timeline)->path();
  timeline->reset();

  EXPECT_EQ(CountLines(path, "\"cat\":\"step\""), kSteps);
  EXPECT_EQ(CountLines(path, "\"cat\":\"compute\""), kSteps);
  const int ops = CountLines(path, "\"cat\":\"comm\"");
  const int dropped = [&] {
    std::ifstream in(path);
    const std::string text((std::istreambuf_iterator<char>(in)),
                           std::istreambuf_iterator<char>());
    const size_t at = text.find("\"dropped_ops\":");
    return at == std::string::npos ? -1 : std::atoi(text.c_str() + at + 14);
  }();
  EXPECT_EQ(ops + dropped, kOpThreads * kOpsPerThread);
  EXPECT_EQ(CountLines(path, "\"state\":\"running\""), 0);
}

}  // namespace
}  // namespace cohort
