#include "server/metrics/metrics.h"

#include <zlib.h>

#include <array>
#include <atomic>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/support/interceptor.h"
#include "prometheus/counter.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/summary.h"
#include "prometheus/text_serializer.h"
#include "server/auth/auth.h"
#include "server/auth/quota.h"
#include "server/coordination/membership.h"
#include "server/coordination/rendezvous.h"
#include "server/rpc/listener.h"
#include "server/rpc/reactors.h"
#include "store/kv_store.h"

namespace cohort::server {
namespace {

using prometheus::Counter;
using prometheus::Histogram;
using prometheus::MetricFamily;
using prometheus::MetricType;

// From 100 µs (a Set) to 5 minutes (c10d's default wait); calls and
// queries that block (Wait, Barrier, Join) and streams run long.
const Histogram::BucketBoundaries& CallBuckets() {
  static const auto* buckets = new Histogram::BucketBoundaries{
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
      0.25,   0.5,     1,      2.5,   5,      10,    30,   60,    300};
  return *buckets;
}

// An fsync: tens of µs on NVMe, tens of ms on a busy network disk.
const Histogram::BucketBoundaries& SyncBuckets() {
  static const auto* buckets = new Histogram::BucketBoundaries{
      0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
      0.025,   0.05,   0.1,     0.25,   0.5,   1,      2.5,   10};
  return *buckets;
}

constexpr size_t kNumOps = static_cast<size_t>(tcpstore::Op::kBarrier) + 1;
constexpr size_t kNumOutcomes =
    static_cast<size_t>(TcpStoreOutcome::kCancelled) + 1;

absl::string_view OutcomeName(TcpStoreOutcome outcome) {
  switch (outcome) {
    case TcpStoreOutcome::kOk:
      return "ok";
    case TcpStoreOutcome::kFailed:
      return "failed";
    case TcpStoreOutcome::kCancelled:
      return "cancelled";
  }
  return "unknown";
}

std::string CodeName(grpc::StatusCode code) {
  std::string name =
      absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
  return name.empty() ? "UNKNOWN" : name;
}

// "/pkg.Service/Method" -> {"pkg.Service", "Method"} when this binary has
// that method's descriptor; anything else (a client can send any path) is
// {"unknown", "unknown"}, so labels stay bounded.
std::pair<std::string, std::string> SplitMethod(const char* path) {
  std::pair<std::string, std::string> unknown = {"unknown", "unknown"};
  if (path == nullptr) return unknown;
  absl::string_view p(path);
  if (p.empty() || p[0] != '/') return unknown;
  p.remove_prefix(1);
  const size_t slash = p.find('/');
  if (slash == absl::string_view::npos) return unknown;
  std::string service(p.substr(0, slash));
  std::string method(p.substr(slash + 1));
  if (google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(
          absl::StrCat(service, ".", method)) == nullptr) {
    return unknown;
  }
  return {std::move(service), std::move(method)};
}

MetricFamily NewFamily(std::string name, std::string help, MetricType type) {
  MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  return f;
}

void AddValue(MetricFamily& f, double value,
              std::vector<prometheus::ClientMetric::Label> labels = {}) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  if (f.type == MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(std::move(m));
}

MetricFamily Gauge(std::string name, std::string help, double value) {
  MetricFamily f =
      NewFamily(std::move(name), std::move(help), MetricType::Gauge);
  AddValue(f, value);
  return f;
}

MetricFamily CounterOf(std::string name, std::string help, double value) {
  MetricFamily f =
      NewFamily(std::move(name), std::move(help), MetricType::Counter);
  AddValue(f, value);
  return f;
}

}  // namespace

struct Metrics::Families {
  explicit Families(prometheus::Registry& registry)
      : grpc_handled(
            prometheus::BuildCounter()
                .Name("cohort_grpc_server_handled_total")
                .Help("gRPC calls finished, by service, method and status "
                      "code (CANCELLED: the client went away)")
                .Register(registry)),
        grpc_seconds(prometheus::BuildHistogram()
                         .Name("cohort_grpc_server_handling_seconds")
                         .Help("Time from a gRPC call's start to its status "
                               "(for a stream, its lifetime)")
                         .Register(registry)),
        tcpstore_queries(
            prometheus::BuildCounter()
                .Name("cohort_tcpstore_queries_total")
                .Help("TCPStore-protocol queries, by query type and outcome "
                      "(ok; failed: refused, the connection closed; "
                      "cancelled: a blocked WAIT or BARRIER given up)")
                .Register(registry)),
        tcpstore_seconds(prometheus::BuildHistogram()
                             .Name("cohort_tcpstore_query_seconds")
                             .Help("Time from reading a TCPStore query to "
                                   "its reply (or, without one, its commit)")
                             .Register(registry)),
        wal_sync(prometheus::BuildHistogram()
                     .Name("cohort_store_wal_sync_seconds")
                     .Help("Time of each write-ahead-log sync: every write "
                           "with --sync_writes, and each flush")
                     .Register(registry)
                     .Add({}, SyncBuckets())) {
    for (auto& per_op : query_counts) {
      for (auto& counter : per_op) counter.store(nullptr);
    }
    for (auto& histogram : query_seconds) histogram.store(nullptr);
  }

