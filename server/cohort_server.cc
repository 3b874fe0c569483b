#include "server/cohort_server.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server_builder.h"

namespace cohort::server {
namespace {

// Time for gRPC to send GOAWAY on every connection once Shutdown begins.
constexpr absl::Duration kGoawayDelay = absl::Milliseconds(100);

}  // namespace

absl::StatusOr<std::unique_ptr<CohortServer>> CohortServer::Start(
    std::unique_ptr<store::KvStore> store, const ServerOptions& options) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  std::unique_ptr<CohortServer> server(new CohortServer());
  server->store_ = std::move(store);
  server->service_ = std::make_unique<StoreService>(server->store_.get(),
                                                    options.store_service);
  server->membership_ = std::make_unique<Membership>(server->store_.get());
  server->rendezvous_ = std::make_unique<Rendezvous>(server->store_.get());
  server->rendezvous_service_ =
      std::make_unique<RendezvousService>(server->rendezvous_.get());
  server->membership_service_ = std::make_unique<MembershipService>(
      server->membership_.get(), server->store_.get(),
      options.store_service.watch_buffer_bytes);

  const store::StoreLimits& limits = server->store_->limits();
  // Room for the largest single value plus its key and framing; multi-key
  // calls may carry up to 64 MiB.
  const size_t max_message =
      std::max<size_t>(64 << 20, limits.max_value_bytes + limits.max_key_bytes +
                                     (1 << 20));
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(),
                           &server->port_);
  builder.RegisterService(server->service_.get());
  builder.RegisterService(server->rendezvous_service_.get());
  builder.RegisterService(server->membership_service_.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(
      std::min<size_t>(max_message, std::numeric_limits<int>::max())));
  builder.SetMaxSendMessageSize(static_cast<int>(
      std::min<size_t>(max_message, std::numeric_limits<int>::max())));
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", options.listen,
        ": the address is in use or not local to this machine"));
  }
  grpc::HealthCheckServiceInterface* health =
      server->server_->GetHealthCheckService();
  health->SetServingStatus("", true);
  for (const char* service :
       {v1::Store::service_full_name(), v1::Rendezvous::service_full_name(),
        v1::Membership::service_full_name()}) {
    health->SetServingStatus(service, true);
  }
  return server;
}

CohortServer::~CohortServer() { Drain().IgnoreError(); }

absl::Status CohortServer::Drain(absl::Duration grace) {
  if (drained_) return absl::OkStatus();
  drained_ = true;
  server_->GetHealthCheckService()->SetServingStatus(false);
  // Stop accepting first: Shutdown closes the listener and tells every
  // connection (HTTP/2 GOAWAY) to take no new calls, then waits for the
  // calls in flight. Only then are the blocked calls ended, so a client
  // that retries at once cannot land on this dying server again.
  std::thread stopper(
      [this, grace] { server_->Shutdown(absl::ToChronoTime(absl::Now() + grace)); });
  absl::SleepFor(kGoawayDelay);
  const absl::Status draining = absl::UnavailableError(
      "cohortd is shutting down; retry against its replacement");
  rendezvous_->Shutdown(draining);
  membership_->Shutdown(draining);
  store_->Shutdown(draining);
  stopper.join();
  server_->Wait();
  return store_->Flush();
}

}  // namespace cohort::server
