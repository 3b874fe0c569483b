// CohortServer: cohortd's gRPC server: the Store, Rendezvous and Membership
// services (all state in one KvStore), Auth, Info, health and reflection.
// main.cc adds flags and signals; tests start it in-process.
#ifndef COHORT_SERVER_COHORT_SERVER_H_
#define COHORT_SERVER_COHORT_SERVER_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/deadline_timer.h"
#include "grpcpp/server.h"
#include "server/auth/auth.h"
#include "server/auth/quota.h"
#include "server/coordination/membership.h"
#include "server/coordination/rendezvous.h"
#include "server/ha/etcd_leadership.h"
#include "server/metrics/metrics.h"
#include "server/rpc/auth_service.h"
#include "server/rpc/coordination_service.h"
#include "server/rpc/coordination_slot.h"
#include "server/rpc/info_service.h"
#include "server/rpc/listener.h"
#include "server/rpc/reactors.h"
#include "server/rpc/store_service.h"
#include "server/rpc/tls.h"
#include "server/status/status_page.h"
#include "server/tcpstore/tcpstore_server.h"
#include "store/kv_store.h"

namespace cohort::server {

struct ServerOptions {
  // HOST:PORT to listen on; port 0 picks a free port (see port()). The port
  // is bound exclusively: Start fails if another process serves it.
  std::string listen = "0.0.0.0:29500";
  // HOST:PORT for PyTorch's TCPStore protocol (tcpstore_server.h); empty
  // serves none. cohortd's flag defaults to 0.0.0.0:29400.
  std::string tcpstore_listen;
  // HOST:PORT at which clients dial the TCPStore listener when that is not
  // where it is bound (a Kubernetes Service, a NAT in front): what
  // GetServerInfo reports (info.proto). Empty: the bound address, with a
  // wildcard host replaced (DialTcpStoreAt). Start refuses one that
  // CheckDialAddress refuses, and one without a listener.
  std::string tcpstore_advertise;
  // TcpStoreServerOptions::allow and ::prefix: the listener's access policy.
  std::vector<std::string> tcpstore_allow;
  std::string tcpstore_prefix;
  // With auth on: whether the TCPStore listener serves only connections
  // whose hello carries a token covering their namespace (cohortrun's node
  // proxy sends one). Turning it off serves anonymous torch clients, on
  // the strength of tcpstore_allow and tcpstore_prefix alone.
  bool tcpstore_require_token = true;
  // HOST:PORT (or :PORT) to serve Prometheus metrics on, at /metrics
  // (metrics.h), and the status page beside them, at / and /api/status
  // (status_page.h); port 0 picks a free one (see metrics_port()). Empty:
  // neither.
  std::string metrics_listen;
  StoreServiceOptions store_service;
  // The storage engine's name for GetServerInfo ("rocksdb", "memory",
  // "etcd"); may be empty.
  std::string engine;
  // Each tenant's share of the server (quota.h): per job token with auth
  // on, per connection with it off. The stored keys and bytes are the
  // store's (store::StoreLimits::quota_keys, quota_bytes), bounded per
  // token only: with auth off, only the store's global limits apply.
  QuotaLimits quotas;
  // TLS on the gRPC port (tls.h). With TLS gRPC binds the port itself:
  // the plaintext Listener's connection cap and descriptor-exhaustion
  // handling do not apply (gRPC can adopt only plaintext sockets).
  TlsOptions tls;
  // The tokens file (auth.h, auth.proto); empty: auth off, every call
  // allowed.
  std::string auth_tokens;
  // The longest lifetime of an issued token (AuthenticatorOptions::max_ttl).
  absl::Duration max_token_ttl = absl::Hours(24 * 30);
  // Bounds on issuing per tenant, and how often dead issued tokens' records
  // are swept (AuthenticatorOptions::issue_limits, sweep_interval).
  IssueLimits token_issue_limits;
  absl::Duration token_sweep_interval = absl::Minutes(1);
  // Replicas over one etcd cluster (--engine=etcd): the rendezvous and
  // membership state machines run on the replica elected through etcd
  // (etcd_leadership.h); the others pass those calls on to it. Empty
  // endpoints: no election, this cohortd runs them.
  std::vector<std::string> election_endpoints;
  // This replica's address as the other replicas reach it (HOST:PORT;
  // port 0 is replaced by the port bound).
  std::string advertise;
  absl::Duration election_ttl = absl::Seconds(3);
  // HOST:PORT of a plaintext port serving only grpc.health.v1 (for
  // Kubernetes' gRPC probes, which speak no TLS); empty: none.
  std::string health_listen;
  // Connections open at once on the gRPC and TCPStore listeners together;
  // more are refused (gRPC: with a GOAWAY saying so).
  size_t max_connections = 16384;
  // TCPStore replies queued for all connections together, and bytes in all
  // TCPStore queues (TcpStoreServerOptions).
  size_t tcpstore_max_unsent_bytes_total = 256 << 20;
  size_t tcpstore_max_queue_bytes = 1 << 30;
  // TcpStoreServerOptions::spin_after_activity.
  absl::Duration tcpstore_spin = absl::Microseconds(50);
  // A connection with no call in flight for this long is closed (the client
  // reconnects on its next call); 0 keeps idle connections forever.
  absl::Duration idle_timeout = absl::Minutes(30);
  // Kernel TCP keepalive (proto/rpc/tcp_keepalive.h): a connection quiet for
  // keepalive_time is probed, and dropped if the peer's host answers
  // nothing for keepalive_timeout (or leaves sent data unacknowledged for
  // both together): a dead client's blocked calls and watches are ended
  // within keepalive_time + keepalive_timeout instead of held forever. The
  // peer's kernel answers, so a client too busy to run its gRPC threads
  // (or stopped) keeps its calls; gRPC's HTTP/2 keepalive pings, which
  // need those threads, are off. 0 keepalive_time: no keepalive.
  absl::Duration keepalive_time = absl::Minutes(1);
  absl::Duration keepalive_timeout = absl::Seconds(20);
  // How often health follows the store's writability (a full disk turns it
  // NOT_SERVING, freed space back to SERVING).
  absl::Duration health_interval = absl::Seconds(1);
  // Where the server reports what it does on its own (health changes,
  // refused connections). Default: nowhere.
  std::function<void(absl::string_view)> log;
};

// A grpc.health.v1 service name that is SERVING from start to drain, whatever
// the disk: what a liveness probe should ask, so that a full disk (which
// turns "" and the cohort services NOT_SERVING) does not get cohortd
// restarted.
inline constexpr char kLivenessService[] = "liveness";

class CohortServer {
 public:
  // Starts serving `store` (and the coordination state it holds) and marks
  // the health service SERVING. Fails with
  // UNAVAILABLE naming the address if it cannot be bound.
  static absl::StatusOr<std::unique_ptr<CohortServer>> Start(
      std::unique_ptr<store::KvStore> store, const ServerOptions& options);