  prometheus::Family<Counter>& grpc_handled;
  prometheus::Family<Histogram>& grpc_seconds;
  prometheus::Family<Counter>& tcpstore_queries;
  prometheus::Family<Histogram>& tcpstore_seconds;
  Histogram& wal_sync;
  // The TCPStore series, made on first use (Family::Add takes a lock and
  // hashes labels; the loop thread should not, per query).
  std::array<std::array<std::atomic<Counter*>, kNumOutcomes>, kNumOps>
      query_counts;
  std::array<std::atomic<Histogram*>, kNumOps> query_seconds;
};

// The state metrics, read from the sources at each scrape.
namespace {

// The state read at scrape, one source at a time (StateCollector).
void CollectTcpStore(TcpStoreServer& tcpstore, MetricFamily& connections,
                     std::vector<MetricFamily>& out) {
  const TcpStoreServerStats t = tcpstore.stats();
  AddValue(connections, t.connections, {{"protocol", "tcpstore"}});
  out.push_back(Gauge("cohort_tcpstore_blocked_requests",
                      "TCPStore WAIT and BARRIER requests blocked now",
                      t.blocked));
  MetricFamily closed = NewFamily(
      "cohort_tcpstore_connections_refused_total",
      "TCPStore connections closed by cohortd, by reason (not_allowed: "
      "peer outside --tcpstore_allow; bad_input: a malformed request; "
      "unauthenticated: no token hello, its token refused or no longer "
      "valid; slow_reader: its unread replies closed to keep "
      "--tcpstore_max_unsent_bytes_total; quota: a request over a "
      "tenant's quota or --tcpstore_max_queue_bytes; no_budget: "
      "--max_connections open)",
      MetricType::Counter);
  AddValue(closed, t.refused_not_allowed, {{"reason", "not_allowed"}});
  AddValue(closed, t.closed_bad_input, {{"reason", "bad_input"}});
  AddValue(closed, t.refused_unauthenticated, {{"reason", "unauthenticated"}});
  AddValue(closed, t.closed_slow_readers, {{"reason", "slow_reader"}});
  AddValue(closed, t.refused_quota, {{"reason", "quota"}});
  AddValue(closed, t.refused_no_budget, {{"reason", "no_budget"}});
  out.push_back(std::move(closed));
  out.push_back(Gauge("cohort_tcpstore_unsent_bytes",
                      "Bytes of TCPStore replies waiting for their "
                      "clients to read them (bounded by "
                      "--tcpstore_max_unsent_bytes_total)",
                      t.unsent_bytes));
  out.push_back(Gauge("cohort_tcpstore_queue_bytes",
                      "Bytes in TCPStore queues (QUEUE_PUSH)", t.queue_bytes));
}

void CollectStore(const store::StoreStats& st, std::vector<MetricFamily>& out) {
  out.push_back(Gauge("cohort_store_keys", "Keys in the store", st.keys));
  out.push_back(Gauge("cohort_store_revision",
                      "The store's revision (its last change)", st.revision));
  out.push_back(Gauge("cohort_store_blocked_waiters",
                      "Calls blocked until keys exist (gRPC Get, Wait, "
                      "MultiGet; TCPStore WAIT)",
                      st.waiters));
  out.push_back(Gauge("cohort_store_watches",
                      "Watches registered on the store (gRPC watch "
                      "streams, TCPStore barriers)",
                      st.watches));
  out.push_back(Gauge("cohort_store_disk_bytes",
                      "Bytes the RocksDB data dir takes on disk (0 with "
                      "--engine=memory)",
                      static_cast<double>(st.disk_bytes)));
}

// Quota refusals include the store's, of a tenant's stored keys or bytes.
void CollectQuotas(const Quotas& quotas, const store::StoreStats& store,
                   std::vector<MetricFamily>& out) {
  const QuotaStats q = quotas.stats();
  MetricFamily refused = NewFamily(
      "cohort_quota_refused_total",
      "Calls refused for taking their tenant (a job's token; with auth "
      "off, a connection) past a quota, by quota (set by the flag "
      "--quota_<quota>)",
      MetricType::Counter);
  for (int i = 0; i < kNumQuotas; ++i) {
    AddValue(refused, q.refused[i],
             {{"quota", std::string(QuotaName(static_cast<Quota>(i)))}});
  }
  AddValue(refused, store.share_refused_keys, {{"quota", "keys"}});
  AddValue(refused, store.share_refused_bytes, {{"quota", "bytes"}});
  out.push_back(std::move(refused));
  MetricFamily used = NewFamily(
      "cohort_quota_used",
      "What every tenant holds now, together, by quota (bytes for "
      "queue_bytes; streams, waits, keys or connections for the others)",
      MetricType::Gauge);
  for (int i = 0; i < kNumQuotas; ++i) {
    AddValue(used, q.used[i],
             {{"quota", std::string(QuotaName(static_cast<Quota>(i)))}});
  }
  out.push_back(std::move(used));
  out.push_back(Gauge("cohort_quota_tenants",
                      "Tenants holding part of a quota now (open "
                      "streams, parked waits, queued bytes, connections)",
                      q.owners));
}

void CollectWatches(const WatchGauges& watches,
                    std::vector<MetricFamily>& out) {
  out.push_back(Gauge("cohort_watchers",
                      "gRPC watch streams open (Store.Watch, "
                      "Membership.WatchMembers)",
                      watches.streams.load()));
  out.push_back(Gauge("cohort_watch_buffered_bytes",
                      "Bytes of watch events queued for watchers, not "
                      "yet sent",
                      watches.buffered_bytes.load()));
}

void CollectRendezvous(Rendezvous& rendezvous, std::vector<MetricFamily>& out) {
  const RendezvousStats r = rendezvous.stats();
  out.push_back(CounterOf("cohort_rendezvous_rounds_total",
                          "Rendezvous rounds completed, over all runs",
                          r.rounds_completed));
  out.push_back(Gauge("cohort_rendezvous_waiting_nodes",
                      "Nodes waiting for their run's next round, over "
                      "all runs",
                      r.waiting_nodes));
  out.push_back(
      Gauge("cohort_rendezvous_runs", "Rendezvous runs known", r.runs));
}

void CollectMembership(Membership& membership, std::vector<MetricFamily>& out) {
  const MembershipStats m = membership.stats();
  out.push_back(Gauge("cohort_members_alive", "Live members, over all groups",
                      m.members_alive));
  out.push_back(CounterOf("cohort_members_failed_total",
                          "Members declared failed (missed heartbeats, "
                          "or replaced by a restart)",
                          m.members_failed));
  out.push_back(CounterOf("cohort_barrier_waits_total",
                          "Arrivals at membership barriers",
                          m.barrier_arrivals));
  out.push_back(CounterOf("cohort_barrier_timeouts_total",
                          "Membership barriers that timed out",
                          m.barrier_timeouts));
  out.push_back(Gauge("cohort_barrier_waiting",
                      "Arrivals waiting at membership barriers now",
                      m.barrier_waiting));
}

void CollectAuth(const Authenticator& auth, std::vector<MetricFamily>& out) {
  const AuthStats a = auth.stats();
  MetricFamily failures = NewFamily(
      "cohort_auth_failures_total",
      "Calls refused by auth, by reason (missing_token, malformed_token, "
      "unknown_token: not known or revoked, expired_token, "
      "permission_denied: a name or write beyond the token)",
      MetricType::Counter);
  AddValue(failures, a.missing_token, {{"reason", "missing_token"}});
  AddValue(failures, a.malformed_token, {{"reason", "malformed_token"}});
  AddValue(failures, a.unknown_token, {{"reason", "unknown_token"}});
  AddValue(failures, a.expired_token, {{"reason", "expired_token"}});
  AddValue(failures, a.permission_denied, {{"reason", "permission_denied"}});
  out.push_back(std::move(failures));
  out.push_back(CounterOf("cohort_auth_authenticated_total",
                          "Tokens accepted (one per call checked)",
                          a.authenticated));
  MetricFamily reloads = NewFamily(
      "cohort_auth_token_file_loads_total",
      "Loads of the --auth_tokens file, by outcome (a failed load keeps "
      "the tokens in force)",
      MetricType::Counter);
  AddValue(reloads, a.reloads, {{"outcome", "ok"}});
  AddValue(reloads, a.reload_failures, {{"outcome", "failed"}});
  out.push_back(std::move(reloads));
  out.push_back(Gauge("cohort_auth_issued_tokens",
                      "Issued tokens alive (as of the last sweep, "
                      "plus those issued and less those revoked since)",
                      a.issued_tokens));
  out.push_back(CounterOf("cohort_auth_tokens_swept_total",
                          "Records of expired or orphaned issued tokens "
                          "deleted by the sweep (--token_sweep_interval)",
                          a.swept_tokens));
  MetricFamily refused =
      NewFamily("cohort_auth_issue_refused_total",
                "IssueToken calls refused by a bound, by limit (rate: "
                "--token_issue_rate/--token_issue_burst, max_issued: "
                "--max_issued_tokens)",
                MetricType::Counter);
  AddValue(refused, a.issue_rate_limited, {{"limit", "rate"}});
  AddValue(refused, a.issue_over_max, {{"limit", "max_issued"}});
  out.push_back(std::move(refused));
  out.push_back(CounterOf("cohort_auth_calls_ended_total",
                          "Calls in flight (watches, parked waits) ended "
                          "because their token was revoked, removed or "
                          "expired",
                          a.calls_ended));
}

}  // namespace

class Metrics::StateCollector final : public prometheus::Collectable {
 public:
  void Set(const MetricsSources& sources) {
    absl::MutexLock lock(&mu_);
    sources_ = sources;
  }

