// cohortd as a real process: durability across kill -9, restarts, thread
// usage under many blocked calls, health, reflection and SIGTERM draining.
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/remote_store.h"
#include "cohort/v1/coordination.grpc.pb.h"
#include "cohort/v1/store.grpc.pb.h"
#include "gmock/gmock.h"
#include "google/protobuf/stubs/logging.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "tests/testing/cohortd_process.h"

namespace cohort {
namespace {

using testing::CohortdProcess;
using ::testing::Contains;
using ::testing::HasSubstr;

std::string FreshDir(const std::string& name) {
  auto dir = std::filesystem::path(::testing::TempDir()) / name;
  std::filesystem::remove_all(dir);
  return dir.string();
}

// Polls `done` until it holds; false once `give_up` passed, which only a
// broken cohortd reaches (the caller's assertion then says what it was).
template <typename Condition>
bool Eventually(Condition done, absl::Duration give_up = absl::Seconds(60)) {
  const absl::Time until = absl::Now() + give_up;
  while (!done()) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

// How many times `what` occurs in `text`.
int Occurrences(absl::string_view text, absl::string_view what) {
  int n = 0;
  for (size_t at = text.find(what); at != absl::string_view::npos;
       at = text.find(what, at + what.size())) {
    ++n;
  }
  return n;
}

// The value of the gauge `name` in cohortd's /metrics (started with
// --metrics_listen=127.0.0.1:0), or -1 if it could not be read.
int64_t Gauge(CohortdProcess& server, absl::string_view name) {
  const std::string kMarker = "serving Prometheus metrics on http://127.0.0.1:";
  const std::string log = server.Log();
  const size_t at = log.find(kMarker);
  if (at == std::string::npos) return -1;
  const size_t begin = at + kMarker.size();
  int port = 0;
  if (!absl::SimpleAtoi(log.substr(begin, log.find('/', begin) - begin),
                        &port)) {
    return -1;
  }
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string reply;
  if (connect(fd, reinterpret_cast<struct sockaddr*>(&addr), sizeof(addr)) ==
      0) {
    const std::string get = "GET /metrics HTTP/1.0\r\n\r\n";
    if (write(fd, get.data(), get.size()) == static_cast<ssize_t>(get.size())) {
      char buf[4096];
      for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) {
        reply.append(buf, n);
      }
    }
  }
  close(fd);
  const std::string line = absl::StrCat("\n", name, " ");
  const size_t found = reply.find(line);
  int64_t value = -1;
  if (found != std::string::npos) {
    const size_t begin = found + line.size();
    absl::SimpleAtoi(reply.substr(begin, reply.find('\n', begin) - begin),
                     &value);
  }
  return value;
}

std::unique_ptr<RemoteStore> Client(const std::string& address) {
  RemoteStoreOptions options;
  options.address = address;
  options.connect_timeout = absl::Seconds(10);
  auto store = RemoteStore::Connect(options);
  EXPECT_TRUE(store.ok());
  return std::move(*store);
}

TEST(CohortdTest, AcknowledgedWritesSurviveKill9) {
  const std::string dir = FreshDir("kill9");
  auto server = CohortdProcess::Start({"--data_dir=" + dir});
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = server->port();
  {
    std::unique_ptr<RemoteStore> store = Client(server->address());
    for (int i = 0; i < 500; ++i) {
      ASSERT_TRUE(
          store->Set(absl::StrCat("key/", i), absl::StrCat("v", i)).ok());
      ASSERT_TRUE(store->Add("counter", 3).ok());
    }
    ASSERT_TRUE(store->MultiSet({"m/a", "m/b"}, {"1", "2"}).ok());
    ASSERT_TRUE(store->Append("log", "abc").ok());
  }
  // No flush, no goodbye: every acknowledged write must be in the WAL.
  int status = server->Stop(SIGKILL);
  ASSERT_TRUE(WIFSIGNALED(status));

  auto restarted = CohortdProcess::Start({"--data_dir=" + dir}, port);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  EXPECT_THAT(restarted->Log(), HasSubstr("504 keys at revision 1002"));
  std::unique_ptr<RemoteStore> store = Client(restarted->address());
  for (int i = 0; i < 500; ++i) {
    EXPECT_EQ(*store->Get(absl::StrCat("key/", i), absl::Seconds(1)),
              absl::StrCat("v", i));
  }
  EXPECT_EQ(*store->Get("counter"), "1500");
  EXPECT_EQ(*store->Add("counter", 1), 1501);
  EXPECT_EQ(*store->Get("m/b"), "2");
  EXPECT_EQ(*store->Get("log"), "abc");
  EXPECT_EQ(*store->NumKeys(), 504);
}

TEST(CohortdTest, ClientsRideThroughARestart) {
  const std::string dir = FreshDir("restart");
  auto server = CohortdProcess::Start({"--data_dir=" + dir});
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = server->port();
  std::unique_ptr<RemoteStore> store = Client(server->address());
  ASSERT_TRUE(store->Set("before", "1").ok());

  absl::Mutex mu;
  std::vector<std::string> seen;
  auto watch = store->Watch("w/", 0, [&](const WatchEvent& e) {
    absl::MutexLock l(&mu);
    seen.push_back(e.key);
  });
  ASSERT_TRUE(watch.ok());
  ASSERT_TRUE(store->Set("w/1", "x").ok());

  ASSERT_EQ(server->Stop(SIGTERM), 0);
  auto restarted = CohortdProcess::Start({"--data_dir=" + dir}, port);
  ASSERT_TRUE(restarted.ok()) << restarted.status();

  // The same client object reconnects; the watch resumes where it was.
  ASSERT_TRUE(store->Set("w/2", "y").ok());
  EXPECT_EQ(*store->Get("before"), "1");
  absl::MutexLock l(&mu);
  mu.AwaitWithTimeout(
      absl::Condition(
          +[](std::vector<std::string>* s) { return s->size() >= 2; }, &seen),
      absl::Seconds(15));
  EXPECT_THAT(seen, ::testing::ElementsAre("w/1", "w/2"));
}

TEST(CohortdTest, TwoThousandBlockedGetsHoldNoThreads) {
  auto server = CohortdProcess::Start(
      {"--engine=memory", "--metrics_listen=127.0.0.1:0"});
  ASSERT_TRUE(server.ok()) << server.status();
  constexpr int kCalls = 2000, kChannels = 4;
  std::vector<std::unique_ptr<v1::Store::Stub>> stubs;
  for (int c = 0; c < kChannels; ++c) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    stubs.push_back(v1::Store::NewStub(grpc::CreateCustomChannel(
        server->address(), grpc::InsecureChannelCredentials(), args)));
  }
  const int threads_idle = server->ThreadCount();

