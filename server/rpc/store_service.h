// StoreService: cohort.v1.Store over gRPC's callback API.
//
// Thin glue: each RPC validates its request, calls KvStore and maps the
// result. Writes to cohortd's reserved namespace (c10d::kReservedPrefix)
// are refused here, at the protocol's edge, so that cohortd's own state
// machines, which write through KvStore, still can. Blocking RPCs (Get, Wait,
// MultiGet) register a KvStore waiter and return without holding a thread;
// Watch is a server-streaming reactor fed by KvStore's watch callbacks.
#ifndef COHORT_SERVER_RPC_STORE_SERVICE_H_
#define COHORT_SERVER_RPC_STORE_SERVICE_H_

#include <cstddef>

#include "cohort/v1/store.grpc.pb.h"
#include "server/auth/auth.h"
#include "server/auth/quota.h"
#include "store/kv_store.h"

namespace cohort::server {

struct WatchGauges;  // reactors.h

struct StoreServiceOptions {
  // A watcher whose unsent events exceed this is ended with
  // RESOURCE_EXHAUSTED; it may resume from the last revision it saw.
  size_t watch_buffer_bytes = 64 << 20;
  // Checks every call's token against the keys it names (auth.h); null:
  // auth off. Not owned.
  Authenticator* auth = nullptr;
  // Where open watches and their unsent bytes are counted (metrics); null:
  // nowhere. Must outlive the service's streams.
  WatchGauges* watch_gauges = nullptr;
  // Charges each tenant (QuotaOwner: a job's token, or with auth off a
  // connection) for its open watch streams and its parked waits (Get,
  // Wait, MultiGet; one wait and its number of keys), until the call ends;
  // a call over a quota fails with RESOURCE_EXHAUSTED naming it. Null: no
  // quotas. Not owned; must outlive the service's calls.
  Quotas* quotas = nullptr;
};

class StoreService final : public cohort::v1::Store::CallbackService {
 public:
  // `store` must outlive the service.
  StoreService(store::KvStore* store, StoreServiceOptions options = {});

  grpc::ServerUnaryReactor* Set(grpc::CallbackServerContext* ctx,
                                const v1::SetRequest* req,
                                v1::SetResponse* resp) override;
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* ctx,
                                const v1::GetRequest* req,
                                v1::GetResponse* resp) override;
  grpc::ServerUnaryReactor* Add(grpc::CallbackServerContext* ctx,
                                const v1::AddRequest* req,
                                v1::AddResponse* resp) override;
  grpc::ServerUnaryReactor* CompareSet(grpc::CallbackServerContext* ctx,
                                       const v1::CompareSetRequest* req,
                                       v1::CompareSetResponse* resp) override;
  grpc::ServerUnaryReactor* Wait(grpc::CallbackServerContext* ctx,
                                 const v1::WaitRequest* req,
                                 v1::WaitResponse* resp) override;
  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* ctx,
                                  const v1::CheckRequest* req,
                                  v1::CheckResponse* resp) override;
  grpc::ServerUnaryReactor* Delete(grpc::CallbackServerContext* ctx,
                                   const v1::DeleteRequest* req,
                                   v1::DeleteResponse* resp) override;
  grpc::ServerUnaryReactor* NumKeys(grpc::CallbackServerContext* ctx,
                                    const v1::NumKeysRequest* req,
                                    v1::NumKeysResponse* resp) override;
  grpc::ServerUnaryReactor* MultiGet(grpc::CallbackServerContext* ctx,
                                     const v1::MultiGetRequest* req,
                                     v1::MultiGetResponse* resp) override;
  grpc::ServerUnaryReactor* MultiSet(grpc::CallbackServerContext* ctx,
                                     const v1::MultiSetRequest* req,
                                     v1::MultiSetResponse* resp) override;
  grpc::ServerUnaryReactor* Append(grpc::CallbackServerContext* ctx,
                                   const v1::AppendRequest* req,
                                   v1::AppendResponse* resp) override;
  grpc::ServerUnaryReactor* ListKeys(grpc::CallbackServerContext* ctx,
                                     const v1::ListKeysRequest* req,
                                     v1::ListKeysResponse* resp) override;
  grpc::ServerWriteReactor<v1::WatchResponse>* Watch(
      grpc::CallbackServerContext* ctx, const v1::WatchRequest* req) override;

 private:
  store::KvStore* const store_;
  const StoreServiceOptions options_;
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_RPC_STORE_SERVICE_H_
