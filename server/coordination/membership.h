// Membership: groups of members kept alive by heartbeats, with failure
// detection, error reports and barriers. The state machine behind
// cohort.v1.Membership, with no I/O of its own.
//
// Each member's record (a v1::MemberEvent: its last event and its lease)
// lives in the KvStore under MembersPrefix(group), so a cohortd restart
// keeps the members, and member events are simply KvStore watch events on
// that prefix. Lease deadlines live in memory; after a restart every live
// member gets one heartbeat timeout of grace to reconnect.
#ifndef COHORT_SERVER_COORDINATION_MEMBERSHIP_H_
#define COHORT_SERVER_COORDINATION_MEMBERSHIP_H_

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/deadline_timer.h"
#include "cohort/v1/coordination.pb.h"
#include "store/kv_store.h"

namespace cohort::server {

// What Membership::stats() reports, for monitoring, over all groups.
struct MembershipStats {
  size_t members_alive = 0;
  // Members declared failed (lease expired, or replaced by a restart)
  // since this process started.
  uint64_t members_failed = 0;
  uint64_t barrier_arrivals = 0;  // Barrier calls that waited, since start.
  uint64_t barrier_timeouts = 0;  // Barriers that timed out, since start.
  size_t barrier_waiting = 0;     // Arrivals waiting now.
};

// A member as Membership::Snapshot shows it.
struct MemberSnapshot {
  v1::MemberInfo info;
  bool alive = false;
  // Its last event: JOINED or ERROR_REPORTED while alive, else LEFT or
  // FAILED.
  v1::MemberEvent::Type last_event = v1::MemberEvent::JOINED;
  std::string message;  // Why it failed, or the error it reported.
  // When its lease ends (or ended). Its last renewal (the join, a
  // heartbeat, or this cohortd's start) was one lease timeout before:
  // heartbeat_interval_ms * missed_heartbeats.
  absl::Time lease_end;
};

// A barrier some participants wait at.
struct BarrierSnapshot {
  std::string id;
  int64_t generation = 0;
  size_t participants = 0;
  size_t arrived = 0;  // Participants waiting at it now.
  // The participants that have not arrived, in name order, as members
  // (a participant no longer known: its name alone, rank -1).
  std::vector<v1::MemberInfo> missing;
  size_t missing_unlisted = 0;  // Left out of `missing` by the bound.
  absl::Time started;
  absl::Duration timeout;
};

struct GroupSnapshot {
  std::string group;
  size_t members = 0;  // Every member known: alive, failed or left.
  size_t alive = 0;
  std::vector<MemberSnapshot> listed;     // In name order, bounded.
  std::vector<BarrierSnapshot> barriers;  // Pending ones, by id.
};

class Membership {
 public:
  using BarrierId = uint64_t;
  // Gets the barrier's generation, or why it failed.
  using BarrierCallback = std::function<void(absl::StatusOr<int64_t>)>;

  // Loads the members recorded in `store` (which must outlive this) and
  // starts failure detection, checking leases every `sweep_period`.
  explicit Membership(store::KvStore* store,
                      absl::Duration sweep_period = absl::Milliseconds(50));
  ~Membership();

  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  // The KvStore prefix of `group`'s member records.
  static std::string MembersPrefix(absl::string_view group);
  // Turns a watch event on MembersPrefix into a member event (false for
  // anything else).
  static bool DecodeEvent(const store::Event& event, v1::MemberEvent* out);

  absl::StatusOr<v1::JoinGroupResponse> Join(const v1::JoinGroupRequest& req);
  absl::Status Heartbeat(const v1::HeartbeatRequest& req);
  absl::Status Leave(const v1::LeaveGroupRequest& req);
  absl::Status ReportError(const v1::ReportErrorRequest& req);
  absl::StatusOr<v1::ListMembersResponse> List(
      const v1::ListMembersRequest& req);

  // Arrives at a barrier; `done` runs once (maybe before this returns, then
  // the result is 0). See coordination.proto for the rules.
  BarrierId Barrier(const v1::BarrierRequest& req, BarrierCallback done);
  // Forgets a pending arrival (the caller went away).
  void CancelBarrier(BarrierId id);

  // Fails every pending barrier with `status`; later ones fail at once.
  void Shutdown(absl::Status status);

  // Counts for monitoring; O(1) (kept as members and arrivals change).
  MembershipStats stats();

  // The groups that have members (alive, failed or left), in name order.
  std::vector<std::string> GroupNames();
  // `group` now (cohortd's status page): its first `max_listed` members in
  // name order and its pending barriers, each listing at most `max_listed`
  // missing participants; NOT_FOUND if there is no such group. O(members
  // + each barrier's participants) under the lock: it copies only what it
  // lists.
  absl::StatusOr<GroupSnapshot> Snapshot(const std::string& group,
                                         size_t max_listed);