  std::vector<MetricFamily> Collect() const override {
    absl::MutexLock lock(&mu_);
    std::vector<MetricFamily> out;
    const MetricsSources& s = sources_;
    MetricFamily connections = NewFamily(
        "cohort_connections", "Client connections open now, by protocol",
        MetricType::Gauge);
    if (s.grpc_listener != nullptr) {
      AddValue(connections, s.grpc_listener->open_connections(),
               {{"protocol", "grpc"}});
    }
    if (s.tcpstore != nullptr) CollectTcpStore(*s.tcpstore, connections, out);
    if (!connections.metric.empty()) out.push_back(std::move(connections));
    const store::StoreStats store =
        s.store != nullptr ? s.store->stats() : store::StoreStats();
    if (s.store != nullptr) CollectStore(store, out);
    if (s.quotas != nullptr) CollectQuotas(*s.quotas, store, out);
    if (s.watches != nullptr) CollectWatches(*s.watches, out);
    if (s.rendezvous != nullptr) CollectRendezvous(*s.rendezvous, out);
    if (s.membership != nullptr) CollectMembership(*s.membership, out);
    if (s.auth != nullptr) CollectAuth(*s.auth, out);
    return out;
  }

 private:
  mutable absl::Mutex mu_;
  MetricsSources sources_ ABSL_GUARDED_BY(mu_);
};

namespace {

// Counts one gRPC call when its status goes out, or as CANCELLED when it
// ends without one. gRPC makes one per call and destroys it with the call.
class CallRecorder final : public grpc::experimental::Interceptor {
 public:
  CallRecorder(prometheus::Family<Counter>* handled,
               prometheus::Family<Histogram>* seconds, const char* path)
      : handled_(handled), seconds_(seconds), start_(absl::Now()) {
    std::tie(service_, method_) = SplitMethod(path);
  }

