// A worker that misbehaves on cue, for the flight recorder's end-to-end
// tests (tests/integration/flight_diagnose_test.sh). Under cohortrun it
// joins the job's Gloo group (env://) and runs --steps all-reduces of
// --count floats; at --fault_step, rank --fault_rank does what --fault
// says:
//   sleep     stops before the op and sleeps until killed (a hang);
//   skip      skips the op, runs the rest, then sleeps until killed (a
//             rank that moved on to its next phase);
//   other_op  issues a Broadcast where the others all-reduce;
//   count     all-reduces one element more than the others;
//   die       SIGKILLs itself before the op;
//   slow      enters every op from the fault step on --slow_ms late (a
//             straggler).
// It prints "step N" after each op (then sleeps --pause_ms), and the error
// of a failed op (exit 1).
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "worker/collective/init/init.h"

ABSL_FLAG(int, steps, 20, "all-reduces to run");
ABSL_FLAG(int, count, 4096, "floats per all-reduce");
ABSL_FLAG(std::string, fault, "none",
          "none, sleep, skip, other_op, count, die or slow");
ABSL_FLAG(int, fault_rank, 1, "the rank that misbehaves");
ABSL_FLAG(int, fault_step, 10, "the op it misbehaves at");
ABSL_FLAG(int, slow_ms, 20, "slow: how late it enters each op");
ABSL_FLAG(int, timeout_s, 600, "the group's timeout");
ABSL_FLAG(int, pause_ms, 0, "sleep between ops");
ABSL_FLAG(bool, linger, false,
          "every rank sleeps until killed after its last op (so that its "
          "records can be asked for)");

namespace {

void SleepUntilKilled() {
  std::fflush(stdout);
  while (true) pause();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string fault = absl::GetFlag(FLAGS_fault);
  const int fault_step = absl::GetFlag(FLAGS_fault_step);
  cohort::InitOptions options;
  options.group.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  auto pg = cohort::InitProcessGroup("gloo", "env://", -1, -1, options);
  if (!pg.ok()) {
    std::fprintf(stderr, "flight_worker: %s\n", pg.status().ToString().c_str());
    return 1;
  }
  const bool faulty =
      fault != "none" && (*pg)->rank() == absl::GetFlag(FLAGS_fault_rank);
  std::vector<float> data(absl::GetFlag(FLAGS_count) + 1, 1.0f);
  for (int step = 0; step < absl::GetFlag(FLAGS_steps); ++step) {
    size_t count = data.size() - 1;
    std::shared_ptr<cohort::Work> work;
    if (faulty && step == fault_step) {
      if (fault == "sleep") SleepUntilKilled();
      if (fault == "die") kill(getpid(), SIGKILL);
      if (fault == "skip") continue;
      if (fault == "count") ++count;
      if (fault == "other_op") {
        work = (*pg)->Broadcast(cohort::BufferView::Of(data.data(), count), 0);
      }
    }
    if (faulty && fault == "slow" && step >= fault_step) {
      absl::SleepFor(absl::Milliseconds(absl::GetFlag(FLAGS_slow_ms)));
    }
    if (work == nullptr) {
      work = (*pg)->AllReduce(cohort::BufferView::Of(data.data(), count),
                              cohort::ReduceOp::kAvg);
    }
    if (absl::Status s = work->Wait(); !s.ok()) {
      std::fprintf(stderr, "flight_worker: rank %d step %d: %s\n",
                   (*pg)->rank(), step, s.ToString().c_str());
      return 1;
    }
    std::printf("step %d\n", step);
    std::fflush(stdout);
    absl::SleepFor(absl::Milliseconds(absl::GetFlag(FLAGS_pause_ms)));
  }
  if ((faulty && fault == "skip") || absl::GetFlag(FLAGS_linger)) {
    std::printf("lingering\n");
    SleepUntilKilled();
  }
  return 0;
}
