// The kill-trial campaign at length: cohortd killed with SIGKILL at random
// points and restarted on the same folder --trials times (1,000 by default),
// checking after each restart that no acknowledged write was lost. Prints
// the count lost (must be 0), the acknowledged writes by kind and the time;
// exits 1 if anything was lost or inconsistent. See
// tests/testing/kill_trials.h.
//   bazel run //bench:kill_trials -- --trials=1000
#include "tests/testing/kill_trials.h"

#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/time.h"

ABSL_FLAG(int, trials, 1000, "kill -9 / restart / verify rounds");
ABSL_FLAG(int, writers, 4, "client threads, each with its own connection");
ABSL_FLAG(uint64_t, seed, 0, "seeds every random choice; 0 picks one");
ABSL_FLAG(std::string, data_dir, "",
          "cohortd's folder; empty: a fresh temporary one, removed at the end "
          "unless something was lost");
ABSL_FLAG(absl::Duration, min_kill_delay, absl::Milliseconds(5),
          "earliest kill after the writers start");
ABSL_FLAG(absl::Duration, max_kill_delay, absl::Milliseconds(300),
          "latest kill after the writers start");
ABSL_FLAG(double, sync_writes_fraction, 0.2,
          "share of trials run with cohortd --sync_writes");
ABSL_FLAG(double, big_value_fraction, 0.02,
          "share of writes that set a 64 KiB - 1 MiB value");
ABSL_FLAG(int, progress_every, 50, "print a line every this many trials");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "kill trials: kill -9 cohortd at random points, restart, verify");
  absl::ParseCommandLine(argc, argv);
  cohort::testing::KillTrialOptions options;
  options.trials = absl::GetFlag(FLAGS_trials);
  options.writers = absl::GetFlag(FLAGS_writers);
  options.seed = absl::GetFlag(FLAGS_seed);
  options.min_kill_delay = absl::GetFlag(FLAGS_min_kill_delay);
  options.max_kill_delay = absl::GetFlag(FLAGS_max_kill_delay);
  options.sync_writes_fraction = absl::GetFlag(FLAGS_sync_writes_fraction);
  options.big_value_fraction = absl::GetFlag(FLAGS_big_value_fraction);
  options.data_dir = absl::GetFlag(FLAGS_data_dir);
  const bool temporary = options.data_dir.empty();
  if (temporary) {
    std::string dir =
        (std::filesystem::temp_directory_path() / "kill_trials.XXXXXX")
            .string();
    if (mkdtemp(dir.data()) == nullptr) {
      std::cerr << "cannot create a temporary folder like " << dir << "\n";
      return 2;
    }
    options.data_dir = dir;
  }
  const int every = std::max(1, absl::GetFlag(FLAGS_progress_every));
  int seen = 0;
  options.log = [&](const std::string& line) {
    if (++seen % every == 0) std::cerr << line << std::endl;
  };

  cohort::testing::KillTrialReport report =
      cohort::testing::RunKillTrials(options);
  for (const std::string& f : report.failures) std::cerr << "  " << f << "\n";
  std::cout << report.Summary() << std::endl;
  const bool ok = report.status.ok() && report.lost == 0 &&
                  report.anomalies == 0 && report.trials == options.trials;
  if (!report.status.ok()) std::cerr << "stopped: " << report.status << "\n";
  if (temporary && ok) {
    std::filesystem::remove_all(options.data_dir);
  } else if (temporary) {
    std::cerr << "cohortd's folder is kept: " << options.data_dir << "\n";
  }
  std::cout << "lost: " << report.lost << (ok ? "" : " (FAILED)") << std::endl;
  return ok ? 0 : 1;
}