  ~CallRecorder() override { Record(grpc::StatusCode::CANCELLED); }

  void Intercept(grpc::experimental::InterceptorBatchMethods* batch) override {
    if (batch->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      Record(batch->GetSendStatus().error_code());
    }
    batch->Proceed();
  }

 private:
  void Record(grpc::StatusCode code) {
    if (recorded_.exchange(true)) return;
    handled_
        ->Add({{"service", service_},
               {"method", method_},
               {"code", CodeName(code)}})
        .Increment();
    seconds_->Add({{"service", service_}, {"method", method_}}, CallBuckets())
        .Observe(absl::ToDoubleSeconds(absl::Now() - start_));
  }

  prometheus::Family<Counter>* const handled_;
  prometheus::Family<Histogram>* const seconds_;
  const absl::Time start_;
  std::string service_;
  std::string method_;
  std::atomic<bool> recorded_{false};
};

}  // namespace

class Metrics::GrpcInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit GrpcInterceptorFactory(Families* families) : families_(families) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new CallRecorder(&families_->grpc_handled, &families_->grpc_seconds,
                            info->method());
  }

 private:
  Families* const families_;
};

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      families_(std::make_unique<Families>(*registry_)),
      state_(std::make_shared<StateCollector>()),
      scrape_registry_(std::make_shared<prometheus::Registry>()) {
  // The names and help prometheus-cpp's exposer gave them.
  scrape_bytes_ = &prometheus::BuildCounter()
                       .Name("exposer_transferred_bytes_total")
                       .Help("Transferred bytes to metrics services")
                       .Register(*scrape_registry_)
                       .Add({});
  scrapes_ = &prometheus::BuildCounter()
                  .Name("exposer_scrapes_total")
                  .Help("Number of times metrics were scraped")
                  .Register(*scrape_registry_)
                  .Add({});
  scrape_latency_ =
      &prometheus::BuildSummary()
           .Name("exposer_request_latencies")
           .Help("Latencies of serving scrape requests, in microseconds")
           .Register(*scrape_registry_)
           .Add({}, prometheus::Summary::Quantiles{
                        {0.5, 0.05}, {0.9, 0.01}, {0.99, 0.001}});
}

