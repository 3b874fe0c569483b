// Kill trials: a crash loop against the real cohortd that checks no
// acknowledged write is ever lost.
//
// Each trial starts writer threads against a cohortd on `data_dir`, kills
// the server with SIGKILL after a random delay (so kills land during WAL
// writes, memtable flushes, compactions and blob writes), restarts it on the
// same folder and port, and checks the store against a model of every write
// whose OK reply a writer received. The next trial writes on top of what
// survived, as in a real crash loop.
//
// What counts as acknowledged is exactly the calls whose OK reply arrived:
// writers use raw gRPC stubs with retries off, and stop at their first
// error. That failed call (at most one per writer, "in flight at the kill")
// may or may not have been applied; the checker accepts either outcome, but
// nothing else.
#ifndef COHORT_TESTS_TESTING_KILL_TRIALS_H_
#define COHORT_TESTS_TESTING_KILL_TRIALS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace cohort::testing {

struct KillTrialOptions {
  // cohortd's RocksDB folder: new or empty (created if missing). The
  // trials' keys all start with "kt/".
  std::string data_dir;
  int trials = 20;
  // Client threads, each with its own gRPC channel (TCP connection).
  int writers = 4;
  // Seeds every random choice; 0 picks one (printed in the summary).
  uint64_t seed = 0;
  // The kill comes this long after the writers start, uniformly.
  absl::Duration min_kill_delay = absl::Milliseconds(5);
  absl::Duration max_kill_delay = absl::Milliseconds(300);
  // Count the delay from the trial's first acknowledged write instead, so
  // that every trial writes something however slowly the writers connect
  // (a check that needs writes to lose). Kills then never come earlier.
  bool kill_after_an_ack = false;
  // Share of trials whose cohortd runs with --sync_writes.
  double sync_writes_fraction = 0.2;
  // Share of writes that set a large value (blob files in RocksDB), of
  // between min_ and max_big_value_bytes.
  double big_value_fraction = 0.02;
  size_t min_big_value_bytes = 64 << 10;
  size_t max_big_value_bytes = 1 << 20;
  // Each writer deletes keys once it holds this many, so the store (and a
  // trial's verification) stays bounded however many trials run.
  int max_live_keys_per_writer = 400;
  // More cohortd flags. The checker's own test passes --engine=memory to
  // see it report losses.
  std::vector<std::string> cohortd_args;
  // Called with one line per trial, if set.
  std::function<void(const std::string&)> log;
};

struct KillTrialReport {
  uint64_t seed = 0;
  int trials = 0;
  int sync_trials = 0;      // Trials written against --sync_writes.
  int restart_retries = 0;  // Restarts that had to wait for the port.

  // Acknowledged writes, by kind.
  int64_t sets = 0;      // Small values on new keys.
  int64_t big_sets = 0;  // Large values, overwriting a few keys.
  int64_t multisets = 0;
  int64_t multiset_keys = 0;
  int64_t appends = 0;
  int64_t adds = 0;
  int64_t add_delta_sum = 0;
  int64_t deletes = 0;
  int64_t compare_sets = 0;  // Of which swapped:
  int64_t compare_sets_swapped = 0;
  int64_t acked() const {
    return sets + big_sets + multisets + appends + adds + deletes +
           compare_sets;
  }

  // Calls that failed because of the kill, and how many of those were found
  // applied after the restart (either is correct; Adds are not counted
  // there, since the counters are shared).
  int64_t in_flight = 0;
  int64_t in_flight_applied = 0;
  // Keys and counters compared with the model, over all verifications.
  int64_t keys_verified = 0;

  // Acknowledged writes missing after a restart: a key, value, delete or
  // counter delta that a writer saw acknowledged and the store no longer
  // shows. Must be 0.
  int64_t lost = 0;
  // Every other disagreement with the model: a reply that contradicts the
  // acknowledged state (e.g. Delete of an existing key saying it did not
  // exist), a MultiSet half applied, a key nobody wrote, a counter above what
  // was sent, a revision that went back, an error before the kill, cohortd
  // dying before it was killed. Must be 0.
  int64_t anomalies = 0;
  // The first few of each, described.
  std::vector<std::string> failures;

  // cohortd's folder at the end: RocksDB tables and blob files, all bytes.
  int sst_files = 0;
  int blob_files = 0;
  int64_t data_bytes = 0;

  absl::Duration wall;
  // OK, or why the campaign stopped early (cohortd did not restart on the
  // folder, a read for verification failed); the counts above are what was
  // seen up to then.
  absl::Status status;

  // One line: trials, acknowledged writes by kind, lost, anomalies, time.
  std::string Summary() const;
};

// Runs the trials. Blocks for about trials * (max_kill_delay / 2 + a
// restart and a verification).
KillTrialReport RunKillTrials(const KillTrialOptions& options);

}  // namespace cohort::testing

#endif  // COHORT_TESTS_TESTING_KILL_TRIALS_H_