  // Drains if Drain was not called.
  ~CohortServer();

  // The ports actually bound (tcpstore_port, metrics_port: 0 when not
  // serving them).
  int port() const { return port_; }
  int tcpstore_port() const { return tcpstore_ ? tcpstore_->port() : 0; }
  int health_port() const { return health_port_; }
  // This process's ServerInfo.server_id.
  const std::string& server_id() const { return info_service_->server_id(); }
  // The token checker; null when auth is off.
  Authenticator* auth() { return auth_.get(); }
  // The tenants' quotas (ServerOptions::quotas); never null.
  Quotas* quotas() { return quotas_.get(); }

  // Re-reads the tokens file and checks the TLS files (SIGHUP). gRPC takes
  // up changed certificates by itself within tls.reload_interval; this
  // says whether the files on disk are good. Errors name the file; what is
  // in force stays.
  absl::Status Reload();
  int metrics_port() const { return metrics_ ? metrics_->port() : 0; }
  // Null unless options.metrics_listen was set: where other parts add
  // their metric families (Metrics::registry()).
  Metrics* metrics() { return metrics_.get(); }
  // The TCPStore listener's counters; zeros when it is off.
  TcpStoreServerStats tcpstore_stats() {
    return tcpstore_ ? tcpstore_->stats() : TcpStoreServerStats();
  }
  store::KvStore& store() { return *store_; }

