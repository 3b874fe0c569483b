// Metrics: cohortd's Prometheus metrics (prometheus-cpp), served as text at
// http://HOST:PORT/metrics when cohortd runs with --metrics_listen (on an
// HttpServer, which serves the status page beside it).
//
// Two kinds, both under the `cohort_` prefix:
//  - events, counted where they happen: gRPC calls (an interceptor, see
//    NewGrpcInterceptorFactory), TCPStore queries (ObserveTcpStoreQuery,
//    fed by TcpStoreServerOptions::on_query) and write-ahead-log syncs
//    (ObserveWalSync, fed by KvStore::SetSyncObserver). They live in
//    registry(), where other parts of cohortd add their own families.
//  - state, read at each scrape from the objects given to Track (keys,
//    revision, connections, waiters, watches, rendezvous, membership), so
//    nothing is counted twice and nothing drifts.
//
// Labels take only bounded values (methods, status codes, query types,
// outcomes): never keys, run ids, group names or peer addresses.
// docs/operating.md ("Metrics") lists every family.
#ifndef COHORT_SERVER_METRICS_METRICS_H_
#define COHORT_SERVER_METRICS_METRICS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/support/server_interceptor.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"
#include "prometheus/summary.h"
#include "proto/tcpstore/wire.h"
#include "server/http/http_server.h"
#include "server/tcpstore/tcpstore_server.h"

namespace cohort::store {
class KvStore;
}

namespace cohort::server {

class Authenticator;
class Listener;
class Membership;
class Quotas;
class Rendezvous;
class TcpStoreServer;
struct WatchGauges;

// What the state metrics are read from at each scrape. A null pointer
// leaves its metrics out (no TCPStore listener: no TCPStore gauges).
struct MetricsSources {
  store::KvStore* store = nullptr;
  Rendezvous* rendezvous = nullptr;
  Membership* membership = nullptr;
  Listener* grpc_listener = nullptr;
  TcpStoreServer* tcpstore = nullptr;
  const WatchGauges* watches = nullptr;
  Authenticator* auth = nullptr;
  const Quotas* quotas = nullptr;
};

class Metrics {
 public:
  // Metrics not yet served (Scrape() still reads them).
  Metrics();
  // Stops serving.
  ~Metrics();

  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Serves /metrics over HTTP on `address`, and `more_routes` beside it:
  // "HOST:PORT" with HOST an IPv4 address, "[IPv6]:PORT", "localhost:PORT",
  // or ":PORT" for every IPv4 interface; port 0 picks a free one (see
  // port()). INVALID_ARGUMENT naming the address if it does not parse;
  // UNAVAILABLE naming it if it cannot be bound (in use, not local). Call
  // once.
  //
  // /metrics answers as prometheus-cpp's exposer did: the text format,
  // gzipped for a scraper that accepts gzip, after the exposer's own
  // families (exposer_scrapes_total, exposer_transferred_bytes_total,
  // exposer_request_latencies).
  absl::Status Serve(const std::string& address,
                     std::vector<HttpRoute> more_routes = {});

  // The port served on (0 before Serve).
  int port() const { return port_; }

  // Stops the HTTP server, waiting for a request in progress. Idempotent.
  void StopServing();

  // Where event families are kept: add yours with prometheus::BuildCounter()
  // ... .Register(metrics.registry()). Names start with "cohort_".
  prometheus::Registry& registry() { return *registry_; }

  // Reads `sources` at every scrape from now on; each must outlive
  // Untrack() (or this object). Replaces earlier sources.
  void Track(const MetricsSources& sources);
  // Stops reading the sources; waits for a scrape that is reading them.
  void Untrack();

  // For grpc::ServerBuilder::experimental().SetInterceptorCreators: counts
  // every call once, when it ends, by method and status code (a call that
  // ends without a status, its client gone, counts as CANCELLED), and
  // observes its duration (for a stream, its lifetime). This object must
  // outlive the gRPC server.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
  NewGrpcInterceptorFactory();

  // One TCPStore query ended (TcpStoreServerOptions::on_query). Thread-safe
  // and cheap: no lock after a query type's first time.
  void ObserveTcpStoreQuery(tcpstore::Op op, TcpStoreOutcome outcome,
                            absl::Duration latency);

  // One write-ahead-log sync took `latency` (KvStore::SetSyncObserver).
  void ObserveWalSync(absl::Duration latency);

  // Every metric in Prometheus' text format, as /metrics serves it less
  // the exposer_* families of the scrapes themselves.
  std::string Scrape() const;

 private:
  class StateCollector;
  class GrpcInterceptorFactory;
  struct Families;

  // GET /metrics.
  HttpResponse ServeScrape(const HttpRequest& request);

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<Families> families_;
  std::shared_ptr<StateCollector> state_;
  // The scrapes themselves, served before the rest (as the exposer did).
  std::shared_ptr<prometheus::Registry> scrape_registry_;
  prometheus::Counter* scrape_bytes_ = nullptr;
  prometheus::Counter* scrapes_ = nullptr;
  prometheus::Summary* scrape_latency_ = nullptr;
  std::unique_ptr<HttpServer> http_;
  int port_ = 0;
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_METRICS_METRICS_H_
