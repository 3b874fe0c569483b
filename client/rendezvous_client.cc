#include "client/rendezvous_client.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cohort/v1/coordination.grpc.pb.h"

namespace cohort {
namespace {

constexpr int kPageSize = 10000;

RendezvousPeer ToPeer(const v1::Participant& p) {
  return RendezvousPeer{p.node_id(), p.address(), p.local_world_size(),
                        p.node_rank(), p.first_global_rank()};
}

class GrpcRendezvousClient final : public RendezvousClient {
 public:
  explicit GrpcRendezvousClient(std::shared_ptr<Connection> connection)
      : connection_(std::move(connection)),
        stub_(v1::Rendezvous::NewStub(connection_->channel())) {}

  absl::StatusOr<RendezvousResult> Join(
      const RendezvousOptions& options) override {
    v1::JoinRequest req;
    req.set_run_id(options.run_id);
    req.set_node_id(options.node_id);
    req.set_address(options.address);
    req.set_local_world_size(options.local_world_size);
    req.set_min_nodes(options.min_nodes);
    req.set_max_nodes(options.max_nodes);
    req.set_join_timeout_ms(ToMillis(options.join_timeout));
    req.set_last_call_timeout_ms(ToMillis(options.last_call_timeout));
    v1::JoinResponse resp;
    // A retried join replaces the node's earlier one, so it is safe to
    // repeat while cohortd restarts.
    if (absl::Status s = connection_->Call(
            "rendezvous join",
            CallOptions::Retryable(options.join_timeout + kServerTimeoutSlack),
            stub_.get(), &v1::Rendezvous::Stub::Join, req, &resp);
        !s.ok()) {
      return s;
    }
    RendezvousResult result;
    result.round = resp.round();
    result.node_rank = resp.node_rank();
    result.num_nodes = resp.num_nodes();
    result.world_size = resp.world_size();
    result.first_global_rank = resp.first_global_rank();
    result.store_prefix = resp.store_prefix();
    if (resp.participants_size() < resp.num_nodes()) {
      if (!options.list_peers) return result;
      // A large round: the list is read a page at a time.
      if (absl::Status s =
              ListParticipants(options.run_id, resp.round(), result.peers);
          !s.ok()) {
        return s;
      }
    } else {
      for (const v1::Participant& p : resp.participants()) {
        result.peers.push_back(ToPeer(p));
      }
    }
    return result;
  }

  absl::StatusOr<RunStatus> GetRunStatus(const std::string& run_id) override {
    v1::GetRunStateRequest req;
    req.set_run_id(run_id);
    req.set_omit_participants(true);
    v1::RunState state;
    if (absl::Status s = connection_->Call(
            "rendezvous state",
            CallOptions::Retryable(connection_->options().rpc_timeout),
            stub_.get(), &v1::Rendezvous::Stub::GetRunState, req, &state);
        !s.ok()) {
      return s;
    }
    RunStatus status;
    status.round = state.round();
    status.phase =
        state.phase() == v1::RunState::COMPLETE ? RunStatus::Phase::kComplete
        : state.phase() == v1::RunState::CLOSED ? RunStatus::Phase::kClosed
                                                : RunStatus::Phase::kCollecting;
    // A cohortd older than omit_participants lists them instead.
    status.num_participants =
        std::max(state.num_participants(), state.participants_size());
    status.num_waiting = state.num_waiting();
    status.min_nodes = state.min_nodes();
    status.max_nodes = state.max_nodes();
    return status;
  }

  absl::StatusOr<std::vector<RendezvousPeer>> GetPeers(
      const std::string& run_id, int64_t round,
      const std::vector<PeerRange>& ranges) override {
    v1::GetParticipantsRequest req;
    req.set_run_id(run_id);
    if (round >= 0) req.set_round(round);
    for (const PeerRange& range : ranges) {
      v1::NodeRankRange* r = req.add_ranges();
      r->set_start_node_rank(range.start_node_rank);
      r->set_end_node_rank(range.end_node_rank);
    }
    v1::GetParticipantsResponse resp;
    if (absl::Status s = connection_->Call(
            "rendezvous peers",
            CallOptions::Retryable(connection_->options().rpc_timeout),
            stub_.get(), &v1::Rendezvous::Stub::GetParticipants, req, &resp);
        !s.ok()) {
      return s;
    }
    std::vector<RendezvousPeer> peers;
    peers.reserve(resp.participants_size());
    for (const v1::Participant& p : resp.participants()) {
      peers.push_back(ToPeer(p));
    }
    return peers;
  }

  absl::Status CloseRun(const std::string& run_id) override {
    v1::CloseRunRequest req;
    req.set_run_id(run_id);
    v1::CloseRunResponse resp;
    return connection_->Call(
        "close run", CallOptions::Retryable(connection_->options().rpc_timeout),
        stub_.get(), &v1::Rendezvous::Stub::CloseRun, req, &resp);
  }

 private:
  // Appends every participant of `round` of the run to `peers`. ABORTED if
  // the run has moved on to a later round: this node must join again.
  absl::Status ListParticipants(const std::string& run_id, int64_t round,
                                std::vector<RendezvousPeer>& peers) {
    v1::ListParticipantsRequest req;
    req.set_run_id(run_id);
    // The most a page holds: cohortd cuts pages from one shared copy of
    // the list, so large pages cost it no more than small ones.
    req.set_page_size(kPageSize);
    do {
      v1::ListParticipantsResponse page;
      if (absl::Status s = connection_->Call(
              "rendezvous participants",
              CallOptions::Retryable(connection_->options().rpc_timeout),
              stub_.get(), &v1::Rendezvous::Stub::ListParticipants, req, &page);
          !s.ok()) {
        return s;
      }
      if (page.round() != round) {
        return absl::AbortedError(absl::StrCat(
            "run '", run_id, "' completed round ", page.round(),
            " before this node read the participants of its round ", round,
            ": join again"));
      }
      if (peers.empty()) peers.reserve(page.num_nodes());
      for (const v1::Participant& p : page.participants()) {
        peers.push_back(ToPeer(p));
      }
      req.set_page_token(page.next_page_token());
    } while (!req.page_token().empty());
    return absl::OkStatus();
  }

  std::shared_ptr<Connection> connection_;
  std::unique_ptr<v1::Rendezvous::Stub> stub_;
};

}  // namespace

absl::StatusOr<std::vector<RendezvousPeer>> RendezvousClient::GetPeers(
    const std::string& run_id, int64_t round,
    const std::vector<PeerRange>& ranges) {
  return absl::UnimplementedError("GetPeers is not implemented here");
}

absl::StatusOr<std::unique_ptr<RendezvousClient>> RendezvousClient::Connect(
    const ConnectionOptions& connection) {
  absl::StatusOr<std::shared_ptr<Connection>> opened =
      Connection::Open(connection);
  if (!opened.ok()) return opened.status();
  return std::make_unique<GrpcRendezvousClient>(std::move(*opened));
}

}  // namespace cohort
