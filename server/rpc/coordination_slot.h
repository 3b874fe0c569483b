// CoordinationSlot: where cohortd's services find the rendezvous and
// membership state machines. A single cohortd fills it once at start.
// Replicas over etcd fill it only on the elected leader, which rebuilds the
// state machines from the store when it takes over; on a follower it holds
// stubs to the leader, to which the services pass calls on (and, while no
// leader is known, the calls fail UNAVAILABLE saying so).
#ifndef COHORT_SERVER_RPC_COORDINATION_SLOT_H_
#define COHORT_SERVER_RPC_COORDINATION_SLOT_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cohort/v1/coordination.grpc.pb.h"
#include "server/coordination/membership.h"
#include "server/coordination/rendezvous.h"

namespace cohort::server {

struct Coordination {
  std::shared_ptr<Rendezvous> rendezvous;
  std::shared_ptr<Membership> membership;
};

// The UNAVAILABLE message prefix a follower answers with; the leader's
// address follows it (empty while no leader is known).
inline constexpr char kNotLeader[] = "this cohortd replica is not the leader; ";
// Set on a call a follower passes on to the leader, which must not pass
// it on again.
inline constexpr char kForwardedMetadata[] = "cohort-forwarded";

// Stubs of the leader's services, for a follower to pass calls on.
struct LeaderStubs {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Rendezvous::Stub> rendezvous;
  std::unique_ptr<v1::Membership::Stub> membership;
};

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
  // Stubs to the leader while another replica leads; else null.
  std::shared_ptr<const LeaderStubs> leader_stubs() const;

 private:
  void SetLeaderLocked(std::string leader) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  Coordination current_ ABSL_GUARDED_BY(mu_);
  std::string leader_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const LeaderStubs> stubs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_RPC_COORDINATION_SLOT_H_
