// CoordinationSlot: where cohortd's services find the rendezvous and
// membership state machines. A single cohortd fills it once at start.
// Replicas over etcd fill it only on the elected leader, which rebuilds the
// state machines from the store when it takes over; on a follower it says
// where the leader is, and the calls fail UNAVAILABLE with that address so
// clients go there.
#ifndef COHORT_SERVER_COORDINATION_SLOT_H_
#define COHORT_SERVER_COORDINATION_SLOT_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/membership.h"
#include "server/rendezvous.h"

namespace cohort::server {

struct Coordination {
  std::shared_ptr<Rendezvous> rendezvous;
  std::shared_ptr<Membership> membership;
};

// The UNAVAILABLE message prefix a follower answers with; the leader's
// address follows it (empty while no leader is known).
inline constexpr char kNotLeader[] = "this cohortd replica is not the leader; ";
// The trailing metadata key that carries the leader's HOST:PORT.
inline constexpr char kLeaderMetadata[] = "cohort-leader";

class CoordinationSlot {
 public:
  // The state machines, or UNAVAILABLE naming the leader (`leader()`).
  absl::StatusOr<Coordination> Get() const;

  // Installs state machines (this replica leads, or there is no election).
  void Fill(Coordination coordination);
  // Takes them out (leadership lost, or draining) and returns them for the
  // caller to shut down; later calls are told `leader` leads.
  Coordination Empty(std::string leader);
  // Records who leads, while this replica does not.
  void SetLeader(std::string leader);
  std::string leader() const;

 private:
  mutable absl::Mutex mu_;
  Coordination current_ ABSL_GUARDED_BY(mu_);
  std::string leader_ ABSL_GUARDED_BY(mu_);
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_COORDINATION_SLOT_H_
