#include "server/cohort_server.h"

#include <algorithm>
#include <limits>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "base/net.h"
#include "grpc/health/v1/health.pb.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server_builder.h"
#include "proto/rpc/tcp_keepalive.h"
#include "server/auth/quota.h"

namespace cohort::server {
namespace {

// Time for gRPC to send GOAWAY on every connection once Shutdown begins.
constexpr absl::Duration kGoawayDelay = absl::Milliseconds(100);

int ToMillisArg(absl::Duration d) {
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(d),
                                            std::numeric_limits<int>::max()));
}

// The TCPStore listener's check of a token hello: the token's grant must
// allow writing under the namespace the connection binds.
std::function<absl::StatusOr<TcpStoreGrant>(absl::string_view,
                                            absl::string_view)>
TokenHelloCheck(Authenticator* auth) {
  if (auth == nullptr) return nullptr;
  return [auth](absl::string_view token,
                absl::string_view name_space) -> absl::StatusOr<TcpStoreGrant> {
    absl::StatusOr<Grant> grant = auth->AuthenticateToken(token);
    if (!grant.ok()) return grant.status();
    // The namespace is a prefix of every key the connection names, so it
    // must lie wholly inside the grant as a prefix (NarrowPrefix leaves it
    // as it is), and the token must be allowed to write.
    absl::Status allowed =
        CheckAccess(*grant, "key", name_space, Access::kWrite);
    if (allowed.ok()) {
      absl::StatusOr<std::string> narrowed = NarrowPrefix(*grant, name_space);
      if (!narrowed.ok() || *narrowed != name_space) {
        allowed = absl::PermissionDeniedError(
            absl::StrCat("the namespace \"", absl::CHexEscape(name_space),
                         "\" reaches keys outside the token's prefix \"",
                         absl::CHexEscape(grant->prefix), "\""));
      }
    }
    if (!allowed.ok()) {
      auth->Denied(*grant, allowed);
      return allowed;
    }
    // A revocation (of it or of a token that issued it) or its expiry
    // ends the connection at its next request.
    return TcpStoreGrant{
        .owner = QuotaOwner(&*grant, ""),
        .still_valid = [auth, grant = *grant] { return auth->Recheck(grant); }};
  };
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

  if (!options.tcpstore_advertise.empty()) {
    if (options.tcpstore_listen.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tcpstore_advertise=", options.tcpstore_advertise,
          " says where clients dial the TCPStore listener, but it is off"));
    }
    absl::Status dialable =
        CheckDialAddress("--tcpstore_advertise", options.tcpstore_advertise);
    if (!dialable.ok()) return dialable;
  }

  std::unique_ptr<CohortServer> server(new CohortServer());
  server->store_ = std::move(store);
  server->quotas_ = std::make_unique<Quotas>(options.quotas);
  server->budget_ = std::make_unique<ConnectionBudget>(options.max_connections);
  server->log_ = options.log;
  server->tls_ = options.tls;
  // The order matters: services need auth; the gRPC server, its services
  // and metrics' interceptor; metrics tracks every listener.
  if (absl::Status s = server->StartAuth(options); !s.ok()) return s;
  server->CreateServices(options);
  if (absl::Status s = server->StartGrpc(options); !s.ok()) return s;
  if (absl::Status s = server->StartHealthListener(options); !s.ok()) return s;
  if (absl::Status s = server->StartTcpStore(options); !s.ok()) return s;
  server->TrackMetrics(server->coordination_.Get().value_or(Coordination()));
  server->StartElection(options);
  server->StartHealthChecks(options.health_interval);
  return server;
}

absl::Status CohortServer::StartAuth(const ServerOptions& options) {
  if (options.tls.enabled() || !options.tls.client_ca_file.empty()) {
    absl::StatusOr<TlsFilesInfo> tls = CheckTlsFiles(options.tls);
    if (!tls.ok()) return tls.status();
    if (options.log) {
      options.log(absl::StrCat(
          "tls: serving certificate ", tls->subject, " (valid until ",
          absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", tls->not_after,
                           absl::UTCTimeZone()),
          ")",
          tls->client_cas > 0
              ? absl::StrCat("; clients need a certificate signed by ",
                             options.tls.client_ca_file, " (mTLS)")
              : std::string()));
    }
  }
  if (options.auth_tokens.empty()) return absl::OkStatus();
  auto auth =
      Authenticator::Start({.tokens_file = options.auth_tokens,
                            .store = store_.get(),
                            .log = options.log,
                            .max_ttl = options.max_token_ttl,
                            .issue_limits = options.token_issue_limits,
                            .sweep_interval = options.token_sweep_interval});
  if (!auth.ok()) return auth.status();
  auth_ = std::move(*auth);
  auth_tokens_ = options.auth_tokens;
  UpdateShares();
  return absl::OkStatus();
}

