#include "server/rpc/coordination_service.h"

#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "server/rpc/reactors.h"

namespace cohort::server {
namespace {

// A unary call a follower passes on to the leader: the leader's answer,
// status and message included, is the call's. Holds no thread meanwhile.
class Forwarded final : public grpc::ServerUnaryReactor {
 public:
  Forwarded(const grpc::CallbackServerContext& server,
            std::shared_ptr<const LeaderStubs> stubs)
      : stubs_(std::move(stubs)) {
    client_.set_deadline(server.deadline());
    for (const char* key : {"authorization", "cohort-token"}) {
      auto it = server.client_metadata().find(key);
      if (it != server.client_metadata().end()) {
        client_.AddMetadata(key,
                            std::string(it->second.data(), it->second.size()));
      }
    }
    client_.AddMetadata(kForwardedMetadata, "1");
  }

  grpc::ClientContext* client() { return &client_; }
  const LeaderStubs& stubs() const { return *stubs_; }

  void OnCancel() override { client_.TryCancel(); }
  void OnDone() override { delete this; }

 private:
  const std::shared_ptr<const LeaderStubs> stubs_;
  grpc::ClientContext client_;
};

// The call's state machines; else, on a follower, nullopt after passing
// the call on to the leader with `pass_on(forwarded, done)` (*reactor is
// then what the handler returns), or after finishing it UNAVAILABLE.
template <typename PassOn>
std::optional<Coordination> LeaderOrPassOn(const CoordinationSlot& slot,
                                           grpc::CallbackServerContext* ctx,
                                           grpc::ServerUnaryReactor** reactor,
                                           PassOn pass_on) {
  absl::StatusOr<Coordination> coordination = slot.Get();
  if (coordination.ok()) return *std::move(coordination);
  std::shared_ptr<const LeaderStubs> stubs = slot.leader_stubs();
  const bool forwarded = ctx->client_metadata().find(kForwardedMetadata) !=
                         ctx->client_metadata().end();
  if (stubs == nullptr || forwarded) {
    *reactor = FinishNow(ctx, coordination.status());
    return std::nullopt;
  }
  auto* call = new Forwarded(*ctx, std::move(stubs));
  pass_on(call, [call](grpc::Status s) {
    // The leader's own answers pass as they are; a leader this replica
    // cannot reach is named, so that the caller does not blame the
    // replica it called.
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
        (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
         s.error_message() == "Deadline Exceeded")) {
      s = grpc::Status(
          s.error_code(),
          absl::StrCat("this replica passes rendezvous and membership calls "
                       "to the leader at ",
                       call->stubs().address, ", which did not answer: ",
                       s.error_message()));
    }
    call->Finish(s);
  });
  *reactor = call;
  return std::nullopt;
}

// The prologue of every call on the state machines: the token must cover
// `name`; then the state machines, or, on a follower, the call passed on
// (see LeaderOrPassOn).
template <typename PassOn>
std::optional<Coordination> Begin(Authenticator* auth,
                                  const CoordinationSlot& slot,
                                  grpc::CallbackServerContext* ctx,
                                  absl::string_view what,
                                  const std::string& name, Access access,
                                  grpc::ServerUnaryReactor** reactor,
                                  PassOn pass_on) {
  if (absl::Status s = AuthorizeCall(auth, *ctx, what, name, access); !s.ok()) {
    *reactor = FinishNow(ctx, s);
    return std::nullopt;
  }
  return LeaderOrPassOn(slot, ctx, reactor, std::move(pass_on));
}

// A slice's reference to the ParticipantList it points into.
void UnrefList(void* list) {
  delete static_cast<std::shared_ptr<const ParticipantList>*>(list);
}

// The reply as a byte buffer of slices that reference the shared list: no
// copy of the participants (only the short tail is copied).
grpc::ByteBuffer ToByteBuffer(const ParticipantsReply& reply) {
  std::vector<grpc::Slice> slices;
  slices.reserve(reply.pieces.size() + 1);
  for (absl::string_view piece : reply.pieces) {
    if (piece.empty()) continue;
    slices.emplace_back(const_cast<char*>(piece.data()), piece.size(),
                        &UnrefList,
                        new std::shared_ptr<const ParticipantList>(reply.list));
  }
  if (!reply.tail.empty()) slices.emplace_back(reply.tail);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// A raw participants method: parses `bytes` as a Request, checks the token,
// and answers with `serve`'s reply; a follower passes the bytes on to the
// leader as they are.
template <typename Request, typename Serve>
grpc::ServerUnaryReactor* ServeParticipants(
    Authenticator* auth, const CoordinationSlot& slot,
    grpc::CallbackServerContext* ctx, const std::string& method,
    const grpc::ByteBuffer* bytes, grpc::ByteBuffer* resp, Serve serve) {
  Request req;
  grpc::ByteBuffer shared(*bytes);  // Deserialize consumes its buffer.
  if (!grpc::SerializationTraits<Request>::Deserialize(&shared, &req).ok()) {
    return FinishNow(ctx, absl::InvalidArgumentError(absl::StrCat(
                              "the request to ", method, " is not a ",
                              Request::descriptor()->full_name())));
  }
  grpc::ServerUnaryReactor* passed_on = nullptr;
  std::optional<Coordination> coordination = Begin(
      auth, slot, ctx, "run", req.run_id(), Access::kRead, &passed_on,
      [&method, bytes, resp](Forwarded* call, auto done) {
        grpc::GenericStub stub{
            std::shared_ptr<grpc::ChannelInterface>(call->stubs().channel)};
        stub.UnaryCall(call->client(), method, grpc::StubOptions(), bytes, resp,
                       std::move(done));
      });
  if (!coordination.has_value()) return passed_on;
  absl::StatusOr<ParticipantsReply> reply =
      serve(*coordination->rendezvous, req);
  if (reply.ok()) *resp = ToByteBuffer(*reply);
  return FinishNow(ctx, reply.status());
}

}  // namespace

grpc::ServerUnaryReactor* RendezvousService::Join(
    grpc::CallbackServerContext* ctx, const v1::JoinRequest* req,
    v1::JoinResponse* resp) {
  grpc::ServerUnaryReactor* passed_on = nullptr;
  std::optional<Coordination> coordination =
      Begin(auth_, *slot_, ctx, "run", req->run_id(), Access::kWrite,
            &passed_on, [req, resp](Forwarded* call, auto done) {
              call->stubs().rendezvous->async()->Join(call->client(), req, resp,
                                                      std::move(done));
            });
  if (!coordination.has_value()) return passed_on;
  auto* reactor = new PendingUnary();
  PendingUnary::Handle handle = reactor->handle();
  std::shared_ptr<Rendezvous> rendezvous = coordination->rendezvous;
  Rendezvous::JoinId id = rendezvous->Join(
      *req, [handle, resp](absl::StatusOr<v1::JoinResponse> r) {
        if (!handle.Claim()) return;
        if (r.ok()) *resp = std::move(*r);
        handle.Finish(r.status());
      });
  if (id != 0) {
    reactor->SetCancelHook([rendezvous, id] { rendezvous->CancelJoin(id); });
  }
  return reactor;
}

grpc::ServerUnaryReactor* RendezvousService::GetRunState(
    grpc::CallbackServerContext* ctx, const v1::GetRunStateRequest* req,
    v1::RunState* resp) {
  grpc::ServerUnaryReactor* passed_on = nullptr;
  std::optional<Coordination> coordination =
      Begin(auth_, *slot_, ctx, "run", req->run_id(), Access::kRead, &passed_on,
            [req, resp](Forwarded* call, auto done) {
              call->stubs().rendezvous->async()->GetRunState(
                  call->client(), req, resp, std::move(done));
            });
  if (!coordination.has_value()) return passed_on;
  absl::StatusOr<v1::RunState> state =
      coordination->rendezvous->GetRunState(*req);
  if (state.ok()) *resp = std::move(*state);
  return FinishNow(ctx, state.status());
}

grpc::ServerUnaryReactor* RendezvousService::CloseRun(
    grpc::CallbackServerContext* ctx, const v1::CloseRunRequest* req,
    v1::CloseRunResponse* resp) {
  grpc::ServerUnaryReactor* passed_on = nullptr;
  std::optional<Coordination> coordination =
      Begin(auth_, *slot_, ctx, "run", req->run_id(), Access::kWrite,
            &passed_on, [req, resp](Forwarded* call, auto done) {
              call->stubs().rendezvous->async()->CloseRun(
                  call->client(), req, resp, std::move(done));
            });
  if (!coordination.has_value()) return passed_on;
  return FinishNow(ctx, coordination->rendezvous->CloseRun(req->run_id()));
}

grpc::ServerUnaryReactor* RendezvousService::ListParticipants(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
    grpc::ByteBuffer* resp) {
  static const std::string kMethod = "/cohort.v1.Rendezvous/ListParticipants";
  return ServeParticipants<v1::ListParticipantsRequest>(
      auth_, *slot_, ctx, kMethod, req, resp,
      [](Rendezvous& rendezvous, const v1::ListParticipantsRequest& r) {
        return rendezvous.ListParticipantsBytes(r);
      });
}

grpc::ServerUnaryReactor* RendezvousService::GetParticipants(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
    grpc::ByteBuffer* resp) {
  static const std::string kMethod = "/cohort.v1.Rendezvous/GetParticipants";
  return ServeParticipants<v1::GetParticipantsRequest>(
      auth_, *slot_, ctx, kMethod, req, resp,
      [](Rendezvous& rendezvous, const v1::GetParticipantsRequest& r) {
        return rendezvous.GetParticipantsBytes(r);
      });
}

grpc::ServerUnaryReactor* MembershipService::JoinGroup(
    grpc::CallbackServerContext* ctx, const v1::JoinGroupRequest* req,
    v1::JoinGroupResponse* resp) {
  grpc::ServerUnaryReactor* passed_on = nullptr;
  std::optional<Coordination> coordination =
      Begin(auth_, *slot_, ctx, "group", req->group(), Access::kWrite,
            &passed_on, [req, resp](Forwarded* call, auto done) {
              call->stubs().membership->async()->JoinGroup(
                  call->client(), req, resp, std::move(done));
            });
  if (!coordination.has_value()) return passed_on;
  absl::StatusOr<v1::JoinGroupResponse> r =
      coordination->membership->Join(*req);
  if (r.ok()) *resp = std::move(*r);
  return FinishNow(ctx, r.status());
}

grpc::ServerUnaryReactor* MembershipService::Heartbeat(
    grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* req,
    v1::HeartbeatResponse* resp) {
  grpc::ServerUnaryReactor* passed_on = nullptr;
  std::optional<Coordination> coordination =
      Begin(auth_, *slot_, ctx, "group", req->group(), Access::kWrite,
            &passed_on, [req, resp](Forwarded* call, auto done) {
              call->stubs().membership->async()->Heartbeat(
                  call->client(), req, resp, std::move(done));
            });
  if (!coordination.has_value()) return passed_on;
  return FinishNow(ctx, coordination->membership->Heartbeat(*req));
}

grpc::ServerUnaryReactor* MembershipService::LeaveGroup(
    grpc::CallbackServerContext* ctx, const v1::LeaveGroupRequest* req,
    v1::LeaveGroupResponse* resp) {
  grpc::ServerUnaryReactor* passed_on = nullptr;
  std::optional<Coordination> coordination =
      Begin(auth_, *slot_, ctx, "group", req->group(), Access::kWrite,
            &passed_on, [req, resp](Forwarded* call, auto done) {
              call->stubs().membership->async()->LeaveGroup(
                  call->client(), req, resp, std::move(done));
            });
  if (!coordination.has_value()) return passed_on;
  return FinishNow(ctx, coordination->membership->Leave(*req));
}

grpc::ServerUnaryReactor* MembershipService::ReportError(
    grpc::CallbackServerContext* ctx, const v1::ReportErrorRequest* req,
    v1::ReportErrorResponse* resp) {
  grpc::ServerUnaryReactor* passed_on = nullptr;
  std::optional<Coordination> coordination =
      Begin(auth_, *slot_, ctx, "group", req->group(), Access::kWrite,
            &passed_on, [req, resp](Forwarded* call, auto done) {
              call->stubs().membership->async()->ReportError(
                  call->client(), req, resp, std::move(done));
            });
  if (!coordination.has_value()) return passed_on;
  return FinishNow(ctx, coordination->membership->ReportError(*req));
}

grpc::ServerUnaryReactor* MembershipService::ListMembers(
    grpc::CallbackServerContext* ctx, const v1::ListMembersRequest* req,
    v1::ListMembersResponse* resp) {
  grpc::ServerUnaryReactor* passed_on = nullptr;
  std::optional<Coordination> coordination =
      Begin(auth_, *slot_, ctx, "group", req->group(), Access::kRead,
            &passed_on, [req, resp](Forwarded* call, auto done) {
              call->stubs().membership->async()->ListMembers(
                  call->client(), req, resp, std::move(done));
            });
  if (!coordination.has_value()) return passed_on;
  absl::StatusOr<v1::ListMembersResponse> r =
      coordination->membership->List(*req);
  if (r.ok()) *resp = std::move(*r);
  return FinishNow(ctx, r.status());
}

grpc::ServerWriteReactor<v1::WatchMembersResponse>*
MembershipService::WatchMembers(grpc::CallbackServerContext* ctx,
                                const v1::WatchMembersRequest* req) {
  Grant grant;
  if (absl::Status s = AuthorizeCall(auth_, *ctx, "group", req->group(),
                                     Access::kRead, &grant);
      !s.ok()) {
    auto* refused = new EventStream<v1::WatchMembersResponse>(
        store_, 0,
        [](store::Event&, v1::WatchMembersResponse&) -> size_t { return 0; });
    refused->Fail(s);
    return refused;
  }
  auto* reactor = new EventStream<v1::WatchMembersResponse>(
      store_, watch_buffer_bytes_,
      [](store::Event& e, v1::WatchMembersResponse& msg) -> size_t {
        v1::MemberEvent event;
        if (!Membership::DecodeEvent(e, &event)) return 0;
        const size_t bytes = event.ByteSizeLong();
        *msg.add_events() = std::move(event);
        return bytes;
      },
      watch_gauges_);
  absl::StatusOr<QuotaCharge> charge =
      ChargeCall(quotas_, auth_, grant, *ctx, {{Quota::kWatchStreams, 1}});
  if (!charge.ok()) {
    reactor->Fail(charge.status());
    return reactor;
  }
  reactor->Hold(std::move(*charge));
  if (absl::Status s = EndWithGrant(auth_, grant, *reactor); !s.ok()) {
    reactor->Fail(s);
    return reactor;
  }
  reactor->Start(Membership::MembersPrefix(req->group()), req->from_revision());
  return reactor;
}

grpc::ServerUnaryReactor* MembershipService::Barrier(
    grpc::CallbackServerContext* ctx, const v1::BarrierRequest* req,
    v1::BarrierResponse* resp) {
  grpc::ServerUnaryReactor* passed_on = nullptr;
  std::optional<Coordination> coordination =
      Begin(auth_, *slot_, ctx, "group", req->group(), Access::kWrite,
            &passed_on, [req, resp](Forwarded* call, auto done) {
              call->stubs().membership->async()->Barrier(call->client(), req,
                                                         resp, std::move(done));
            });
  if (!coordination.has_value()) return passed_on;
  auto* reactor = new PendingUnary();
  PendingUnary::Handle handle = reactor->handle();
  std::shared_ptr<Membership> membership = coordination->membership;
  Membership::BarrierId id = membership->Barrier(
      *req, [handle, resp](absl::StatusOr<int64_t> generation) {
        if (!handle.Claim()) return;
        if (generation.ok()) resp->set_generation(*generation);
        handle.Finish(generation.status());
      });
  if (id != 0) {
    reactor->SetCancelHook([membership, id] { membership->CancelBarrier(id); });
  }
  return reactor;
}

}  // namespace cohort::server