  // Graceful stop: health goes NOT_SERVING, pending waits and watches end
  // with UNAVAILABLE (TCPStore connections are closed), new connections are
  // refused, calls in flight get `grace` to finish, then the store is flushed.
  // A flush refused for lack of disk space returns RESOURCE_EXHAUSTED: nothing
  // acknowledged is lost (it is in the write-ahead log, replayed at the next
  // start). Idempotent.
  absl::Status Drain(absl::Duration grace = absl::Seconds(5));

  // Whether health says SERVING (false while the disk is full or draining).
  bool serving();

 private:
  CohortServer() = default;
  // Start's steps, in its order; each returns the error that stops it.
  absl::Status StartAuth(const ServerOptions& options);  // TLS files, tokens.
  void CreateServices(const ServerOptions& options);
  // The gRPC server on its Listener (or TLS port), with metrics if asked.
  absl::Status StartGrpc(const ServerOptions& options);
  absl::Status StartMetrics(const ServerOptions& options,
                            grpc::ServerBuilder& builder);
  absl::Status StartHealthListener(const ServerOptions& options);
  absl::Status StartTcpStore(const ServerOptions& options);
  // Points metrics and the status page at the sources they read at each
  // request, `state` (empty on a follower) for rendezvous and membership.
  void TrackMetrics(const Coordination& state);
  void StartElection(const ServerOptions& options);
  // Health from the store's writability now, then every `interval`.
  void StartHealthChecks(absl::Duration interval);
  // Sets health from the store's writability, then runs again after
  // `interval` on health_timer_ until Drain.
  void CheckHealth(absl::Duration interval);
  // The main server and the health-only one, if any.
  std::vector<grpc::Server*> grpc_servers();
  void SetServing(bool serving, const absl::Status& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(health_mu_);
  // Bounds the keys and bytes stored under each tenant's prefixes, as the
  // tokens file now lists them (SetTenantShares); logs a failure.
  void UpdateShares();

  // First, so they are destroyed last: the streams, the gRPC server's
  // interceptors and the TCPStore listener report to them until the end.
  WatchGauges watch_gauges_;
  std::unique_ptr<Quotas> quotas_;
  // Before metrics_, whose HTTP server serves its routes.
  std::unique_ptr<StatusPage> status_page_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<store::KvStore> store_;
  // Builds the state machines from the store and leads.
  void Lead();
  // Another replica (`leader`, "" while unknown) leads: stops ours.
  void Follow(const std::string& leader);

  // The rendezvous and membership state machines (coordination_slot.h).
  CoordinationSlot coordination_;
  std::unique_ptr<EtcdLeadership> leadership_;
  std::unique_ptr<StoreService> service_;
  std::unique_ptr<RendezvousService> rendezvous_service_;
  std::unique_ptr<MembershipService> membership_service_;
  std::unique_ptr<Authenticator> auth_;
  std::string auth_tokens_;  // Its file.
  std::unique_ptr<AuthService> auth_service_;
  std::unique_ptr<InfoService> info_service_;
  TlsOptions tls_;
  // --max_connections, shared by the gRPC and TCPStore listeners; declared
  // before them so that it outlives them.
  std::unique_ptr<ConnectionBudget> budget_;
  std::unique_ptr<Listener> listener_;  // Null with TLS.
  std::unique_ptr<grpc::Server> health_server_;
  int health_port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<TcpStoreServer> tcpstore_;
  std::function<void(absl::string_view)> log_;
  int port_ = 0;
  bool drained_ = false;

  absl::Mutex health_mu_;
  bool serving_ ABSL_GUARDED_BY(health_mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(health_mu_) = false;
  absl::Status last_problem_ ABSL_GUARDED_BY(health_mu_);
  base::DeadlineTimer::TimerId health_check_ ABSL_GUARDED_BY(health_mu_) = 0;
  // Last, so it is destroyed first: its callback uses everything above.
  base::DeadlineTimer health_timer_;
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_COHORT_SERVER_H_