 private:
  // Costs, so that a group of N members scales: Join, Heartbeat, Leave and
  // each barrier arrival take O(log N) time and at most two store writes
  // (one record each); a sweep costs O(expired log N) however many members
  // are alive; a barrier's creation O(N) once and its completion one
  // callback per arrival.
  struct Live {
    std::string group;  // Its group's name, for a sweep that finds it by time.
    v1::MemberInfo info;
    absl::Time deadline;
    bool alive = true;  // False once failed or left (kept to name it).
    // Its last recorded event, and that event's message.
    v1::MemberEvent::Type last_event = v1::MemberEvent::JOINED;
    std::string message;
  };
  struct Arrival {
    std::string name;
    BarrierCallback done;
  };
  struct PendingBarrier {
    int64_t generation = 0;
    std::vector<std::string> participants;  // Sorted.
    // A participant list an arrival named, as it was sent: an arrival that
    // sends the same list needs no sort to be checked.
    std::vector<std::string> named_as;
    absl::flat_hash_map<BarrierId, Arrival> arrived;
    absl::flat_hash_map<std::string, int> here;  // Arrivals per name.
    base::DeadlineTimer::TimerId timer = 0;
    absl::Time started;
    absl::Duration timeout;
  };
  struct Group {
    std::map<std::string, Live> members;  // By name.
    std::map<std::string, PendingBarrier> barriers;
    absl::flat_hash_map<std::string, int64_t> generations;
  };
  using Deferred = std::vector<std::function<void()>>;

  // Barrier's steps, under mu_: an arrival (0 when it ended the barrier,
  // or was refused through `deferred`), the start of a new barrier, the
  // check of an arrival against its barrier, and a participant that is not
  // a live member (null if none).
  BarrierId ArriveLocked(const v1::BarrierRequest& req, absl::Duration timeout,
                         BarrierCallback done, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartBarrierLocked(Group& group, const v1::BarrierRequest& req,
                          const std::vector<std::string>& named,
                          absl::Duration timeout, PendingBarrier& barrier)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckArrivalLocked(const v1::BarrierRequest& req,
                                  const std::vector<std::string>& named,
                                  PendingBarrier& barrier)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static const std::string* GoneParticipantLocked(
      const Group& group, const PendingBarrier& barrier);
  // Writes `member`'s record with event `type` (and `message`), and notes
  // the event on its Live (if that incarnation is known).
  absl::Status RecordLocked(const std::string& group,
                            const v1::MemberInfo& member,
                            v1::MemberEvent::Type type,
                            const std::string& message)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Finds the live member (name, incarnation) of `group`.
  absl::StatusOr<Live*> FindLocked(const std::string& group,
                                   const std::string& name, int64_t incarnation)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the live member's lease deadline to `deadline`, in leases_ too.
  void RenewLocked(Live& live, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the live member failed or gone, and drops its lease.
  void EndLocked(Live& live) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails the barriers of `group` that `name` takes part in.
  void AbortBarriersLocked(Group& group, const std::string& group_name,
                           const std::string& name, const std::string& why,
                           Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the pending barrier `it` of `group`, each arrival's callback
  // getting `result` (in `deferred`).
  void EndBarrierLocked(Group& group,
                        std::map<std::string, PendingBarrier>::iterator it,
                        const absl::StatusOr<int64_t>& result,
                        Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailBarrierLocked(Group& group, const std::string& barrier_id,
                         const absl::Status& status, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnBarrierTimeout(const std::string& group, const std::string& barrier_id,
                        int64_t generation);
  void Sweep();
  std::string Describe(const std::string& group, const std::string& name)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  store::KvStore* const store_;
  const absl::Duration sweep_period_;

  absl::Mutex mu_;
  std::map<std::string, Group> groups_ ABSL_GUARDED_BY(mu_);
  int64_t last_incarnation_ ABSL_GUARDED_BY(mu_) = 0;
  BarrierId next_barrier_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t members_failed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t barrier_arrivals_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t barrier_timeouts_ ABSL_GUARDED_BY(mu_) = 0;
  // The live members by lease deadline: a sweep visits only the expired.
  std::set<std::pair<absl::Time, Live*>> leases_ ABSL_GUARDED_BY(mu_);
  // Where each pending arrival waits, for CancelBarrier.
  absl::flat_hash_map<BarrierId, PendingBarrier*> arrivals_
      ABSL_GUARDED_BY(mu_);
  absl::Status shutdown_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Last, so it is destroyed first: its callbacks use everything above.
  base::DeadlineTimer timer_;
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_COORDINATION_MEMBERSHIP_H_