  struct Call {
    grpc::ClientContext ctx;
    v1::GetRequest req;
    v1::GetResponse resp;
    grpc::Status status;
  };
  std::vector<Call> calls(kCalls);
  absl::Mutex mu;
  int done = 0;
  for (int i = 0; i < kCalls; ++i) {
    Call& call = calls[i];
    call.req.set_key(absl::StrCat("rank/", i));
    call.req.set_timeout_ms(60000);
    call.ctx.set_deadline(std::chrono::system_clock::now() +
                          std::chrono::seconds(90));
    stubs[i % kChannels]->async()->Get(&call.ctx, &call.req, &call.resp,
                                       [&, i](grpc::Status s) {
                                         calls[i].status = std::move(s);
                                         absl::MutexLock l(&mu);
                                         ++done;
                                       });
  }
  // Every call has reached the server and blocks there.
  const bool all_blocked = Eventually(
      [&] { return Gauge(*server, "cohort_store_blocked_waiters") == kCalls; });
  EXPECT_TRUE(all_blocked) << "blocked waiters: "
                           << Gauge(*server, "cohort_store_blocked_waiters");
  const int threads_blocked = server->ThreadCount();
  {
    absl::MutexLock l(&mu);
    EXPECT_EQ(done, 0) << "calls completed before their keys existed";
  }
  std::cerr << "cohortd threads: idle " << threads_idle << ", with " << kCalls
            << " blocked gets " << threads_blocked << "\n";
  // A thread per call would be 2,000; gRPC's pool may grow a little.
  EXPECT_LT(threads_blocked, threads_idle + 32);