void CohortServer::CreateServices(const ServerOptions& options) {
  StoreServiceOptions store_options = options.store_service;
  store_options.auth = auth_.get();
  store_options.watch_gauges = &watch_gauges_;
  store_options.quotas = quotas_.get();
  auth_service_ = std::make_unique<AuthService>(auth_.get());
  info_service_ = std::make_unique<InfoService>(
      InfoServiceOptions{.engine = options.engine,
                         .tcpstore_advertise = options.tcpstore_advertise,
                         .tcpstore_prefix = options.tcpstore_prefix,
                         .tcpstore_token_required =
                             auth_ != nullptr && options.tcpstore_require_token,
                         .auth = auth_.get()});
  service_ = std::make_unique<StoreService>(store_.get(), store_options);
  if (options.election_endpoints.empty()) {
    coordination_.Fill(
        {.rendezvous = std::make_shared<Rendezvous>(store_.get()),
         .membership = std::make_shared<Membership>(store_.get())});
  }
  rendezvous_service_ =
      std::make_unique<RendezvousService>(&coordination_, auth_.get());
  membership_service_ = std::make_unique<MembershipService>(
      &coordination_, store_.get(), options.store_service.watch_buffer_bytes,
      &watch_gauges_, auth_.get(), quotas_.get());
}

absl::Status CohortServer::StartMetrics(const ServerOptions& options,
                                        grpc::ServerBuilder& builder) {
  if (options.metrics_listen.empty()) return absl::OkStatus();
  metrics_ = std::make_unique<Metrics>();
  status_page_ = std::make_unique<StatusPage>();
  if (absl::Status s =
          metrics_->Serve(options.metrics_listen, status_page_->Routes());
      !s.ok()) {
    return s;
  }
  std::vector<
      std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(metrics_->NewGrpcInterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  store_->SetSyncObserver(
      [m = metrics_.get()](absl::Duration d) { m->ObserveWalSync(d); });
  return absl::OkStatus();
}

absl::Status CohortServer::StartGrpc(const ServerOptions& options) {
  const store::StoreLimits& limits = store_->limits();
  // Room for the largest single value plus its key and framing; multi-key
  // calls may carry up to 64 MiB.
  const size_t max_message = std::max<size_t>(
      64 << 20, limits.max_value_bytes + limits.max_key_bytes + (1 << 20));
  grpc::ServerBuilder builder;
  const base::TcpKeepalive keepalive{.idle = options.keepalive_time,
                                     .timeout = options.keepalive_timeout};
  if (absl::Status s = StartMetrics(options, builder); !s.ok()) return s;
  if (options.tls.enabled()) {
    // gRPC adopts only plaintext sockets, so with TLS it binds the port.
    builder.AddListeningPort(options.listen, TlsServerCredentials(options.tls),
                             &port_);
  } else {
    // Connections come only from the Listener; gRPC opens no port itself.
    auto listener = Listener::Bind(options.listen,
                                   {.max_connections = options.max_connections,
                                    .budget = budget_.get(),
                                    .keepalive = keepalive,
                                    .log = options.log});
    if (!listener.ok()) return listener.status();
    listener_ = std::move(*listener);
    port_ = listener_->port();
  }
  builder.RegisterService(service_.get());
  builder.RegisterService(auth_service_.get());
  builder.RegisterService(info_service_.get());
  builder.RegisterService(rendezvous_service_.get());
  builder.RegisterService(membership_service_.get());
  builder.SetMaxReceiveMessageSize(static_cast<int>(
      std::min<size_t>(max_message, std::numeric_limits<int>::max())));
  builder.SetMaxSendMessageSize(static_cast<int>(
      std::min<size_t>(max_message, std::numeric_limits<int>::max())));
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  if (options.idle_timeout > absl::ZeroDuration()) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                               ToMillisArg(options.idle_timeout));
  }
  // Dead clients are found by the kernel's keepalive, which a busy client
  // still answers; gRPC's HTTP/2 pings, which need its threads, are off
  // (the Listener sets the same on the connections it accepts).
  base::UseTcpKeepalive(keepalive, &builder);
  // Clients with a keepalive of their own may ping every 10 s (gRPC's
  // common setting) with room for their timers' jitter: two pings closer
  // than this (strikes) would make gRPC close the connection, calls and all.
  builder.AddChannelArgument(
      GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot serve gRPC on ", options.listen,
        options.tls.enabled() ? " (TLS): is the port in use or the address "
                                "not this host's?"
                              : ": the gRPC server failed to start"));
  }
  if (listener_ != nullptr) listener_->Start(server_.get());
  return absl::OkStatus();
}

