// Metrics against an in-process cohortd with real traffic: gRPC calls
// through the interceptor, TCPStore queries on a raw socket, the state read
// at scrape time, and /metrics over HTTP.
#include "server/metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "cohort/v1/coordination.grpc.pb.h"
#include "cohort/v1/store.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "prometheus/counter.h"
#include "proto/tcpstore/wire.h"
#include "server/cohort_server.h"
#include "store/kv_engine.h"
#include "store/kv_store.h"
#include "tests/testing/http_exchange.h"

namespace cohort::server {
namespace {

using Labels = std::map<std::string, std::string>;
using ::cohort::testing::HttpGet;

// The value of the sample `name` whose labels include `labels`, from a
// text exposition; nullopt if there is none.
std::optional<double> Sample(const std::string& text, const std::string& name,
                             const Labels& labels = {}) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == absl::string_view::npos) continue;
    absl::string_view series = line.substr(0, space);
    const size_t brace = series.find('{');
    if (series.substr(0, brace) != name) continue;
    Labels have;
    if (brace != absl::string_view::npos) {
      absl::string_view body = series.substr(brace + 1);
      absl::ConsumeSuffix(&body, "}");
      for (absl::string_view pair : absl::StrSplit(body, ',')) {
        std::pair<std::string, std::string> kv = absl::StrSplit(pair, '=');
        have[kv.first] = std::string(
            absl::StripSuffix(absl::StripPrefix(kv.second, "\""), "\""));
      }
    }
    bool match = true;
    for (const auto& [k, v] : labels) {
      auto it = have.find(k);
      if (it == have.end() || it->second != v) match = false;
    }
    double value = 0;
    if (match && absl::SimpleAtod(line.substr(space + 1), &value)) {
      return value;
    }
  }
  return std::nullopt;
}

double Value(const std::string& text, const std::string& name,
             const Labels& labels = {}) {
  return Sample(text, name, labels).value_or(0);
}

Labels StoreCall(const std::string& method, const std::string& code) {
  return {{"service", "cohort.v1.Store"}, {"method", method}, {"code", code}};
}

// Waits until `done` holds of a fresh scrape; true if it did in time.
bool Eventually(Metrics* metrics,
                const std::function<bool(const std::string&)>& done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    if (done(metrics->Scrape())) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return false;
}

class MetricsServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions options;
    options.listen = "127.0.0.1:0";
    options.tcpstore_listen = "127.0.0.1:0";
    options.metrics_listen = "127.0.0.1:0";
    auto server = CohortServer::Start(
        std::make_unique<store::KvStore>(store::NewMemoryEngine()), options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_NE(server_->metrics(), nullptr);
    ASSERT_GT(server_->metrics_port(), 0);
    channel_ =
        grpc::CreateChannel("127.0.0.1:" + std::to_string(server_->port()),
                            grpc::InsecureChannelCredentials());
    stub_ = v1::Store::NewStub(channel_);
  }

  Metrics* metrics() { return server_->metrics(); }

  grpc::Status Set(const std::string& key, const std::string& value) {
    grpc::ClientContext ctx;
    v1::SetRequest req;
    req.set_key(key);
    req.set_value(value);
    v1::SetResponse resp;
    return stub_->Set(&ctx, req, &resp);
  }

  std::unique_ptr<CohortServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Store::Stub> stub_;
};

TEST_F(MetricsServerTest, SetCountsUnderItsMethodAndCode) {
  const std::string before = metrics()->Scrape();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(Set("k" + std::to_string(i), "v").ok());
  }
  const std::string after = metrics()->Scrape();
  const Labels method = {{"service", "cohort.v1.Store"}, {"method", "Set"}};
  EXPECT_EQ(
      Value(after, "cohort_grpc_server_handled_total", StoreCall("Set", "OK")) -
          Value(before, "cohort_grpc_server_handled_total",
                StoreCall("Set", "OK")),
      3);
  EXPECT_EQ(Value(after, "cohort_grpc_server_handling_seconds_count", method),
            3);
  EXPECT_EQ(Value(after, "cohort_grpc_server_handling_seconds_bucket",
                  {{"method", "Set"}, {"le", "+Inf"}}),
            3);
  EXPECT_EQ(Value(after, "cohort_store_keys"), 3);
  EXPECT_EQ(Value(after, "cohort_store_revision"), 3);
  EXPECT_EQ(Value(after, "cohort_connections", {{"protocol", "grpc"}}), 1);
}