Metrics::~Metrics() { StopServing(); }

absl::Status Metrics::Serve(const std::string& address,
                            std::vector<HttpRoute> more_routes) {
  HttpServerOptions options;
  options.routes.push_back(
      {"/metrics", [this](const HttpRequest& r) { return ServeScrape(r); }});
  for (HttpRoute& route : more_routes) {
    options.routes.push_back(std::move(route));
  }
  absl::StatusOr<std::unique_ptr<HttpServer>> http =
      HttpServer::Start(address, std::move(options));
  if (!http.ok()) return http.status();
  http_ = std::move(*http);
  port_ = http_->port();
  return absl::OkStatus();
}

void Metrics::StopServing() {
  if (http_ != nullptr) http_->Stop();
}

void Metrics::Track(const MetricsSources& sources) { state_->Set(sources); }

void Metrics::Untrack() { state_->Set(MetricsSources()); }

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
Metrics::NewGrpcInterceptorFactory() {
  return std::make_unique<GrpcInterceptorFactory>(families_.get());
}

void Metrics::ObserveTcpStoreQuery(tcpstore::Op op, TcpStoreOutcome outcome,
                                   absl::Duration latency) {
  const size_t o = static_cast<size_t>(op);
  const size_t r = static_cast<size_t>(outcome);
  if (o >= kNumOps || r >= kNumOutcomes) return;
  std::atomic<Counter*>& count = families_->query_counts[o][r];
  Counter* counter = count.load(std::memory_order_acquire);
  if (counter == nullptr) {
    // Add returns the same series to every thread that races here.
    counter = &families_->tcpstore_queries.Add(
        {{"query", std::string(tcpstore::OpName(op))},
         {"outcome", std::string(OutcomeName(outcome))}});
    count.store(counter, std::memory_order_release);
  }
  counter->Increment();
  std::atomic<Histogram*>& seconds = families_->query_seconds[o];
  Histogram* histogram = seconds.load(std::memory_order_acquire);
  if (histogram == nullptr) {
    histogram = &families_->tcpstore_seconds.Add(
        {{"query", std::string(tcpstore::OpName(op))}}, CallBuckets());
    seconds.store(histogram, std::memory_order_release);
  }
  histogram->Observe(absl::ToDoubleSeconds(latency));
}

