// Kill trials in CI: cohortd killed with SIGKILL at random points and
// restarted on the same folder, 20 times (KILL_TRIALS=N for more); no
// acknowledged write may be lost. bench/kill_trials runs 1,000.
#include "tests/testing/kill_trials.h"

#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "absl/strings/numbers.h"
#include "gtest/gtest.h"

namespace cohort::testing {
namespace {

std::string FreshDir(const std::string& name) {
  auto dir = std::filesystem::path(::testing::TempDir()) / name;
  std::filesystem::remove_all(dir);
  return dir.string();
}

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  int64_t value;
  return text != nullptr && absl::SimpleAtoi(text, &value) ? value : fallback;
}

void PrintFailures(const KillTrialReport& report) {
  for (const std::string& f : report.failures) std::cerr << "  " << f << "\n";
}

TEST(KillTrialsTest, NoAcknowledgedWriteIsLost) {
  KillTrialOptions options;
  options.data_dir = FreshDir("kill_trials");
  options.trials = EnvInt("KILL_TRIALS", 20);
  options.seed = EnvInt("KILL_TRIALS_SEED", 0);
  options.log = [](const std::string& line) { std::cerr << line << "\n"; };
  KillTrialReport report = RunKillTrials(options);
  std::cerr << report.Summary() << "\n";
  PrintFailures(report);

  ASSERT_TRUE(report.status.ok()) << report.status;
  EXPECT_EQ(report.trials, options.trials);
  EXPECT_EQ(report.lost, 0) << "rerun with KILL_TRIALS_SEED=" << report.seed;
  EXPECT_EQ(report.anomalies, 0)
      << "rerun with KILL_TRIALS_SEED=" << report.seed;
  // The campaign exercised every kind of write, and its kills cut calls off.
  EXPECT_GT(report.sets, 0);
  EXPECT_GT(report.big_sets, 0);
  EXPECT_GT(report.multisets, 0);
  EXPECT_GT(report.appends, 0);
  EXPECT_GT(report.adds, 0);
  EXPECT_GT(report.deletes, 0);
  EXPECT_GT(report.compare_sets_swapped, 0);
  EXPECT_GT(report.in_flight, 0);
  EXPECT_GT(report.keys_verified, report.trials);
}

// The checker is not blind: a cohortd that keeps nothing across a restart
// loses every acknowledged write, and the trials must say so.
TEST(KillTrialsTest, CheckerReportsTheLossesOfAMemoryEngine) {
  KillTrialOptions options;
  options.data_dir = FreshDir("kill_trials_memory");
  options.trials = 2;
  options.seed = EnvInt("KILL_TRIALS_SEED", 0);
  options.min_kill_delay = absl::Milliseconds(200);
  options.max_kill_delay = absl::Milliseconds(300);
  // Losses need acknowledged writes: each trial has some before its kill,
  // however slowly this machine runs the writers.
  options.kill_after_an_ack = true;
  options.sync_writes_fraction = 0;
  options.cohortd_args = {"--engine=memory"};
  KillTrialReport report = RunKillTrials(options);
  std::cerr << report.Summary() << "\n";
  PrintFailures(report);

  ASSERT_TRUE(report.status.ok()) << report.status;
  EXPECT_GT(report.acked(), 0);
  EXPECT_GT(report.lost, 0);
  ASSERT_FALSE(report.failures.empty());
}

}  // namespace
}  // namespace cohort::testing