TEST_F(MetricsServerTest, FailedCallCountsUnderItsCode) {
  grpc::ClientContext ctx;
  v1::GetRequest req;
  req.set_key("k");
  req.set_timeout_ms(-1);
  v1::GetResponse resp;
  ASSERT_EQ(stub_->Get(&ctx, req, &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_EQ(Set("/cohort/mine", "v").error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  const std::string text = metrics()->Scrape();
  EXPECT_EQ(Value(text, "cohort_grpc_server_handled_total",
                  StoreCall("Get", "INVALID_ARGUMENT")),
            1);
  EXPECT_EQ(Value(text, "cohort_grpc_server_handled_total",
                  StoreCall("Set", "PERMISSION_DENIED")),
            1);
  EXPECT_FALSE(
      Sample(text, "cohort_grpc_server_handled_total", StoreCall("Set", "OK"))
          .has_value());
}

TEST_F(MetricsServerTest, BlockedWaitRaisesThenLowersWaiters) {
  grpc::Status wait_status;
  std::thread waiter([&] {
    grpc::ClientContext ctx;
    v1::WaitRequest req;
    req.add_keys("late");
    req.set_timeout_ms(30000);
    v1::WaitResponse resp;
    wait_status = stub_->Wait(&ctx, req, &resp);
  });
  EXPECT_TRUE(Eventually(metrics(), [](const std::string& t) {
    return Value(t, "cohort_store_blocked_waiters") == 1;
  }));
  // The call is blocked now and cannot end before the Set below. Holding
  // the Set back 10 ms makes the call last at least that long on any
  // machine, so its duration's bucket follows from this order of events
  // (a sleep never ends early), not from how fast the machine is.
  absl::SleepFor(absl::Milliseconds(10));
  ASSERT_TRUE(Set("late", "v").ok());
  waiter.join();
  EXPECT_TRUE(wait_status.ok()) << wait_status.error_message();
  const std::string text = metrics()->Scrape();
  EXPECT_EQ(Value(text, "cohort_store_blocked_waiters"), 0);
  EXPECT_EQ(
      Value(text, "cohort_grpc_server_handled_total", StoreCall("Wait", "OK")),
      1);
  // A blocked call is timed from its start to its status: at least the
  // 10 ms it was held blocked, so the 0.005 s bucket (and every one below
  // it) holds nothing.
  EXPECT_EQ(Value(text, "cohort_grpc_server_handling_seconds_count",
                  {{"method", "Wait"}}),
            1);
  EXPECT_EQ(Value(text, "cohort_grpc_server_handling_seconds_bucket",
                  {{"method", "Wait"}, {"le", "0.005"}}),
            0);
}

TEST_F(MetricsServerTest, WatchCountsWatcherAndEndsOnce) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  v1::WatchRequest req;
  req.set_prefix("w/");
  auto stream = stub_->Watch(ctx.get(), req);
  v1::WatchResponse first;
  ASSERT_TRUE(stream->Read(&first));
  std::string text = metrics()->Scrape();
  EXPECT_EQ(Value(text, "cohort_watchers"), 1);
  EXPECT_EQ(Value(text, "cohort_store_watches"), 1);
  ASSERT_TRUE(Set("w/a", "v").ok());
  v1::WatchResponse events;
  ASSERT_TRUE(stream->Read(&events));
  ctx->TryCancel();
  while (stream->Read(&events)) {
  }
  stream->Finish().IgnoreError();
  EXPECT_TRUE(Eventually(metrics(), [](const std::string& t) {
    return Value(t, "cohort_watchers") == 0 &&
           Value(t, "cohort_grpc_server_handling_seconds_count",
                 {{"method", "Watch"}}) == 1;
  }));
  text = metrics()->Scrape();
  EXPECT_EQ(Value(text, "cohort_watch_buffered_bytes"), 0);
  EXPECT_EQ(Value(text, "cohort_grpc_server_handled_total",
                  StoreCall("Watch", "CANCELLED")),
            1);
}

TEST_F(MetricsServerTest, MembershipAndRendezvousState) {
  auto membership = v1::Membership::NewStub(channel_);
  grpc::ClientContext join_ctx;
  v1::JoinGroupRequest join;
  join.set_group("g");
  join.set_name("a");
  join.set_heartbeat_interval_ms(50);
  join.set_missed_heartbeats(2);
  v1::JoinGroupResponse joined;
  ASSERT_TRUE(membership->JoinGroup(&join_ctx, join, &joined).ok());
  EXPECT_EQ(Value(metrics()->Scrape(), "cohort_members_alive"), 1);
  // No heartbeats: the member fails.
  EXPECT_TRUE(Eventually(metrics(), [](const std::string& t) {
    return Value(t, "cohort_members_alive") == 0 &&
           Value(t, "cohort_members_failed_total") == 1;
  }));

  auto rendezvous = v1::Rendezvous::NewStub(channel_);
  grpc::ClientContext rdzv_ctx;
  v1::JoinRequest rdzv;
  rdzv.set_run_id("job");
  rdzv.set_node_id("n0");
  rdzv.set_local_world_size(1);
  rdzv.set_min_nodes(1);
  rdzv.set_max_nodes(1);
  v1::JoinResponse round;
  grpc::Status s = rendezvous->Join(&rdzv_ctx, rdzv, &round);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const std::string text = metrics()->Scrape();
  EXPECT_EQ(Value(text, "cohort_rendezvous_rounds_total"), 1);
  EXPECT_EQ(Value(text, "cohort_rendezvous_waiting_nodes"), 0);
  EXPECT_EQ(Value(text, "cohort_rendezvous_runs"), 1);
}

// A raw TCPStore client, speaking PyTorch 1.13's dialect.
class TcpStoreSocket {
 public:
  explicit TcpStoreSocket(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<struct sockaddr*>(&addr),
                         sizeof(addr)) == 0;
  }
  ~TcpStoreSocket() { Close(); }
  bool connected() const { return connected_; }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  void Send(const tcpstore::Request& r) {
    std::string out;
    tcpstore::EncodeRequest(tcpstore::Dialect::kTorch113, r, &out);
    (void)!write(fd_, out.data(), out.size());
  }
  // n reply bytes (or fewer if the connection ends).
  std::string Read(size_t n) {
    std::string got;
    char buf[256];
    while (got.size() < n) {
      struct pollfd p = {fd_, POLLIN, 0};
      if (poll(&p, 1, 5000) <= 0) break;
      ssize_t r = read(fd_, buf, std::min(sizeof(buf), n - got.size()));
      if (r <= 0) break;
      got.append(buf, r);
    }
    return got;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

TEST_F(MetricsServerTest, TcpStoreQueriesByTypeAndOutcome) {
  TcpStoreSocket conn(server_->tcpstore_port());
  ASSERT_TRUE(conn.connected());
  conn.Send({.op = tcpstore::Op::kSet, .key = "t", .value = "v"});
  conn.Send({.op = tcpstore::Op::kAdd, .key = "n", .number = 2});
  EXPECT_EQ(conn.Read(8).size(), 8u);
  EXPECT_TRUE(Eventually(metrics(), [](const std::string& t) {
    return Value(t, "cohort_tcpstore_queries_total",
                 {{"query", "SET"}, {"outcome", "ok"}}) == 1 &&
           Value(t, "cohort_tcpstore_queries_total",
                 {{"query", "ADD"}, {"outcome", "ok"}}) == 1 &&
           Value(t, "cohort_connections", {{"protocol", "tcpstore"}}) == 1 &&
           Value(t, "cohort_tcpstore_unsent_bytes") == 0 &&
           Value(t, "cohort_tcpstore_queue_bytes") == 0;
  }));

  // A WAIT that blocks, then is given up by its client.
  TcpStoreSocket waiter(server_->tcpstore_port());
  ASSERT_TRUE(waiter.connected());
  waiter.Send({.op = tcpstore::Op::kWait, .keys = {"never"}});
  EXPECT_TRUE(Eventually(metrics(), [](const std::string& t) {
    return Value(t, "cohort_tcpstore_blocked_requests") == 1 &&
           Value(t, "cohort_store_blocked_waiters") == 1;
  }));
  waiter.Close();
  EXPECT_TRUE(Eventually(metrics(), [](const std::string& t) {
    return Value(t, "cohort_tcpstore_queries_total",
                 {{"query", "WAIT"}, {"outcome", "cancelled"}}) == 1 &&
           Value(t, "cohort_tcpstore_blocked_requests") == 0 &&
           Value(t, "cohort_store_blocked_waiters") == 0 &&
           Value(t, "cohort_connections", {{"protocol", "tcpstore"}}) == 1;
  }));
  const std::string text = metrics()->Scrape();
  EXPECT_EQ(
      Value(text, "cohort_tcpstore_query_seconds_count", {{"query", "WAIT"}}),
      1);
  // A write to the reserved namespace is refused: the connection closes.
  conn.Send({.op = tcpstore::Op::kSet, .key = "/cohort/x", .value = "v"});
  EXPECT_TRUE(Eventually(metrics(), [](const std::string& t) {
    return Value(t, "cohort_tcpstore_queries_total",
                 {{"query", "SET"}, {"outcome", "failed"}}) == 1;
  }));
}

TEST_F(MetricsServerTest, ServedOverHttp) {
  ASSERT_TRUE(Set("k", "v").ok());
  const std::string response = HttpGet(server_->metrics_port(), "/metrics");
  EXPECT_NE(response.find("200 OK"), std::string::npos) << response;
  const size_t body = response.find("\r\n\r\n");
  ASSERT_NE(body, std::string::npos);
  const std::string text = response.substr(body + 4);
  EXPECT_EQ(
      Value(text, "cohort_grpc_server_handled_total", StoreCall("Set", "OK")),
      1);
  EXPECT_EQ(Value(text, "cohort_store_keys"), 1);
  EXPECT_NE(text.find("# TYPE cohort_store_wal_sync_seconds histogram"),
            std::string::npos);
}

// As prometheus-cpp's exposer served it: its own families first, and the
// text gzipped for a scraper that accepts gzip.
TEST_F(MetricsServerTest, ServesTheExposersFamiliesAndGzip) {
  std::string response = HttpGet(server_->metrics_port(), "/metrics");
  const std::string text = response.substr(response.find("\r\n\r\n") + 4);
  EXPECT_EQ(text.rfind("# HELP exposer_transferred_bytes_total", 0), 0u)
      << text.substr(0, 200);
  EXPECT_EQ(Value(text, "exposer_scrapes_total"), 0);
  response =
      HttpGet(server_->metrics_port(), "/metrics", "Accept-Encoding: gzip\r\n");
  EXPECT_NE(response.find("Content-Encoding: gzip\r\n"), std::string::npos)
      << response.substr(0, 200);
  const std::string body = response.substr(response.find("\r\n\r\n") + 4);
  ASSERT_GE(body.size(), 2u);
  EXPECT_EQ(body.substr(0, 2), "\x1f\x8b");  // gzip's magic.
  const std::string third = HttpGet(server_->metrics_port(), "/metrics");
  EXPECT_EQ(
      Value(third.substr(third.find("\r\n\r\n") + 4), "exposer_scrapes_total"),
      2);
}

// The status page shares the port: its page and API, and errors for the
// rest.
TEST_F(MetricsServerTest, ServesTheStatusPageBeside) {
  ASSERT_TRUE(Set("k", "v").ok());
  std::string response = HttpGet(server_->metrics_port(), "/");
  EXPECT_NE(response.find("200 OK"), std::string::npos);
  EXPECT_NE(response.find("Content-Type: text/html"), std::string::npos);
  response = HttpGet(server_->metrics_port(), "/api/status");
  EXPECT_NE(response.find("200 OK"), std::string::npos) << response;
  EXPECT_NE(response.find("\"revision\":1,"), std::string::npos) << response;
  response = HttpGet(server_->metrics_port(), "/api/status?run=nope");
  EXPECT_NE(response.find("404 Not Found"), std::string::npos) << response;
  response = HttpGet(server_->metrics_port(), "/nope");
  EXPECT_NE(response.find("404 Not Found"), std::string::npos) << response;
  EXPECT_NE(response.find("it serves /metrics, /, /status.js"),
            std::string::npos)
      << response;
}

TEST(MetricsTest, BusyOrBadAddressFailsNamingIt) {
  Metrics first;
  ASSERT_TRUE(first.Serve("127.0.0.1:0").ok());
  const std::string taken = "127.0.0.1:" + std::to_string(first.port());
  Metrics second;
  absl::Status busy = second.Serve(taken);
  EXPECT_EQ(busy.code(), absl::StatusCode::kUnavailable) << busy;
  EXPECT_NE(busy.message().find(taken), absl::string_view::npos) << busy;
  for (const std::string bad :
       {"nonsense", "127.0.0.1:99999", "example.com:9464", "1.2.3.4:80,81"}) {
    Metrics m;
    absl::Status s = m.Serve(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad << ": " << s;
    EXPECT_NE(s.message().find(bad), absl::string_view::npos) << s;
  }
}

TEST(MetricsTest, StartFailsWhenTheMetricsPortIsBusy) {
  Metrics holder;
  ASSERT_TRUE(holder.Serve("127.0.0.1:0").ok());
  ServerOptions options;
  options.listen = "127.0.0.1:0";
  options.metrics_listen = "127.0.0.1:" + std::to_string(holder.port());
  auto server = CohortServer::Start(
      std::make_unique<store::KvStore>(store::NewMemoryEngine()), options);
  ASSERT_FALSE(server.ok());
  EXPECT_NE(server.status().message().find(options.metrics_listen),
            absl::string_view::npos)
      << server.status();
}

TEST(MetricsTest, RegistryTakesOtherFamilies) {
  Metrics metrics;
  prometheus::BuildCounter()
      .Name("cohort_test_events_total")
      .Help("test")
      .Register(metrics.registry())
      .Add({{"reason", "x"}})
      .Increment();
  metrics.ObserveWalSync(absl::Milliseconds(2));
  const std::string text = metrics.Scrape();
  EXPECT_EQ(Value(text, "cohort_test_events_total", {{"reason", "x"}}), 1);
  EXPECT_EQ(Value(text, "cohort_store_wal_sync_seconds_count"), 1);
  EXPECT_EQ(
      Value(text, "cohort_store_wal_sync_seconds_bucket", {{"le", "0.001"}}),
      0);
  EXPECT_EQ(
      Value(text, "cohort_store_wal_sync_seconds_bucket", {{"le", "0.0025"}}),
      1);
}

}  // namespace
}  // namespace cohort::server
