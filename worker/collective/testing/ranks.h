// Test support: runs the ranks of a real Gloo process group as forked
// processes over loopback, rendezvousing through a FileStore in the test's
// temporary directory (no cohortd, no gRPC in the parent), and moves float
// vectors from the ranks back to the test through files.
#ifndef COHORT_WORKER_COLLECTIVE_TESTING_RANKS_H_
#define COHORT_WORKER_COLLECTIVE_TESTING_RANKS_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "worker/collective/process_group.h"

// Inside a forked rank gtest assertions do not reach the parent: a rank
// reports a failed check as its error status instead.
#define RANK_CHECK(cond)                                                    \
  do {                                                                      \
    if (!(cond)) {                                                          \
      return absl::InternalError(                                           \
          absl::StrCat(__FILE__, ":", __LINE__, ": check failed: " #cond)); \
    }                                                                       \
  } while (0)

#define RANK_OK(expr)                                                          \
  do {                                                                         \
    absl::Status rank_status = (expr);                                         \
    if (!rank_status.ok()) {                                                   \
      return absl::Status(                                                     \
          rank_status.code(),                                                  \
          absl::StrCat(__FILE__, ":", __LINE__, ": ", rank_status.message())); \
    }                                                                          \
  } while (0)

namespace cohort::testing {

using RankMain = std::function<absl::Status(std::shared_ptr<ProcessGroup>)>;

// Forks `world` ranks; each creates its Gloo group through the backend
// factory (CreateProcessGroup; timeout 30 s, verify_ops on) and runs
// `main`. Adds a gtest failure for every rank that returns an error
// (printed by the rank on stderr), crashes, or is still running after
// `limit` (then killed).
void RunRanks(int world, const RankMain& main,
              absl::Duration limit = absl::Seconds(90));

// A fresh path in the test's temporary directory ($TEST_TMPDIR).
std::string TempPath(const std::string& name);

absl::Status WriteFloats(const std::string& path,
                         const std::vector<float>& values);
absl::StatusOr<std::vector<float>> ReadFloats(const std::string& path);

}  // namespace cohort::testing

#endif  // COHORT_WORKER_COLLECTIVE_TESTING_RANKS_H_