absl::Status CohortServer::StartHealthListener(const ServerOptions& options) {
  if (options.health_listen.empty()) return absl::OkStatus();
  grpc::ServerBuilder health;
  health.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  health.AddListeningPort(options.health_listen,
                          grpc::InsecureServerCredentials(), &health_port_);
  health_server_ = health.BuildAndStart();
  if (health_server_ == nullptr || health_port_ == 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot serve health checks on --health_listen ", options.health_listen,
        ": is the port in use or the address not this host's?"));
  }
  return absl::OkStatus();
}

absl::Status CohortServer::StartTcpStore(const ServerOptions& options) {
  if (options.tcpstore_listen.empty()) return absl::OkStatus();
  std::function<void(tcpstore::Op, TcpStoreOutcome, absl::Duration)> on_query;
  if (Metrics* m = metrics_.get()) {
    on_query = [m](tcpstore::Op op, TcpStoreOutcome outcome, absl::Duration d) {
      m->ObserveTcpStoreQuery(op, outcome, d);
    };
  }
  auto tcpstore = TcpStoreServer::Start(
      store_.get(),
      {.listen = options.tcpstore_listen,
       .max_connections = options.max_connections,
       .budget = budget_.get(),
       .max_unsent_bytes_total = options.tcpstore_max_unsent_bytes_total,
       .max_queue_bytes_total = options.tcpstore_max_queue_bytes,
       .quotas = quotas_.get(),
       .spin_after_activity = options.tcpstore_spin,
       .allow = options.tcpstore_allow,
       .prefix = options.tcpstore_prefix,
       .authorize = TokenHelloCheck(auth_.get()),
       .require_token = auth_ != nullptr && options.tcpstore_require_token,
       .log = options.log,
       .on_query = std::move(on_query)});
  if (!tcpstore.ok()) return tcpstore.status();
  tcpstore_ = std::move(*tcpstore);
  // The listen address's host with the port bound (a bad address would
  // not have bound).
  absl::StatusOr<base::HostPort> listen =
      base::SplitHostPort(options.tcpstore_listen,
                          {.allow_empty_host = true, .allow_port_zero = true});
  info_service_->SetTcpStoreBound(base::JoinHostPort(
      listen.ok() ? listen->host : std::string(), tcpstore_->port()));
  return absl::OkStatus();
}

void CohortServer::TrackMetrics(const Coordination& state) {
  if (metrics_ == nullptr) return;
  metrics_->Track({.store = store_.get(),
                   .rendezvous = state.rendezvous.get(),
                   .membership = state.membership.get(),
                   .grpc_listener = listener_.get(),
                   .tcpstore = tcpstore_.get(),
                   .watches = &watch_gauges_,
                   .auth = auth_.get(),
                   .quotas = quotas_.get()});
  status_page_->Track({.store = store_.get(),
                       .auth = auth_.get(),
                       .rendezvous = state.rendezvous,
                       .membership = state.membership});
}

void CohortServer::StartElection(const ServerOptions& options) {
  if (options.election_endpoints.empty()) return;
  std::string advertise = options.advertise;
  if (advertise.empty()) advertise = options.listen;
  // Port 0 (a free one) is known only now that it is bound.
  if (absl::StatusOr<base::HostPort> where = base::SplitHostPort(
          advertise, {.allow_empty_host = true, .allow_port_zero = true});
      where.ok() && where->port == 0) {
    advertise = base::JoinHostPort(where->host, port_);
  }
  leadership_ = std::make_unique<EtcdLeadership>(EtcdLeadershipOptions{
      .endpoints = options.election_endpoints,
      .address = advertise,
      .ttl = options.election_ttl,
      .elected = [this] { Lead(); },
      .follows = [this](const std::string& leader) { Follow(leader); },
      .log = options.log});
}

void CohortServer::StartHealthChecks(absl::Duration interval) {
  absl::MutexLock lock(&health_mu_);
  // A disk that cannot hold the reserve refuses every write: NOT_SERVING
  // from the start, not from the first refused write. serving_ starts
  // opposite, so that every service gets its status.
  const absl::Status writable = store_->CheckWritable();
  serving_ = !writable.ok();
  SetServing(writable.ok(), writable);
  for (grpc::Server* s : grpc_servers()) {
    s->GetHealthCheckService()->SetServingStatus(kLivenessService, true);
  }
  health_check_ = health_timer_.Schedule(
      absl::Now() + interval, [this, interval] { CheckHealth(interval); });
}

