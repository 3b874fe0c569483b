// Rendezvous: elastic rounds of nodes per run id. The state machine behind
// cohort.v1.Rendezvous, with no I/O of its own.
//
// A run collects joiners for its next round; the round completes when
// max_nodes have joined, or last_call_timeout after min_nodes have. Each
// completed round is recorded in the KvStore (RunKey), so a cohortd restart
// keeps the run's config, its round count and last participants. Joiners
// still collecting are calls in flight: a restart ends them with
// UNAVAILABLE and they join again.
#ifndef COHORT_SERVER_RENDEZVOUS_H_
#define COHORT_SERVER_RENDEZVOUS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/deadline_timer.h"
#include "cohort/v1/coordination.pb.h"
#include "store/kv_store.h"

namespace cohort::server {

// What Rendezvous::stats() reports, for monitoring (no run ids: a label
// per run would grow without bound).
struct RendezvousStats {
  uint64_t rounds_completed = 0;  // Since this process started.
  size_t waiting_nodes = 0;       // Joins collecting now, over all runs.
  size_t runs = 0;                // Runs known (recorded or collecting).
};

class Rendezvous {
 public:
  using JoinId = uint64_t;
  using JoinCallback = std::function<void(absl::StatusOr<v1::JoinResponse>)>;

  // Rounds with more nodes than this leave JoinResponse.participants empty
  // (see coordination.proto).
  static constexpr int kMaxInlineParticipants = 256;

  // Loads the runs recorded in `store`, which must outlive this.
  explicit Rendezvous(store::KvStore* store);
  ~Rendezvous();

  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  // The KvStore key holding `run_id`'s RunState.
  static std::string RunKey(absl::string_view run_id);

  // Joins the run's next round; `done` runs once, when the round completes
  // or the join fails (maybe before this returns: then the result is 0).
  JoinId Join(const v1::JoinRequest& req, JoinCallback done);
  // Withdraws a pending join (the caller went away).
  void CancelJoin(JoinId id);

  absl::StatusOr<v1::RunState> GetRunState(const std::string& run_id);
  // A page of the participants of the run's last completed round; the
  // rules are those of coordination.proto's ListParticipants.
  absl::StatusOr<v1::ListParticipantsResponse> ListParticipants(
      const v1::ListParticipantsRequest& req);
  absl::Status CloseRun(const std::string& run_id);

  // Fails every pending join with `status`, and later ones at once.
  void Shutdown(absl::Status status);

  // Counts for monitoring; takes the lock once, visits every run.
  RendezvousStats stats();

 private:
  struct Pending {
    JoinId id = 0;
    v1::Participant node;
    JoinCallback done;
    base::DeadlineTimer::TimerId timer = 0;
    absl::Duration timeout;
  };
  struct Run {
    v1::RunState record;  // The persisted part: config and last round.
    bool has_completed = false;
    std::map<std::string, Pending> collecting;  // By node id: rank order.
    base::DeadlineTimer::TimerId last_call = 0;
  };
  using Deferred = std::vector<std::function<void()>>;

  int64_t CollectingRound(const Run& run) const {
    return run.has_completed ? run.record.round() + 1 : 0;
  }
  void CompleteLocked(const std::string& run_id, Run& run, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnJoinTimeout(const std::string& run_id, const std::string& node_id,
                     JoinId id);
  void OnLastCall(const std::string& run_id, int64_t round);

  store::KvStore* const store_;

  absl::Mutex mu_;
  std::map<std::string, Run> runs_ ABSL_GUARDED_BY(mu_);
  JoinId next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t rounds_completed_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status shutdown_ ABSL_GUARDED_BY(mu_);
  // Last, so it is destroyed first: its callbacks use everything above.
  base::DeadlineTimer timer_;
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_RENDEZVOUS_H_
