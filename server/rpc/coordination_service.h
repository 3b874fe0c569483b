// gRPC glue for cohort.v1.Rendezvous and cohort.v1.Membership over the
// Rendezvous and Membership state machines. Blocking calls (Join, Barrier,
// WatchMembers) are reactors completed by the state machines' callbacks.
#ifndef COHORT_SERVER_RPC_COORDINATION_SERVICE_H_
#define COHORT_SERVER_RPC_COORDINATION_SERVICE_H_

#include "cohort/v1/coordination.grpc.pb.h"
#include "server/auth/auth.h"
#include "server/auth/quota.h"
#include "server/coordination/membership.h"
#include "server/coordination/rendezvous.h"
#include "server/rpc/coordination_slot.h"
#include "store/kv_store.h"

namespace cohort::server {

struct WatchGauges;  // reactors.h

// ListParticipants and GetParticipants are raw methods: their replies are
// pieces of the round's one shared serialization (ParticipantList), sent
// as slices that reference it, so N readers cost no copy each.
class RendezvousService final
    : public v1::Rendezvous::WithRawCallbackMethod_ListParticipants<
          v1::Rendezvous::WithRawCallbackMethod_GetParticipants<
              v1::Rendezvous::CallbackService>> {
 public:
  // `auth` checks that each call's token covers its run id (auth.h); null:
  // auth off. Neither is owned.
  explicit RendezvousService(const CoordinationSlot* slot,
                             Authenticator* auth = nullptr)
      : slot_(slot), auth_(auth) {}

  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* ctx,
                                 const v1::JoinRequest* req,
                                 v1::JoinResponse* resp) override;
  grpc::ServerUnaryReactor* GetRunState(grpc::CallbackServerContext* ctx,
                                        const v1::GetRunStateRequest* req,
                                        v1::RunState* resp) override;
  grpc::ServerUnaryReactor* CloseRun(grpc::CallbackServerContext* ctx,
                                     const v1::CloseRunRequest* req,
                                     v1::CloseRunResponse* resp) override;
  // A v1.ListParticipantsRequest in, a v1.ListParticipantsResponse out.
  grpc::ServerUnaryReactor* ListParticipants(grpc::CallbackServerContext* ctx,
                                             const grpc::ByteBuffer* req,
                                             grpc::ByteBuffer* resp) override;
  // A v1.GetParticipantsRequest in, a v1.GetParticipantsResponse out.
  grpc::ServerUnaryReactor* GetParticipants(grpc::CallbackServerContext* ctx,
                                            const grpc::ByteBuffer* req,
                                            grpc::ByteBuffer* resp) override;

 private:
  const CoordinationSlot* const slot_;
  Authenticator* const auth_;
};

class MembershipService final : public v1::Membership::CallbackService {
 public:
  // `store` serves the member-event streams; watch_buffer_bytes bounds a
  // slow watcher as for store watches, and `watch_gauges` (if not null)
  // counts them. `auth` checks that each call's token covers its group
  // (auth.h); null: auth off. A WatchMembers stream counts against its
  // tenant's watch streams in `quotas` (null: none), and ends when its
  // token is revoked.
  MembershipService(const CoordinationSlot* slot, store::KvStore* store,
                    size_t watch_buffer_bytes,
                    WatchGauges* watch_gauges = nullptr,
                    Authenticator* auth = nullptr, Quotas* quotas = nullptr)
      : slot_(slot),
        store_(store),
        watch_buffer_bytes_(watch_buffer_bytes),
        watch_gauges_(watch_gauges),
        auth_(auth),
        quotas_(quotas) {}

  grpc::ServerUnaryReactor* JoinGroup(grpc::CallbackServerContext* ctx,
                                      const v1::JoinGroupRequest* req,
                                      v1::JoinGroupResponse* resp) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const v1::HeartbeatRequest* req,
                                      v1::HeartbeatResponse* resp) override;
  grpc::ServerUnaryReactor* LeaveGroup(grpc::CallbackServerContext* ctx,
                                       const v1::LeaveGroupRequest* req,
                                       v1::LeaveGroupResponse* resp) override;
  grpc::ServerUnaryReactor* ReportError(grpc::CallbackServerContext* ctx,
                                        const v1::ReportErrorRequest* req,
                                        v1::ReportErrorResponse* resp) override;
  grpc::ServerUnaryReactor* ListMembers(grpc::CallbackServerContext* ctx,
                                        const v1::ListMembersRequest* req,
                                        v1::ListMembersResponse* resp) override;
  grpc::ServerWriteReactor<v1::WatchMembersResponse>* WatchMembers(
      grpc::CallbackServerContext* ctx,
      const v1::WatchMembersRequest* req) override;
  grpc::ServerUnaryReactor* Barrier(grpc::CallbackServerContext* ctx,
                                    const v1::BarrierRequest* req,
                                    v1::BarrierResponse* resp) override;

 private:
  const CoordinationSlot* const slot_;
  store::KvStore* const store_;
  const size_t watch_buffer_bytes_;
  WatchGauges* const watch_gauges_;
  Authenticator* const auth_;
  Quotas* const quotas_;
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_RPC_COORDINATION_SERVICE_H_
