// Rendezvous: elastic rounds of nodes per run id. The state machine behind
// cohort.v1.Rendezvous, with no I/O of its own.
//
// A run collects joiners for its next round; the round completes when
// max_nodes have joined, or last_call_timeout after min_nodes have. Each
// completed round is recorded in the KvStore (RunKey), so a cohortd restart
// keeps the run's config, its round count and last participants. Joiners
// still collecting are calls in flight: a restart ends them with
// UNAVAILABLE and they join again.
#ifndef COHORT_SERVER_COORDINATION_RENDEZVOUS_H_
#define COHORT_SERVER_COORDINATION_RENDEZVOUS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/deadline_timer.h"
#include "cohort/v1/coordination.pb.h"
#include "server/coordination/participant_list.h"
#include "store/kv_store.h"

namespace cohort::server {

// What Rendezvous::stats() reports, for monitoring (no run ids: a label
// per run would grow without bound).
struct RendezvousStats {
  uint64_t rounds_completed = 0;  // Since this process started.
  size_t waiting_nodes = 0;       // Joins collecting now, over all runs.
  size_t runs = 0;                // Runs known (recorded or collecting).
  // The work behind those, since this process started, so that a test
  // can assert what one join costs: nodes visited by loops over a round
  // (each node's completion is one), bytes Rendezvous serialized (run
  // records, participant lists), and bytes of the JoinResponses it
  // answered with.
  uint64_t node_visits = 0;
  uint64_t bytes_serialized = 0;
  uint64_t join_response_bytes = 0;
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
  // O(log N) in the N nodes collecting, but for the join that completes
  // the round: it writes the round's record and answers all N.
  JoinId Join(const v1::JoinRequest& req, JoinCallback done);
  // Withdraws a pending join (the caller went away). O(log N).
  void CancelJoin(JoinId id);

  // The run's state; O(N) unless req.omit_participants().
  absl::StatusOr<v1::RunState> GetRunState(const v1::GetRunStateRequest& req);
  absl::StatusOr<v1::RunState> GetRunState(const std::string& run_id);

  // A page of the participants of the run's last completed round; the
  // rules are those of coordination.proto's ListParticipants. The reply's
  // bytes are pieces of the round's one shared serialization: no copy of
  // the participants per reader. O(log N) besides the page.
  absl::StatusOr<ParticipantsReply> ListParticipantsBytes(
      const v1::ListParticipantsRequest& req);
  // The same, parsed (a copy: for tests and in-process callers).
  absl::StatusOr<v1::ListParticipantsResponse> ListParticipants(
      const v1::ListParticipantsRequest& req);

  // Chosen node ranks of the last completed round, as coordination.proto's
  // GetParticipants; served like ListParticipantsBytes.
  absl::StatusOr<ParticipantsReply> GetParticipantsBytes(
      const v1::GetParticipantsRequest& req);
  absl::StatusOr<v1::GetParticipantsResponse> GetParticipants(
      const v1::GetParticipantsRequest& req);

  absl::Status CloseRun(const std::string& run_id);

  // The ids of the runs known (recorded or collecting), in order: what
  // cohortd's status page lists. O(runs).
  std::vector<std::string> RunIds();

  // Fails every pending join with `status`, and later ones at once.
  void Shutdown(absl::Status status);

  // Counts for monitoring; takes the lock once, visits every run (not
  // every node).
  RendezvousStats stats();

 private:
  struct Pending {
    JoinId id = 0;
    v1::Participant node;
    JoinCallback done;
    base::DeadlineTimer::TimerId timer = 0;
    absl::Duration timeout;
  };
  using Collecting = std::map<std::string, Pending>;  // By node id: rank order.
  struct Run {
    const std::string* id = nullptr;  // The key of runs_ this is under.
    v1::RunState record;  // The persisted part: config and last round.
    bool has_completed = false;
    Collecting collecting;
    // The sum of local_world_size over `collecting`.
    int64_t collecting_world = 0;
    base::DeadlineTimer::TimerId last_call = 0;
    // The last completed round's participants, serialized once for every
    // reader; null until a round completes.
    std::shared_ptr<const ParticipantList> list;
  };
  // Where a pending join is, so that cancelling or timing it out is a
  // lookup, not a search of every run.
  struct JoinRef {
    Run* run;
    Collecting::iterator it;
  };
  using Deferred = std::vector<std::function<void()>>;

  int64_t CollectingRound(const Run& run) const {
    return run.has_completed ? run.record.round() + 1 : 0;
  }
  // Removes a pending join (cancelling its timer) and returns its callback.
  // Why `req` may not join `run` now (shut down, closed, other node
  // bounds, too big a world counting `old`, its earlier join), or OK.
  absl::Status CheckJoinLocked(const v1::JoinRequest& req, const Run& run,
                               Collecting::const_iterator old)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  JoinCallback RemoveLocked(Run& run, Collecting::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes every pending join of `run`, handing each callback `status`.
  void FailAllLocked(Run& run, const absl::Status& status, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Stops the last-call timer if fewer than min_nodes still collect.
  void MaybeStopLastCallLocked(Run& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CompleteLocked(Run& run, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The participant list of the run's last completed round.
  absl::StatusOr<std::shared_ptr<const ParticipantList>> ListOf(
      const std::string& run_id);
  void OnJoinTimeout(JoinId id);
  void OnLastCall(const std::string& run_id, int64_t round);

  store::KvStore* const store_;

  absl::Mutex mu_;
  std::map<std::string, Run> runs_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<JoinId, JoinRef> joins_ ABSL_GUARDED_BY(mu_);
  JoinId next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t rounds_completed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t node_visits_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t bytes_serialized_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t join_response_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status shutdown_ ABSL_GUARDED_BY(mu_);
  // Last, so it is destroyed first: its callbacks use everything above.
  base::DeadlineTimer timer_;
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_COORDINATION_RENDEZVOUS_H_
