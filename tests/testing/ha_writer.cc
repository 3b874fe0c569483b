// ha_writer: the write load and checker of tests/robustness/etcd_ha_test.sh.
// Writes through cohortd replicas (RemoteStore over several addresses) until
// SIGTERM, keeping every write whose reply arrived, then checks each of
// them through a fresh connection:
//   - every acknowledged Set is there with its value (none lost);
//   - the counter equals the acknowledged Adds, plus at most the Adds whose
//     answer was lost ("may or may not have been applied"): an Add is never
//     applied twice.
// Prints one summary line and exits 1 if anything was lost.
//
//   ha_writer --addr=IP:PORT,IP:PORT --threads=4 --prefix=ha/
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/signals.h"
#include "client/remote_store.h"

ABSL_FLAG(std::string, addr, "", "cohortd replicas, IP:PORT,...");
ABSL_FLAG(int, threads, 4, "writer threads");
ABSL_FLAG(std::string, prefix, "ha/", "key prefix");

namespace {

struct Tally {
  std::mutex mu;
  std::vector<std::pair<std::string, std::string>> sets;  // Acknowledged.
  int64_t adds = 0;                                       // Acknowledged.
  int64_t ambiguous_adds = 0;  // Answer lost: may have applied.
  int64_t failed = 0;          // Refused: not applied.
};

cohort::RemoteStoreOptions Options() {
  cohort::RemoteStoreOptions options;
  options.address = absl::GetFlag(FLAGS_addr);
  options.connect_timeout = absl::Seconds(20);
  options.rpc_timeout = absl::Seconds(10);
  options.max_attempts = 20;
  options.max_backoff = absl::Milliseconds(500);
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  const sigset_t stop = cohort::base::BlockStopSignals();
  absl::ParseCommandLine(argc, argv);
  const std::string prefix = absl::GetFlag(FLAGS_prefix);
  Tally tally;
  std::atomic<bool> done{false};
  std::vector<std::thread> writers;
  for (int t = 0; t < absl::GetFlag(FLAGS_threads); ++t) {
    writers.emplace_back([&, t] {
      auto store = cohort::RemoteStore::Connect(Options());
      if (!store.ok()) {
        std::fprintf(stderr, "ha_writer: %s\n",
                     store.status().ToString().c_str());
        return;
      }
      for (int64_t i = 0; !done; ++i) {
        if (i % 2 == 0) {
          const std::string key = absl::StrCat(prefix, "t", t, "/", i);
          const std::string value = absl::StrCat("v", i);
          absl::Status s = (*store)->Set(key, value);
          std::lock_guard<std::mutex> lock(tally.mu);
          if (s.ok()) {
            tally.sets.emplace_back(key, value);
          } else {
            ++tally.failed;
          }
        } else {
          absl::StatusOr<int64_t> s =
              (*store)->Add(absl::StrCat(prefix, "counter"), 1);
          std::lock_guard<std::mutex> lock(tally.mu);
          if (s.ok()) {
            ++tally.adds;
          } else if (absl::IsUnavailable(s.status()) ||
                     absl::IsDeadlineExceeded(s.status())) {
            ++tally.ambiguous_adds;
          } else {
            ++tally.failed;
          }
        }
      }
    });
  }
  int signal = 0;
  sigwait(&stop, &signal);
  done = true;
  for (std::thread& w : writers) w.join();

  auto checker = cohort::RemoteStore::Connect(Options());
  if (!checker.ok()) {
    std::printf("ha_writer: cannot check: %s\n",
                checker.status().ToString().c_str());
    return 1;
  }
  int64_t lost = 0;
  for (const auto& [key, value] : tally.sets) {
    absl::StatusOr<std::string> got = (*checker)->Get(key, absl::Seconds(5));
    if (!got.ok() || *got != value) {
      if (lost < 5) {
        std::printf("LOST %s (expected %s): %s\n", key.c_str(), value.c_str(),
                    got.ok() ? got->c_str() : got.status().ToString().c_str());
      }
      ++lost;
    }
  }
  int64_t counter = 0;
  if (tally.adds + tally.ambiguous_adds > 0) {
    absl::StatusOr<std::string> text =
        (*checker)->Get(absl::StrCat(prefix, "counter"), absl::Seconds(5));
    if (!text.ok() || !absl::SimpleAtoi(*text, &counter)) counter = -1;
  }
  const bool counter_ok =
      counter >= tally.adds && counter <= tally.adds + tally.ambiguous_adds;
  std::printf(
      "ha_writer: acknowledged_sets=%zu lost=%lld acknowledged_adds=%lld "
      "ambiguous_adds=%lld counter=%lld counter_ok=%d refused=%lld\n",
      tally.sets.size(), static_cast<long long>(lost),
      static_cast<long long>(tally.adds),
      static_cast<long long>(tally.ambiguous_adds),
      static_cast<long long>(counter), counter_ok ? 1 : 0,
      static_cast<long long>(tally.failed));
  return lost == 0 && counter_ok ? 0 : 1;
}
