#include "server/coordination_service.h"

#include <utility>

#include "server/reactors.h"

namespace cohort::server {

grpc::ServerUnaryReactor* RendezvousService::Join(
    grpc::CallbackServerContext* ctx, const v1::JoinRequest* req,
    v1::JoinResponse* resp) {
  if (absl::Status s =
          AuthorizeCall(auth_, *ctx, "run", req->run_id(), Access::kWrite);
      !s.ok()) {
    return FinishNow(ctx, s);
  }
  absl::StatusOr<Coordination> coordination = slot_->Get();
  if (!coordination.ok()) return FinishNow(ctx, coordination.status());
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
  if (absl::Status s =
          AuthorizeCall(auth_, *ctx, "run", req->run_id(), Access::kRead);
      !s.ok()) {
    return FinishNow(ctx, s);
  }
  absl::StatusOr<Coordination> coordination = slot_->Get();
  if (!coordination.ok()) return FinishNow(ctx, coordination.status());
  absl::StatusOr<v1::RunState> state =
      coordination->rendezvous->GetRunState(req->run_id());
  if (state.ok()) *resp = std::move(*state);
  return FinishNow(ctx, state.status());
}

grpc::ServerUnaryReactor* RendezvousService::CloseRun(
    grpc::CallbackServerContext* ctx, const v1::CloseRunRequest* req,
    v1::CloseRunResponse*) {
  if (absl::Status s =
          AuthorizeCall(auth_, *ctx, "run", req->run_id(), Access::kWrite);
      !s.ok()) {
    return FinishNow(ctx, s);
  }
  absl::StatusOr<Coordination> coordination = slot_->Get();
  if (!coordination.ok()) return FinishNow(ctx, coordination.status());
  return FinishNow(ctx, coordination->rendezvous->CloseRun(req->run_id()));
}

grpc::ServerUnaryReactor* RendezvousService::ListParticipants(
    grpc::CallbackServerContext* ctx, const v1::ListParticipantsRequest* req,
    v1::ListParticipantsResponse* resp) {
  if (absl::Status s =
          AuthorizeCall(auth_, *ctx, "run", req->run_id(), Access::kRead);
      !s.ok()) {
    return FinishNow(ctx, s);
  }
  absl::StatusOr<Coordination> coordination = slot_->Get();
  if (!coordination.ok()) return FinishNow(ctx, coordination.status());
  absl::StatusOr<v1::ListParticipantsResponse> r =
      coordination->rendezvous->ListParticipants(*req);
  if (r.ok()) *resp = std::move(*r);
  return FinishNow(ctx, r.status());
}

grpc::ServerUnaryReactor* MembershipService::JoinGroup(
    grpc::CallbackServerContext* ctx, const v1::JoinGroupRequest* req,
    v1::JoinGroupResponse* resp) {
  if (absl::Status s =
          AuthorizeCall(auth_, *ctx, "group", req->group(), Access::kWrite);
      !s.ok()) {
    return FinishNow(ctx, s);
  }
  absl::StatusOr<Coordination> coordination = slot_->Get();
  if (!coordination.ok()) return FinishNow(ctx, coordination.status());
  absl::StatusOr<v1::JoinGroupResponse> r =
      coordination->membership->Join(*req);
  if (r.ok()) *resp = std::move(*r);
  return FinishNow(ctx, r.status());
}

grpc::ServerUnaryReactor* MembershipService::Heartbeat(
    grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* req,
    v1::HeartbeatResponse*) {
  if (absl::Status s =
          AuthorizeCall(auth_, *ctx, "group", req->group(), Access::kWrite);
      !s.ok()) {
    return FinishNow(ctx, s);
  }
  absl::StatusOr<Coordination> coordination = slot_->Get();
  if (!coordination.ok()) return FinishNow(ctx, coordination.status());
  return FinishNow(ctx, coordination->membership->Heartbeat(*req));
}

grpc::ServerUnaryReactor* MembershipService::LeaveGroup(
    grpc::CallbackServerContext* ctx, const v1::LeaveGroupRequest* req,
    v1::LeaveGroupResponse*) {
  if (absl::Status s =
          AuthorizeCall(auth_, *ctx, "group", req->group(), Access::kWrite);
      !s.ok()) {
    return FinishNow(ctx, s);
  }
  absl::StatusOr<Coordination> coordination = slot_->Get();
  if (!coordination.ok()) return FinishNow(ctx, coordination.status());
  return FinishNow(ctx, coordination->membership->Leave(*req));
}

grpc::ServerUnaryReactor* MembershipService::ReportError(
    grpc::CallbackServerContext* ctx, const v1::ReportErrorRequest* req,
    v1::ReportErrorResponse*) {
  if (absl::Status s =
          AuthorizeCall(auth_, *ctx, "group", req->group(), Access::kWrite);
      !s.ok()) {
    return FinishNow(ctx, s);
  }
  absl::StatusOr<Coordination> coordination = slot_->Get();
  if (!coordination.ok()) return FinishNow(ctx, coordination.status());
  return FinishNow(ctx, coordination->membership->ReportError(*req));
}

grpc::ServerUnaryReactor* MembershipService::ListMembers(
    grpc::CallbackServerContext* ctx, const v1::ListMembersRequest* req,
    v1::ListMembersResponse* resp) {
  if (absl::Status s =
          AuthorizeCall(auth_, *ctx, "group", req->group(), Access::kRead);
      !s.ok()) {
    return FinishNow(ctx, s);
  }
  absl::StatusOr<Coordination> coordination = slot_->Get();
  if (!coordination.ok()) return FinishNow(ctx, coordination.status());
  absl::StatusOr<v1::ListMembersResponse> r =
      coordination->membership->List(*req);
  if (r.ok()) *resp = std::move(*r);
  return FinishNow(ctx, r.status());
}

grpc::ServerWriteReactor<v1::WatchMembersResponse>*
MembershipService::WatchMembers(grpc::CallbackServerContext* ctx,
                                const v1::WatchMembersRequest* req) {
  if (absl::Status s =
          AuthorizeCall(auth_, *ctx, "group", req->group(), Access::kRead);
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
  reactor->Start(Membership::MembersPrefix(req->group()), req->from_revision());
  return reactor;
}

grpc::ServerUnaryReactor* MembershipService::Barrier(
    grpc::CallbackServerContext* ctx, const v1::BarrierRequest* req,
    v1::BarrierResponse* resp) {
  if (absl::Status s =
          AuthorizeCall(auth_, *ctx, "group", req->group(), Access::kWrite);
      !s.ok()) {
    return FinishNow(ctx, s);
  }
  absl::StatusOr<Coordination> coordination = slot_->Get();
  if (!coordination.ok()) return FinishNow(ctx, coordination.status());
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