  std::vector<std::string> keys, values;
  for (int i = 0; i < kCalls; ++i) {
    keys.push_back(absl::StrCat("rank/", i));
    values.push_back(absl::StrCat("addr-", i));
  }
  std::unique_ptr<RemoteStore> writer = Client(server->address());
  ASSERT_TRUE(writer->MultiSet(keys, values).ok());
  {
    absl::MutexLock l(&mu);
    auto all_done = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
      return done == kCalls;
    };
    EXPECT_TRUE(
        mu.AwaitWithTimeout(absl::Condition(&all_done), absl::Seconds(60)));
  }
  for (int i = 0; i < kCalls; ++i) {
    ASSERT_TRUE(calls[i].status.ok())
        << i << ": " << calls[i].status.error_message();
    EXPECT_EQ(calls[i].resp.value(), absl::StrCat("addr-", i));
  }
}

TEST(CohortdTest, HealthIsServingAndReflectionListsTheStore) {
  auto server = CohortdProcess::Start({"--engine=memory"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = grpc::CreateChannel(server->address(),
                                     grpc::InsecureChannelCredentials());

  auto health = grpc::health::v1::Health::NewStub(channel);
  for (const std::string service : {"", "cohort.v1.Store"}) {
    grpc::ClientContext ctx;
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(service);
    grpc::health::v1::HealthCheckResponse resp;
    ASSERT_TRUE(health->Check(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING)
        << "service '" << service << "'";
  }

  auto reflection =
      grpc::reflection::v1alpha::ServerReflection::NewStub(channel);
  grpc::ClientContext ctx;
  auto stream = reflection->ServerReflectionInfo(&ctx);
  grpc::reflection::v1alpha::ServerReflectionRequest req;
  req.set_list_services("");
  ASSERT_TRUE(stream->Write(req));
  grpc::reflection::v1alpha::ServerReflectionResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  std::vector<std::string> services;
  for (const auto& s : resp.list_services_response().service()) {
    services.push_back(s.name());
  }
  EXPECT_THAT(services, Contains("cohort.v1.Store"));
  EXPECT_THAT(services, Contains("grpc.health.v1.Health"));

  // `describe`: the file defining the service comes back.
  req.set_file_containing_symbol("cohort.v1.Store");
  ASSERT_TRUE(stream->Write(req));
  ASSERT_TRUE(stream->Read(&resp));
  EXPECT_GT(resp.file_descriptor_response().file_descriptor_proto_size(), 0);
  stream->WritesDone();
}

TEST(CohortdTest, SigtermEndsWaitersWithUnavailableAndExitsCleanly) {
  const std::string dir = FreshDir("sigterm");
  auto server = CohortdProcess::Start(
      {"--data_dir=" + dir, "--metrics_listen=127.0.0.1:0"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::Store::NewStub(grpc::CreateChannel(
      server->address(), grpc::InsecureChannelCredentials()));
  grpc::Status status;
  std::thread waiter([&] {
    grpc::ClientContext ctx;
    v1::WaitRequest req;
    req.add_keys("never");
    v1::WaitResponse resp;
    status = stub->Wait(&ctx, req, &resp);
  });
  // SIGTERM once the wait is blocked in the store, not on its way there.
  EXPECT_TRUE(Eventually([&] {
    return Gauge(*server, "cohort_store_blocked_waiters") == 1;
  })) << "the wait never reached the store";
  int exit_status = server->Stop(SIGTERM);
  waiter.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(status.error_message(), HasSubstr("shutting down"));
  ASSERT_TRUE(WIFEXITED(exit_status));
  EXPECT_EQ(WEXITSTATUS(exit_status), 0);
  EXPECT_THAT(server->Log(), HasSubstr("received SIGTERM"));
  EXPECT_THAT(server->Log(), HasSubstr("stopped cleanly"));
}

TEST(CohortdTest, BadFlagsFailWithAClearMessage) {
  auto bad_engine = CohortdProcess::Start({"--engine=leveldb"});
  ASSERT_FALSE(bad_engine.ok());
  EXPECT_THAT(bad_engine.status().message(),
              HasSubstr("--engine must be rocksdb, memory or etcd"));
  auto no_etcd = CohortdProcess::Start({"--engine=etcd"});
  ASSERT_FALSE(no_etcd.ok());
  EXPECT_THAT(no_etcd.status().message(),
              HasSubstr("--etcd_endpoints needs at least one HOST:PORT"));
  // Anonymous TCPStore clients with tokens on, but no prefix to confine
  // them: they would reach every job's keys around the tokens.
  const std::string tokens =
      absl::StrCat(::testing::TempDir(), "/bad-flags-tokens");
  std::ofstream(tokens) << "admin-token-0123456789 admin *\n";
  auto open_listener = CohortdProcess::Start(
      {"--engine=memory", "--auth_tokens=" + tokens,
       "--tcpstore_listen=127.0.0.1:0", "--tcpstore_require_token=false"});
  ASSERT_FALSE(open_listener.ok());
  EXPECT_THAT(open_listener.status().message(),
              HasSubstr("--tcpstore_require_token=false without "
                        "--tcpstore_prefix"));
  auto confined = CohortdProcess::Start(
      {"--engine=memory", "--auth_tokens=" + tokens,
       "--tcpstore_listen=127.0.0.1:0", "--tcpstore_require_token=false",
       "--tcpstore_prefix=anonymous/"});
  EXPECT_TRUE(confined.ok()) << confined.status();
  auto reserved = CohortdProcess::Start(
      {"--engine=memory", "--tcpstore_listen=127.0.0.1:0",
       "--tcpstore_prefix=/cohort"});
  ASSERT_FALSE(reserved.ok());
  EXPECT_THAT(reserved.status().message(), HasSubstr("reserved namespace"));
  // A second cohortd on the same data dir is refused, naming the folder.
  const std::string dir = FreshDir("locked");
  auto first = CohortdProcess::Start({"--data_dir=" + dir});
  ASSERT_TRUE(first.ok());
  auto second = CohortdProcess::Start({"--data_dir=" + dir});
  ASSERT_FALSE(second.ok());
  EXPECT_THAT(second.status().message(), HasSubstr(dir));
}

// Plain TCP connections to 127.0.0.1:port (they count as clients: cohortd
// hands each to gRPC, which holds it open).
std::vector<int> OpenConnections(int port, int n) {
  std::vector<int> fds;
  for (int i = 0; i < n; ++i) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, reinterpret_cast<struct sockaddr*>(&addr), sizeof(addr)) ==
        0) {
      fds.push_back(fd);
    } else {
      close(fd);
    }
  }
  return fds;
}

grpc::Status TrySet(const std::string& address, const std::string& key) {
  auto stub = v1::Store::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  v1::SetRequest req;
  req.set_key(key);
  req.set_value("v");
  v1::SetResponse resp;
  return stub->Set(&ctx, req, &resp);
}

// Every request whose string field is not UTF-8 makes protobuf log a line;
// a peer sending thousands must cost cohortd's log a line a second, like
// cohortd's own lines about bad input, and cohortd must keep serving.
TEST(CohortdTest, ProtobufParseErrorsAreLoggedOnceASecond) {
  auto server = CohortdProcess::Start({"--engine=memory"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto rendezvous = v1::Rendezvous::NewStub(grpc::CreateChannel(
      server->address(), grpc::InsecureChannelCredentials()));
  v1::JoinRequest join;
  join.set_run_id("run\xff\xfe");  // Not UTF-8: the server cannot parse it.
  join.set_node_id("n0");
  // This process's own protobuf complains too, on sending each one.
  google::protobuf::LogSilencer quiet;
  const absl::Time start = absl::Now();
  constexpr int kCalls = 300;
  for (int i = 0; i < kCalls; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    v1::JoinResponse joined;
    EXPECT_FALSE(rendezvous->Join(&ctx, join, &joined).ok());
  }
  // Every parse failed (and was logged, if at all) before its reply came.
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
  EXPECT_TRUE(TrySet(server->address(), "still/serving").ok());
  const int lines = Occurrences(server->Log(), "protobuf: ");
  EXPECT_GE(lines, 1) << server->Log();
  // At most one a second, counted from the first.
  EXPECT_LE(lines, 1 + static_cast<int>(std::ceil(elapsed)))
      << kCalls << " bad requests in " << elapsed << " s:\n" << server->Log();
  EXPECT_THAT(server->Log(), HasSubstr("invalid UTF-8"));
}

// gRPC's default listener set SO_REUSEPORT: a second cohortd could bind a
// running one's port and split its clients between two stores.
TEST(CohortdTest, ASecondCohortdOnTheSamePortIsRefused) {
  auto first = CohortdProcess::Start({"--data_dir=" + FreshDir("port_a")});
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = CohortdProcess::Start({"--data_dir=" + FreshDir("port_b")},
                                      first->port());
  ASSERT_FALSE(second.ok()) << "two cohortds serve port " << first->port();
  EXPECT_THAT(
      second.status().message(),
      HasSubstr(absl::StrCat("cannot listen on 127.0.0.1:", first->port())));
  EXPECT_THAT(second.status().message(), HasSubstr("Address already in use"));
  // The first one still serves, alone.
  EXPECT_TRUE(TrySet(first->address(), "k").ok());
}

TEST(CohortdTest, ConnectionsOverTheCapAreRefusedWithAReason) {
  auto server =
      CohortdProcess::Start({"--engine=memory", "--max_connections=8"});
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<int> held = OpenConnections(server->port(), 8);
  ASSERT_EQ(held.size(), 8u);
  // Refused once the listener has taken the 8 (until then a call may get
  // in, and leaves again).
  grpc::Status refused;
  const bool was_refused = Eventually([&] {
    refused = TrySet(server->address(), "k");
    return refused.error_code() == grpc::StatusCode::UNAVAILABLE;
  });
  EXPECT_TRUE(was_refused) << refused.error_code() << ": "
                           << refused.error_message();
  // cohortd logs the refusal as it closes the connection, which the
  // client may see first.
  Eventually(
      [&] { return absl::StrContains(server->Log(), "too many connections"); });
  EXPECT_THAT(server->Log(), HasSubstr("too many connections (8 open"));
  for (int fd : held) close(fd);
  // Closed connections are noticed: new clients get in again.
  EXPECT_TRUE(Eventually([&] { return TrySet(server->address(), "k").ok(); }));
}

// A TCPStore connection that cohortd serves: it answers VALIDATE and a
// PING (PyTorch 2.1+'s protocol). -1 if it is closed instead.
int ServedTcpStoreConnection(int port) {
  std::vector<int> fds = OpenConnections(port, 1);
  if (fds.empty()) return -1;
  const uint32_t magic = 0x3C85F7CE, word = 7;
  std::string hello(1, '\0');
  hello.append(reinterpret_cast<const char*>(&magic), 4);
  hello.push_back('\x0d');  // PING
  hello.append(reinterpret_cast<const char*>(&word), 4);
  char echo[4];
  struct pollfd p = {fds[0], POLLIN, 0};
  if (send(fds[0], hello.data(), hello.size(), MSG_NOSIGNAL) !=
          static_cast<ssize_t>(hello.size()) ||
      poll(&p, 1, 5000) != 1 || recv(fds[0], echo, 4, MSG_WAITALL) != 4) {
    close(fds[0]);
    return -1;
  }
  return fds[0];
}

// Issue 24: --max_connections was per listener, so the gRPC and TCPStore
// listeners together could hold twice what the fd limit was fitted to.
TEST(CohortdTest, OneConnectionBudgetSpansBothListeners) {
  auto server = CohortdProcess::Start({"--engine=memory", "--max_connections=8",
                                       "--tcpstore_listen=127.0.0.1:0"});
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_NE(server->tcpstore_port(), 0);
  // gRPC connections fill what TCPStore connections leave of the budget:
  // then a TCPStore connection is closed at once, though fewer than 8
  // TCPStore connections are open (each listener alone would take 8). One
  // more gRPC connection each time until then, and the TCPStore ones served
  // are kept: closing one frees its room only once cohortd has read the
  // close, and the next gRPC connection could be refused before.
  std::vector<int> grpc_held, tcpstore_held;
  bool refused_tcpstore = false;
  for (int i = 0; i < 64 && !refused_tcpstore; ++i) {
    std::vector<int> more = OpenConnections(server->port(), 1);
    grpc_held.insert(grpc_held.end(), more.begin(), more.end());
    const int fd = ServedTcpStoreConnection(server->tcpstore_port());
    if (fd >= 0) tcpstore_held.push_back(fd);
    refused_tcpstore = fd == -1;
  }
  EXPECT_TRUE(refused_tcpstore);
  EXPECT_LT(tcpstore_held.size(), 8u);
  EXPECT_THAT(server->Log(), HasSubstr("connections are open across cohortd's "
                                       "gRPC and TCPStore listeners"));
  for (int fd : grpc_held) close(fd);
  for (int fd : tcpstore_held) close(fd);

  // And the other way, on a cohortd of its own (nothing of the above left
  // to give back): eight TCPStore connections take it all, and gRPC is
  // refused.
  server = CohortdProcess::Start({"--engine=memory", "--max_connections=8",
                                  "--tcpstore_listen=127.0.0.1:0"});
  ASSERT_TRUE(server.ok()) << server.status();

  std::vector<int> torch;
  EXPECT_TRUE(Eventually([&] {
    const int fd = ServedTcpStoreConnection(server->tcpstore_port());
    if (fd >= 0) torch.push_back(fd);
    return torch.size() == 8;
  })) << torch.size()
      << " TCPStore connections served";
  grpc::Status refused;
  EXPECT_TRUE(Eventually([&] {
    refused = TrySet(server->address(), "k");
    return refused.error_code() == grpc::StatusCode::UNAVAILABLE;
  })) << refused.error_code()
      << ": " << refused.error_message();
  Eventually([&] {
    return absl::StrContains(server->Log(), "across its gRPC and TCPStore");
  });
  EXPECT_THAT(server->Log(),
              HasSubstr("too many connections (8 open across its gRPC and "
                        "TCPStore listeners, --max_connections)"));
  for (int fd : torch) close(fd);
  EXPECT_TRUE(Eventually([&] { return TrySet(server->address(), "k").ok(); }));
}

// gRPC 1.51's listener stopped accepting for good after one EMFILE.
TEST(CohortdTest, AcceptingResumesAfterRunningOutOfFileDescriptors) {
  auto server = CohortdProcess::Start({"--engine=memory"});
  ASSERT_TRUE(server.ok()) << server.status();
  struct rlimit tiny = {64, 64};
  ASSERT_EQ(prlimit(server->pid(), RLIMIT_NOFILE, &tiny, nullptr), 0)
      << strerror(errno);
  std::vector<int> flood = OpenConnections(server->port(), 100);
  Eventually([&] {
    return absl::StrContains(server->Log(), "out of file descriptors");
  });
  EXPECT_THAT(server->Log(), HasSubstr("out of file descriptors"));
  for (int fd : flood) close(fd);
  EXPECT_TRUE(Eventually([&] { return TrySet(server->address(), "k").ok(); }))
      << server->Log();
  ASSERT_EQ(kill(server->pid(), 0), 0) << "cohortd died";
}

// Idle connections were held forever: each costs the server an fd.
TEST(CohortdTest, IdleConnectionsAreClosed) {
  auto server = CohortdProcess::Start({"--engine=memory", "--idle_timeout=1s"});
  ASSERT_TRUE(server.ok()) << server.status();
  // Before the connection exists: whatever cohortd counts idleness from
  // comes after this, so the close cannot come within 1 s of it.
  const absl::Time start = absl::Now();
  std::vector<int> fds = OpenConnections(server->port(), 1);
  ASSERT_EQ(fds.size(), 1u);
  const std::string preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  const std::string settings({0, 0, 0, /*SETTINGS=*/4, 0, 0, 0, 0, 0});
  const std::string hello = preface + settings;
  ASSERT_EQ(write(fds[0], hello.data(), hello.size()),
            static_cast<ssize_t>(hello.size()));
  // Read until the server closes the connection (EOF), or give up.
  struct timeval tv = {1, 0};
  setsockopt(fds[0], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  bool closed = false;
  char buf[4096];
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (!closed && absl::Now() < give_up) {
    const ssize_t n = read(fds[0], buf, sizeof(buf));
    closed = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
  }
  close(fds[0]);
  EXPECT_TRUE(closed) << "an idle connection was never closed (gave up "
                         "after 60 s)";
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(900));
}

// HTTP/2 bytes for one call whose `name` header carries `value`.
std::string CallWithHeader(absl::string_view name, absl::string_view value) {
  auto frame = [](uint8_t type, uint8_t flags, absl::string_view payload) {
    std::string f;
    f.push_back(static_cast<char>((payload.size() >> 16) & 0xff));
    f.push_back(static_cast<char>((payload.size() >> 8) & 0xff));
    f.push_back(static_cast<char>(payload.size() & 0xff));
    f.push_back(static_cast<char>(type));
    f.push_back(static_cast<char>(flags));
    f.append({0, 0, 0, 1});
    f.append(payload.data(), payload.size());
    return f;
  };
  auto literal = [](absl::string_view n, absl::string_view v) {
    return absl::StrCat(std::string(1, '\0'),
                        std::string(1, static_cast<char>(n.size())), n,
                        std::string(1, static_cast<char>(v.size())), v);
  };
  std::string settings = frame(4, 0, "");
  settings[8] = 0;  // Stream 0.
  return absl::StrCat(
      "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", settings,
      frame(1, 0x4,
            absl::StrCat(literal(":method", "POST"), literal(":scheme", "http"),
                         literal(":path", "/cohort.v1.Store/Set"),
                         literal(":authority", "x"),
                         literal("content-type", "application/grpc"),
                         literal("te", "trailers"), literal(name, value))));
}

// gRPC logs a header it cannot parse, value and all: what a peer sends
// must reach the log escaped, never as raw terminal control bytes.
TEST(CohortdTest, PeerBytesReachTheLogEscaped) {
  auto server = CohortdProcess::Start({"--engine=memory"});
  ASSERT_TRUE(server.ok()) << server.status();
  int logged = 0;
  for (absl::string_view name : {"grpc-timeout", "content-type"}) {
    std::vector<int> fds = OpenConnections(server->port(), 1);
    ASSERT_EQ(fds.size(), 1u);
    const std::string bytes = CallWithHeader(name, "\x1b[31mred\x07");
    ASSERT_EQ(write(fds[0], bytes.data(), bytes.size()),
              static_cast<ssize_t>(bytes.size()));
    // Closed once cohortd has logged this header.
    const bool seen = Eventually([&] {
      return Occurrences(server->Log(), "Error parsing metadata") > logged;
    });
    EXPECT_TRUE(seen) << name << " was not logged:\n" << server->Log();
    logged = Occurrences(server->Log(), "Error parsing metadata");
    close(fds[0]);
  }
  const std::string log = server->Log();
  EXPECT_THAT(log, HasSubstr("Error parsing metadata"));
  EXPECT_THAT(log, HasSubstr("\\x1b[31mred"));
  EXPECT_EQ(log.find('\x1b'), std::string::npos) << log;
  EXPECT_EQ(log.find('\x07'), std::string::npos) << log;
  EXPECT_TRUE(TrySet(server->address(), "still-serving").ok());
}

}  // namespace
}  // namespace cohort
