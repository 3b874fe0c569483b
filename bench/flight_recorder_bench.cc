// What the flight recorder costs an op: Queued + Started + Ended, the three
// calls the op engine makes per op, timed in a loop on one thread and on
// two threads sharing one recorder (the engine's issuing thread and its op
// thread), in ns per op. Compare with the op itself: collectives_bench's
// 4 KiB all_reduce on the same machine (a few tens of microseconds over
// loopback), so the fraction is ns / (that time).
//   bazel run -c opt //bench:flight_recorder_bench -- --ops=2000000
#include <algorithm>
#include <cstdio>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "worker/collective/flight_recorder.h"

ABSL_FLAG(int, ops, 2000000, "ops per thread per round");
ABSL_FLAG(int, rounds, 5, "rounds (the median is printed)");

namespace {

double NsPerOp(int threads, int ops) {
  cohort::FlightRecorder recorder;
  float data[1024] = {};
  const cohort::CollectiveOp op = cohort::CollectiveOp::AllReduce(
      cohort::BufferView::Of(data, 1024), cohort::ReduceOp::kSum);
  const absl::Time start = absl::Now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (int i = 0; i < ops; ++i) {
        const uint64_t index = recorder.Queued(op);
        recorder.Started(index);
        recorder.Ended(index, absl::OkStatus());
      }
    });
  }
  for (std::thread& t : pool) t.join();
  return absl::ToDoubleNanoseconds(absl::Now() - start) / ops;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int ops = absl::GetFlag(FLAGS_ops);
  for (int threads : {1, 2}) {
    std::vector<double> ns;
    for (int r = 0; r < absl::GetFlag(FLAGS_rounds); ++r) {
      ns.push_back(NsPerOp(threads, ops));
    }
    std::vector<double> sorted = ns;
    std::sort(sorted.begin(), sorted.end());
    std::printf("%d thread(s): %.1f ns per op (median of", threads,
                sorted[sorted.size() / 2]);
    for (double v : ns) std::printf(" %.1f", v);
    std::printf(")\n");
  }
  return 0;
}
