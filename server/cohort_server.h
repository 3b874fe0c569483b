// CohortServer: cohortd's gRPC server: the Store, Rendezvous and Membership
// services (all state in one KvStore), health and reflection. main.cc adds
// flags and signals; tests start it in-process.
#ifndef COHORT_SERVER_COHORT_SERVER_H_
#define COHORT_SERVER_COHORT_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/server.h"
#include "server/coordination_service.h"
#include "server/membership.h"
#include "server/rendezvous.h"
#include "server/store_service.h"
#include "store/kv_store.h"

namespace cohort::server {

struct ServerOptions {
  // HOST:PORT to listen on; port 0 picks a free port (see port()).
  std::string listen = "0.0.0.0:29500";
  StoreServiceOptions store_service;
};

class CohortServer {
 public:
  // Starts serving `store` (and the coordination state it holds) and marks
  // the health service SERVING. Fails with
  // UNAVAILABLE naming the address if it cannot be bound.
  static absl::StatusOr<std::unique_ptr<CohortServer>> Start(
      std::unique_ptr<store::KvStore> store, const ServerOptions& options);

  // Drains if Drain was not called.
  ~CohortServer();

  // The port actually bound.
  int port() const { return port_; }
  store::KvStore& store() { return *store_; }

  // Graceful stop: health goes NOT_SERVING, pending waits and watches end
  // with UNAVAILABLE, new connections are refused, calls in flight get
  // `grace` to finish, then the store is flushed. Idempotent.
  absl::Status Drain(absl::Duration grace = absl::Seconds(5));

 private:
  CohortServer() = default;

  std::unique_ptr<store::KvStore> store_;
  std::unique_ptr<Membership> membership_;
  std::unique_ptr<Rendezvous> rendezvous_;
  std::unique_ptr<StoreService> service_;
  std::unique_ptr<RendezvousService> rendezvous_service_;
  std::unique_ptr<MembershipService> membership_service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  bool drained_ = false;
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_COHORT_SERVER_H_