void Metrics::ObserveWalSync(absl::Duration latency) {
  families_->wal_sync.Observe(absl::ToDoubleSeconds(latency));
}

std::string Metrics::Scrape() const {
  std::vector<MetricFamily> families = registry_->Collect();
  for (MetricFamily& f : state_->Collect()) families.push_back(std::move(f));
  return prometheus::TextSerializer().Serialize(families);
}

namespace {

// `text` as a gzip stream, or "" if zlib fails.
std::string Gzip(const std::string& text) {
  z_stream zs = {};
  // 15 + 16: the largest window, with a gzip header and trailer.
  if (deflateInit2(&zs, Z_DEFAULT_COMPRESSION, Z_DEFLATED, 15 + 16, 8,
                   Z_DEFAULT_STRATEGY) != Z_OK) {
    return "";
  }
  std::string out(deflateBound(&zs, text.size()), '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(text.data()));
  zs.avail_in = static_cast<uInt>(text.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  const int result = deflate(&zs, Z_FINISH);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return result == Z_STREAM_END ? out : "";
}

}  // namespace

// As prometheus-cpp's exposer served it: its own three families first,
// then the text, gzipped when the scraper accepts it.
HttpResponse Metrics::ServeScrape(const HttpRequest& request) {
  const absl::Time start = absl::Now();
  std::vector<MetricFamily> families = scrape_registry_->Collect();
  for (MetricFamily& f : registry_->Collect()) families.push_back(std::move(f));
  for (MetricFamily& f : state_->Collect()) families.push_back(std::move(f));
  HttpResponse response;
  response.body = prometheus::TextSerializer().Serialize(families);
  if (absl::StrContains(request.Header("Accept-Encoding"), "gzip")) {
    std::string compressed = Gzip(response.body);
    if (!compressed.empty()) {
      response.headers.emplace_back("Content-Encoding", "gzip");
      response.body = std::move(compressed);
    }
  }
  scrape_latency_->Observe(
      static_cast<double>(absl::ToInt64Microseconds(absl::Now() - start)));
  scrape_bytes_->Increment(static_cast<double>(response.body.size()));
  scrapes_->Increment();
  return response;
}

}  // namespace cohort::server
