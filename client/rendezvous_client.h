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
  // Whether Join fills RendezvousResult::peers with every node of a round
  // too large for the join's reply (more than 256 nodes): N nodes each
  // reading N peers is O(N^2) bytes over the round. False leaves peers
  // empty; read the ones this node talks to with GetPeers.
  bool list_peers = true;
};

// Node ranks [start_node_rank, end_node_rank).
struct PeerRange {
  int start_node_rank = 0;
  int end_node_rank = 0;
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
  // In node-rank order; empty for a round of more than 256 nodes joined
  // with list_peers false.
  std::vector<RendezvousPeer> peers;
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
  // lists every peer (but see list_peers): a round too large for the
  // join's reply has its list read with ListParticipants, 10,000 a call,
  // and fails with ABORTED (join again) if a newer round completes before
  // it is read.
  virtual absl::StatusOr<RendezvousResult> Join(
      const RendezvousOptions& options) = 0;

  // The peers of `ranges` (node ranks) of the run's round `round`, in the
  // order of the ranges: a node's ring neighbours, tree parent and
  // children, or the root (node rank 0), without reading all N. At most
  // 64 ranges and 10,000 peers a call. ABORTED if the run's last
  // completed round is not `round` (join again; a negative round takes
  // whichever is last); INVALID_ARGUMENT names a range outside
  // [0, num_nodes).
  virtual absl::StatusOr<std::vector<RendezvousPeer>> GetPeers(
      const std::string& run_id, int64_t round,
      const std::vector<PeerRange>& ranges);

  // The run's round and phase, and how many nodes wait for the next round.
  virtual absl::StatusOr<RunStatus> GetRunStatus(const std::string& run_id) = 0;

  // Closes the run: pending and later joins fail with FAILED_PRECONDITION.
  virtual absl::Status CloseRun(const std::string& run_id) = 0;
};

}  // namespace cohort

#endif  // COHORT_CLIENT_RENDEZVOUS_CLIENT_H_
