// StatusReader: reads the status API's view (status_view.h) from the
// objects cohortd already has, at request time, as Metrics reads its
// gauges at a scrape: the store's revision and counts, the rendezvous
// runs, the membership groups, and each run's flight dumps in the store.
// Only what the viewer's token covers is read. What costs a scan of keys
// (a run's key count, its dumps' diagnosis) is kept per run and redone at
// most every StatusBounds::refresh, however many viewers poll.
#ifndef COHORT_SERVER_STATUS_STATUS_GATHER_H_
#define COHORT_SERVER_STATUS_STATUS_GATHER_H_

#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/auth/auth.h"
#include "server/coordination/membership.h"
#include "server/coordination/rendezvous.h"
#include "server/status/status_view.h"
#include "store/kv_store.h"

namespace cohort::server {

// What the status is read from. The rendezvous and membership are null on
// an HA follower replica (the leader runs them).
struct StatusSources {
  store::KvStore* store = nullptr;
  Authenticator* auth = nullptr;  // Null: auth off (the page is open).
  std::shared_ptr<Rendezvous> rendezvous;
  std::shared_ptr<Membership> membership;
};

// Bounds on what one view holds and what it reads, so that a status
// request costs the same at any size of job.
struct StatusBounds {
  size_t runs = 200;    // Runs listed (the rest counted).
  size_t groups = 200;  // Groups listed.
  // Nodes per run, members per group, missing participants per barrier.
  size_t listed = 256;
  // Flight dump keys listed per run, and bytes of the newest round's
  // dumps read: past either the diagnosis says so instead.
  size_t dump_keys = 65536;
  size_t dump_bytes = 64 << 20;
  // A run's key count and diagnosis are redone at most this often.
  absl::Duration refresh = absl::Seconds(2);
};

// Who is looking, and at what.
struct StatusQuery {
  Grant viewer;  // Its prefix "*" (an admin; auth off) sees everything.
  // Empty: every run and group the viewer may see. Else that run and the
  // group of the same name (cohortrun names its group after the run).
  std::string run;
};

class StatusReader {
 public:
  explicit StatusReader(StatusBounds bounds = {}) : bounds_(bounds) {}

  // The view for `query` at `now`. NOT_FOUND when query.run names neither
  // a run nor a group. REQUIRES: sources.store; the viewer may see
  // query.run (CheckAccess).
  absl::StatusOr<StatusView> Read(const StatusSources& sources,
                                  const StatusQuery& query, absl::Time now);

 private:
  // What costs a scan, per run.
  struct RunFacts {
    absl::Time at;
    std::optional<int64_t> keys;
    std::optional<RunDiagnosis> diagnosis;
  };
  RunView ReadRun(const StatusSources& sources, const std::string& run,
                  absl::Time now);
  RunFacts Facts(const StatusSources& sources, const std::string& run,
                 absl::Time now);
  RunFacts Scan(const StatusSources& sources, const std::string& run,
                absl::Time now);
  // The newest round's flight dumps of `run` as (key, value) pairs; none
  // when it has no dumps. Bounds hit are noted in `errors`.
  std::vector<std::pair<std::string, std::string>> NewestDumps(
      store::KvStore& store, const std::string& run,
      std::vector<std::string>& errors);

  const StatusBounds bounds_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, RunFacts> facts_ ABSL_GUARDED_BY(mu_);
};

// "auth off", or the grant's role and prefix ("r token for prefix 'job1'").
std::string ViewerName(const Grant& viewer);

}  // namespace cohort::server

#endif  // COHORT_SERVER_STATUS_STATUS_GATHER_H_
