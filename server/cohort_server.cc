#include "server/cohort_server.h"

#include <algorithm>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.pb.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server_builder.h"

namespace cohort::server {
namespace {

// Time for gRPC to send GOAWAY on every connection once Shutdown begins.
constexpr absl::Duration kGoawayDelay = absl::Milliseconds(100);

int ToMillisArg(absl::Duration d) {
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(d),
                                            std::numeric_limits<int>::max()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<CohortServer>> CohortServer::Start(
    std::unique_ptr<store::KvStore> store, const ServerOptions& options) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  // gRPC's built-in health service is written without protobuf, so its
  // descriptor is in no pool reflection reads: clients that resolve methods
  // by reflection (grpcurl, buf curl) could list grpc.health.v1.Health but
  // not call it. Linking the generated health.proto puts it in the pool.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();

  std::unique_ptr<CohortServer> server(new CohortServer());
  server->store_ = std::move(store);
  StoreServiceOptions store_service = options.store_service;
  store_service.watch_gauges = &server->watch_gauges_;
  server->service_ =
      std::make_unique<StoreService>(server->store_.get(), store_service);
  server->membership_ = std::make_unique<Membership>(server->store_.get());
  server->rendezvous_ = std::make_unique<Rendezvous>(server->store_.get());
  server->rendezvous_service_ =
      std::make_unique<RendezvousService>(server->rendezvous_.get());
  server->membership_service_ = std::make_unique<MembershipService>(
      server->membership_.get(), server->store_.get(),
      options.store_service.watch_buffer_bytes, &server->watch_gauges_);

  const store::StoreLimits& limits = server->store_->limits();
  // Room for the largest single value plus its key and framing; multi-key
  // calls may carry up to 64 MiB.
  const size_t max_message = std::max<size_t>(
      64 << 20, limits.max_value_bytes + limits.max_key_bytes + (1 << 20));
  server->log_ = options.log;
  auto listener = Listener::Bind(
      options.listen,
      {.max_connections = options.max_connections, .log = options.log});
  if (!listener.ok()) return listener.status();
  server->listener_ = std::move(*listener);
  server->port_ = server->listener_->port();

  grpc::ServerBuilder builder;
  if (!options.metrics_listen.empty()) {
    server->metrics_ = std::make_unique<Metrics>();
    if (absl::Status s = server->metrics_->Serve(options.metrics_listen);
        !s.ok()) {
      return s;
    }
    std::vector<
        std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
        interceptors;
    interceptors.push_back(server->metrics_->NewGrpcInterceptorFactory());
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
    server->store_->SetSyncObserver(
        [m = server->metrics_.get()](absl::Duration d) {
          m->ObserveWalSync(d);
        });
  }
  // Connections come only from the Listener; gRPC opens no port itself.
  builder.RegisterService(server->service_.get());
  builder.RegisterService(server->rendezvous_service_.get());
  builder.RegisterService(server->membership_service_.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(
      std::min<size_t>(max_message, std::numeric_limits<int>::max())));
  builder.SetMaxSendMessageSize(static_cast<int>(
      std::min<size_t>(max_message, std::numeric_limits<int>::max())));
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  if (options.idle_timeout > absl::ZeroDuration()) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                               ToMillisArg(options.idle_timeout));
  }
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                             ToMillisArg(options.keepalive_time));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             ToMillisArg(options.keepalive_timeout));
  // Clients may ping as often as every 10 s (RemoteStore's keepalive).
  builder.AddChannelArgument(
      GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr) {
    return absl::InternalError("the gRPC server failed to start");
  }
  server->listener_->Start(server->server_.get());
  if (!options.tcpstore_listen.empty()) {
    std::function<void(tcpstore::Op, TcpStoreOutcome, absl::Duration)> on_query;
    if (Metrics* m = server->metrics_.get()) {
      on_query = [m](tcpstore::Op op, TcpStoreOutcome outcome,
                     absl::Duration d) {
        m->ObserveTcpStoreQuery(op, outcome, d);
      };
    }
    auto tcpstore = TcpStoreServer::Start(
        server->store_.get(), {.listen = options.tcpstore_listen,
                               .max_connections = options.max_connections,
                               .allow = options.tcpstore_allow,
                               .prefix = options.tcpstore_prefix,
                               .log = options.log,
                               .on_query = std::move(on_query)});
    if (!tcpstore.ok()) return tcpstore.status();
    server->tcpstore_ = std::move(*tcpstore);
  }
  if (server->metrics_ != nullptr) {
    server->metrics_->Track({.store = server->store_.get(),
                             .rendezvous = server->rendezvous_.get(),
                             .membership = server->membership_.get(),
                             .grpc_listener = server->listener_.get(),
                             .tcpstore = server->tcpstore_.get(),
                             .watches = &server->watch_gauges_});
  }
  {
    absl::MutexLock lock(&server->health_mu_);
    server->SetServing(true, absl::OkStatus());
    server->server_->GetHealthCheckService()->SetServingStatus(kLivenessService,
                                                               true);
  }
  {
    absl::MutexLock lock(&server->health_mu_);
    server->health_check_ = server->health_timer_.Schedule(
        absl::Now() + options.health_interval,
        [s = server.get(), interval = options.health_interval] {
          s->CheckHealth(interval);
        });
  }
  return server;
}