void CohortServer::SetServing(bool serving, const absl::Status& why) {
  if (serving_ == serving) return;
  serving_ = serving;
  for (grpc::Server* s : grpc_servers()) {
    grpc::HealthCheckServiceInterface* health = s->GetHealthCheckService();
    health->SetServingStatus("", serving);
    for (const char* service :
         {v1::Store::service_full_name(), v1::Rendezvous::service_full_name(),
          v1::Membership::service_full_name(), v1::Auth::service_full_name()}) {
      health->SetServingStatus(service, serving);
    }
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
  if (auth_ != nullptr && auth_->ReloadIfChanged()) UpdateShares();
  health_check_ = health_timer_.Schedule(
      absl::Now() + interval, [this, interval] { CheckHealth(interval); });
}

void CohortServer::Lead() {
  const absl::Time start = absl::Now();
  // Every change the last leader made must be in the view first.
  if (absl::Status s = store_->Sync(); !s.ok() && log_) {
    log_(absl::StrCat("leadership: loading state without a full sync: ",
                      s.message()));
  }
  // Membership extends every member's lease by one heartbeat timeout as
  // it loads, as after a restart: heartbeats sent to the old leader in its
  // last moments are not held against anyone.
  Coordination state{.rendezvous = std::make_shared<Rendezvous>(store_.get()),
                     .membership = std::make_shared<Membership>(store_.get())};
  TrackMetrics(state);
  coordination_.Fill(std::move(state));
  if (log_) {
    log_(
        absl::StrCat("leadership: leading; rendezvous and membership "
                     "loaded from the store in ",
                     absl::FormatDuration(absl::Now() - start)));
  }
}

void CohortServer::Follow(const std::string& leader) {
  const std::string before = coordination_.leader();
  Coordination old = coordination_.Empty(leader);
  if (log_ && (old.rendezvous != nullptr || leader != before)) {
    log_(leader.empty()
             ? std::string("leadership: no leader known; campaigning")
             : absl::StrCat("leadership: following ", leader,
                            " (rendezvous and membership calls go there)"));
  }
  if (old.rendezvous == nullptr) return;
  // Pending joins and barriers end UNAVAILABLE; clients retry, and land on
  // the new leader through whichever replica they reach.
  const absl::Status moved = absl::UnavailableError(
      "this cohortd replica stopped leading; retry (the call goes to the new "
      "leader)");
  old.rendezvous->Shutdown(moved);
  old.membership->Shutdown(moved);
  TrackMetrics(Coordination());
}

void CohortServer::UpdateShares() {
  absl::Status s = SetTenantShares(auth_tokens_, *store_);
  if (!s.ok() && log_) {
    log_(
        absl::StrCat("quota: stored keys and bytes are not bounded for "
                     "some tenants: ",
                     s.message()));
  }
}

std::vector<grpc::Server*> CohortServer::grpc_servers() {
  std::vector<grpc::Server*> servers = {server_.get()};
  if (health_server_ != nullptr) servers.push_back(health_server_.get());
  return servers;
}

absl::Status CohortServer::Reload() {
  absl::Status status;
  if (auth_ != nullptr) {
    status.Update(auth_->Reload());
    UpdateShares();
  }
  if (tls_.enabled()) {
    absl::StatusOr<TlsFilesInfo> tls = CheckTlsFiles(tls_);
    if (!tls.ok()) {
      if (log_) {
        log_(absl::StrCat("tls: the files on disk are not usable (",
                          tls.status().message(),
                          "); the certificate in force stays"));
      }
      status.Update(tls.status());
    } else if (log_) {
      log_(absl::StrCat("tls: files checked: ", tls->subject, " valid until ",
                        absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", tls->not_after,
                                         absl::UTCTimeZone()),
                        "; gRPC takes them up within ",
                        absl::FormatDuration(tls_.reload_interval)));
    }
  }
  return status;
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
    for (grpc::Server* s : grpc_servers()) {
      s->GetHealthCheckService()->SetServingStatus(kLivenessService, false);
    }
  }
  if (listener_ != nullptr) listener_->Stop();
  // Resign first, so another replica takes over at once.
  leadership_.reset();
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
  Coordination state = coordination_.Empty("");
  if (state.rendezvous != nullptr) state.rendezvous->Shutdown(draining);
  if (state.membership != nullptr) state.membership->Shutdown(draining);
  store_->Shutdown(draining);
  if (tcpstore_ != nullptr) tcpstore_->Stop();
  stopper.join();
  server_->Wait();
  if (health_server_ != nullptr) {
    health_server_->Shutdown(absl::ToChronoTime(absl::Now()));
    health_server_->Wait();
  }
  // Scrapes stop here: what they read is being torn down.
  if (metrics_ != nullptr) metrics_->StopServing();
  return store_->Flush();
}

}  // namespace cohort::server
