// RendezvousClient: joins elastic rendezvous rounds on cohortd.
// See proto/cohort/v1/coordination.proto (service Rendezvous) for the rules.
#ifndef COHORT_CLIENT_RENDEZVOUS_CLIENT_H_
#define COHORT_CLIENT_RENDEZVOUS_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/connection.h"

namespace cohort {

struct RendezvousOptions {
  std::string run_id;
  std::string node_id;
  // How peers reach this node (e.g. its hostname); handed to every peer.
  std::string address;
  int local_world_size = 1;
  int min_nodes = 1;
  int max_nodes = 1;
  absl::Duration join_timeout = absl::Seconds(600);
  absl::Duration last_call_timeout = absl::Seconds(30);
};

struct RendezvousPeer {
  std::string node_id;
  std::string address;
  int local_world_size = 0;
  int node_rank = 0;
  int first_global_rank = 0;
};

struct RendezvousResult {
  int64_t round = 0;
  int node_rank = 0;
  int num_nodes = 0;
  int world_size = 0;
  int first_global_rank = 0;
  std::vector<RendezvousPeer> peers;  // In node-rank order.
  std::string store_prefix;
};

struct RunStatus {
  enum class Phase { kCollecting, kComplete, kClosed };
  int64_t round = 0;
  Phase phase = Phase::kCollecting;
  int num_participants = 0;
  int num_waiting = 0;
  int min_nodes = 0;
  int max_nodes = 0;
};

class RendezvousClient {
 public:
  // Uses the connection settings of `connection` (address, connect_timeout,
  // retry policy) with a channel of its own.
  static absl::StatusOr<std::unique_ptr<RendezvousClient>> Connect(
      const ConnectionOptions& connection);
  virtual ~RendezvousClient() = default;

  // Joins the next round and blocks until it completes (or join_timeout:
  // DEADLINE_EXCEEDED saying how many of min_nodes arrived). The result
  // lists every peer: a round too large for the join's reply has its list
  // read with ListParticipants, and fails with ABORTED (join again) if a
  // newer round completes before it is read.
  virtual absl::StatusOr<RendezvousResult> Join(
      const RendezvousOptions& options) = 0;

  // The run's round and phase, and how many nodes wait for the next round.
  virtual absl::StatusOr<RunStatus> GetRunStatus(
      const std::string& run_id) = 0;

  // Closes the run: pending and later joins fail with FAILED_PRECONDITION.
  virtual absl::Status CloseRun(const std::string& run_id) = 0;
};

}  // namespace cohort

#endif  // COHORT_CLIENT_RENDEZVOUS_CLIENT_H_