void CohortServer::SetServing(bool serving, const absl::Status& why) {
  if (serving_ == serving) return;
  serving_ = serving;
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  health->SetServingStatus("", serving);
  for (const char* service :
       {v1::Store::service_full_name(), v1::Rendezvous::service_full_name(),
        v1::Membership::service_full_name()}) {
    health->SetServingStatus(service, serving);
  }
  if (log_ && !stopping_ && (serving ? !last_problem_.ok() : true)) {
    log_(serving ? std::string("health: SERVING again (writes are durable)")
                 : absl::StrCat("health: NOT_SERVING: ", why.message()));
  }
  last_problem_ = why;
}

void CohortServer::CheckHealth(absl::Duration interval) {
  absl::MutexLock lock(&health_mu_);
  if (stopping_) return;
  absl::Status writable = store_->CheckWritable();
  SetServing(writable.ok(), writable);
  health_check_ = health_timer_.Schedule(
      absl::Now() + interval, [this, interval] { CheckHealth(interval); });
}

bool CohortServer::serving() {
  absl::MutexLock lock(&health_mu_);
  return serving_;
}

CohortServer::~CohortServer() { Drain().IgnoreError(); }

absl::Status CohortServer::Drain(absl::Duration grace) {
  if (drained_ || server_ == nullptr) return absl::OkStatus();
  drained_ = true;
  {
    absl::MutexLock lock(&health_mu_);
    stopping_ = true;
    health_timer_.Cancel(health_check_);
    SetServing(false, absl::OkStatus());
    server_->GetHealthCheckService()->SetServingStatus(kLivenessService, false);
  }
  listener_->Stop();
  // Stop accepting first: Shutdown closes the listener and tells every
  // connection (HTTP/2 GOAWAY) to take no new calls, then waits for the
  // calls in flight. Only then are the blocked calls ended, so a client
  // that retries at once cannot land on this dying server again.
  std::thread stopper([this, grace] {
    server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  });
  absl::SleepFor(kGoawayDelay);
  const absl::Status draining = absl::UnavailableError(
      "cohortd is shutting down; retry against its replacement");
  rendezvous_->Shutdown(draining);
  membership_->Shutdown(draining);
  store_->Shutdown(draining);
  if (tcpstore_ != nullptr) tcpstore_->Stop();
  stopper.join();
  server_->Wait();
  // Scrapes stop here: what they read is being torn down.
  if (metrics_ != nullptr) metrics_->StopServing();
  return store_->Flush();
}

}  // namespace cohort::server
