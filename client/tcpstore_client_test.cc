// TcpStoreClient against Debian's real PyTorch 1.13 TCPStore server (a
// /usr/bin/python3 child), and against scripted fake servers for what a
// real one never does (bad replies, dropped connections). The 2.1 dialect
// against cohortd is tests/integration/tcpstore_client_test.cc.
#include "client/tcpstore_client.h"

#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cohort {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A child /usr/bin/python3 -c SCRIPT ARGS..., its stdin and stdout piped.
class Python {
 public:
  Python(const std::string& script, std::vector<std::string> args) {
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) return;
    args.insert(args.begin(), {"/usr/bin/python3", "-c", script});
    // Built before fork: the child of a threaded parent must not allocate.
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      dup2(in[0], STDIN_FILENO);
      dup2(out[1], STDOUT_FILENO);
      close(in[1]);
      close(out[0]);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    stdin_ = in[1];
    stdout_ = out[0];
  }
  ~Python() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (stdin_ >= 0) close(stdin_);
    if (stdout_ >= 0) close(stdout_);
  }

  // Everything written to stdout until EOF, or until `timeout`.
  std::string ReadAll(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    std::string text;
    char buf[4096];
    for (;;) {
      pollfd p{stdout_, POLLIN, 0};
      const int left = static_cast<int>(std::max<int64_t>(
          0, absl::ToInt64Milliseconds(deadline - absl::Now())));
      if (poll(&p, 1, left) <= 0) return text;
      ssize_t n = read(stdout_, buf, sizeof(buf));
      if (n <= 0) return text;
      text.append(buf, n);
    }
  }

  // The first line written to stdout, or "" on EOF or after `timeout`.
  std::string ReadLine(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    std::string line;
    char c;
    while (absl::Now() < deadline) {
      pollfd p{stdout_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      if (read(stdout_, &c, 1) != 1) break;
      if (c == '\n') return line;
      line.push_back(c);
    }
    return line;
  }

  // Closes stdin and returns the exit code.
  int Wait() {
    close(stdin_);
    stdin_ = -1;
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  }

 private:
  pid_t pid_ = -1;
  int stdin_ = -1;
  int stdout_ = -1;
};

constexpr char kImportTorch[] = R"(
import sys
from datetime import timedelta
try:
    import torch.distributed as dist
except Exception as e:
    print("NOTORCH", e, flush=True)
    sys.exit(3)
)";

// Hosts torch's TCPStore server; prints its port, then blocks on stdin.
constexpr char kServerScript[] = R"(
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(s.port, flush=True)
sys.stdin.read()
)";

// A torch client: argv port, then "get KEY" or "set KEY VALUE".
constexpr char kClientScript[] = R"(
s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
                  wait_for_workers=False, timeout=timedelta(seconds=10))
if sys.argv[2] == "get":
    print(s.get(sys.argv[3]).decode(), flush=True)
else:
    s.set(sys.argv[3], sys.argv[4])
)";

class TorchServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<Python>(
        absl::StrCat(kImportTorch, kServerScript), std::vector<std::string>{});
    const std::string line = server_->ReadLine(absl::Seconds(60));
    ASSERT_FALSE(absl::StartsWith(line, "NOTORCH"))
        << "/usr/bin/python3 cannot import torch (" << line
        << "): run tools/setup.sh, which installs Debian's python3-torch";
    ASSERT_TRUE(absl::SimpleAtoi(line, &port_))
        << "torch's TCPStore server (/usr/bin/python3) did not print its "
           "port; got '"
        << line << "'; run tools/setup.sh, which installs python3-torch";
  }
  void TearDown() override { server_.reset(); }

  std::unique_ptr<TcpStoreClient> Client(
      TcpStoreDialect dialect = TcpStoreDialect::kTorch113,
      std::string key_prefix = "") {
    TcpStoreClientOptions options;
    options.address = absl::StrCat("127.0.0.1:", port_);
    options.dialect = dialect;
    options.key_prefix = std::move(key_prefix);
    options.connect_timeout = absl::Seconds(10);
    auto client = TcpStoreClient::Connect(options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  }

  // Runs the torch client script; returns its stdout, trimmed.
  std::string Torch(std::vector<std::string> args) {
    args.insert(args.begin(), absl::StrCat(port_));
    Python client(absl::StrCat(kImportTorch, kClientScript), std::move(args));
    std::string out = std::string(
        absl::StripAsciiWhitespace(client.ReadAll(absl::Seconds(60))));
    EXPECT_EQ(client.Wait(), 0) << out;
    return out;
  }

  std::unique_ptr<Python> server_;
  int port_ = 0;
};

TEST_F(TorchServerTest, SetGetAddAndCounters) {
  auto store = Client();
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->dialect(), tcpstore::Dialect::kTorch113);
  ASSERT_TRUE(store->Set("a", "hello").ok());
  EXPECT_EQ(store->Get("a", absl::Seconds(5)).value_or("?"), "hello");
  ASSERT_TRUE(store->Set("a", std::string("x\0y", 3)).ok());
  EXPECT_EQ(store->Get("a", absl::Seconds(5)).value_or("?"),
            std::string("x\0y", 3));
  EXPECT_EQ(store->Add("n", 5).value_or(-1), 5);
  EXPECT_EQ(store->Add("n", 2).value_or(-1), 7);
  EXPECT_EQ(store->Add("n", -10).value_or(-1), -3);
  EXPECT_EQ(store->Get("n", absl::Seconds(5)).value_or("?"), "-3");
}

TEST_F(TorchServerTest, SeveralAddressesAreTriedInTurn) {
  // The first refuses (a port nobody listens on): the client goes on with
  // the second, as it does when a cohortd replica is down.
  int closed = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(closed, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(closed, reinterpret_cast<sockaddr*>(&addr), &len);
  const int dead_port = ntohs(addr.sin_port);
  close(closed);
  TcpStoreClientOptions options;
  options.address =
      absl::StrCat("127.0.0.1:", dead_port, ",127.0.0.1:", port_);
  options.dialect = TcpStoreDialect::kTorch113;
  options.connect_timeout = absl::Seconds(10);
  auto store = TcpStoreClient::Connect(options);
  ASSERT_TRUE(store.ok()) << store.status();
  ASSERT_TRUE((*store)->Set("replicas", "yes").ok());
  EXPECT_EQ((*store)->Get("replicas", absl::Seconds(5)).value_or("?"), "yes");
}

TEST_F(TorchServerTest, CompareSetFollowsC10dRules) {
  auto store = Client();
  ASSERT_NE(store, nullptr);
  // Missing, expected "": writes desired and returns it.
  EXPECT_EQ(store->CompareSet("k", "", "one").value_or("?"), "one");
  EXPECT_EQ(store->Get("k", absl::Seconds(5)).value_or("?"), "one");
  // Missing, expected non-empty: returns expected, writes nothing.
  EXPECT_EQ(store->CompareSet("m", "exp", "des").value_or("?"), "exp");
  EXPECT_FALSE(store->Check({"m"}).value_or(true));
  // Match: returns the new value.
  EXPECT_EQ(store->CompareSet("k", "one", "two").value_or("?"), "two");
  // Mismatch: returns the current value and writes nothing.
  EXPECT_EQ(store->CompareSet("k", "zzz", "three").value_or("?"), "two");
  EXPECT_EQ(store->Get("k", absl::Seconds(5)).value_or("?"), "two");
}

TEST_F(TorchServerTest, CheckDeleteNumKeys) {
  auto store = Client();
  ASSERT_NE(store, nullptr);
  const int64_t before = store->NumKeys().value_or(-1);
  ASSERT_GE(before, 0);
  EXPECT_FALSE(store->Check({"c1"}).value_or(true));
  ASSERT_TRUE(store->Set("c1", "1").ok());
  ASSERT_TRUE(store->Set("c2", "2").ok());
  EXPECT_TRUE(store->Check({"c1", "c2"}).value_or(false));
  EXPECT_FALSE(store->Check({"c1", "c3"}).value_or(true));
  EXPECT_EQ(store->NumKeys().value_or(-1), before + 2);
  EXPECT_TRUE(store->DeleteKey("c1").value_or(false));
  EXPECT_FALSE(store->DeleteKey("c1").value_or(true));
  EXPECT_FALSE(store->Check({"c1"}).value_or(true));
  EXPECT_EQ(store->NumKeys().value_or(-1), before + 1);
}

TEST_F(TorchServerTest, MultiOpsAndAppendFromSingleQueries) {
  auto store = Client();
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->MultiSet({"m1", "m2", "m3"}, {"v1", "", "v3"}).ok());
  EXPECT_THAT(store->MultiGet({"m3", "m1", "m2"}, absl::Seconds(5))
                  .value_or(std::vector<std::string>{}),
              ElementsAre("v3", "v1", ""));
  EXPECT_EQ(store->MultiSet({"a"}, {}).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(store->Append("log", "ab").ok());
  ASSERT_TRUE(store->Append("log", "cd").ok());
  EXPECT_EQ(store->Get("log", absl::Seconds(5)).value_or("?"), "abcd");
  // c10d's default append would stop here: the current value already
  // equals the bytes appended.
  ASSERT_TRUE(store->Set("same", "x").ok());
  ASSERT_TRUE(store->Append("same", "x").ok());
  EXPECT_EQ(store->Get("same", absl::Seconds(5)).value_or("?"), "xx");
}

TEST_F(TorchServerTest, WaitTimesOutThenTheNextCallReconnects) {
  auto store = Client();
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->Set("here", "1").ok());
  const absl::Time t0 = absl::Now();
  absl::Status s = store->Wait({"here", "absent"}, absl::Milliseconds(300));
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(300));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), HasSubstr("wait for keys [here, absent] timed out "
                                     "after 300ms"));
  EXPECT_EQ(store->Get("here", absl::Seconds(5)).value_or("?"), "1");
  absl::StatusOr<std::string> got =
      store->Get("absent", absl::Milliseconds(100));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(got.status().message(), HasSubstr("get: wait for keys [absent]"));
  EXPECT_EQ(store->Add("after", 1).value_or(-1), 1);
  EXPECT_TRUE(store->Wait({}, absl::Milliseconds(1)).ok());
}

TEST_F(TorchServerTest, BlockedGetReturnsWhenAnotherClientSets) {
  auto waiter = Client();
  auto setter = Client();
  ASSERT_NE(waiter, nullptr);
  ASSERT_NE(setter, nullptr);
  absl::StatusOr<std::string> got;
  std::thread t([&] { got = waiter->Get("late", absl::Seconds(20)); });
  absl::SleepFor(absl::Milliseconds(200));
  ASSERT_TRUE(setter->Set("late", "now").ok());
  t.join();
  EXPECT_EQ(got.value_or("?"), "now");
}

TEST_F(TorchServerTest, ListKeysAndWatchAreUnimplemented) {
  auto store = Client();
  ASSERT_NE(store, nullptr);
  absl::StatusOr<KeyList> list = store->ListKeys("");
  EXPECT_EQ(list.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(list.status().message(), HasSubstr("no LIST_KEYS"));
  auto watch = store->Watch("", 0, [](const WatchEvent&) {});
  EXPECT_EQ(watch.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(watch.status().message(), HasSubstr("cohort://"));
}

TEST_F(TorchServerTest, ProbeSelects113) {
  auto store = Client(TcpStoreDialect::kProbe);
  ASSERT_NE(store, nullptr);
  EXPECT_EQ(store->dialect(), tcpstore::Dialect::kTorch113);
  ASSERT_TRUE(store->Set("probed", "yes").ok());
  EXPECT_EQ(store->Get("probed", absl::Seconds(5)).value_or("?"), "yes");
  // The server survived the probe and still serves others.
  auto plain = Client();
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(plain->Get("probed", absl::Seconds(5)).value_or("?"), "yes");
}

TEST_F(TorchServerTest, SharesKeysWithTorchClientsUnderSlashPrefix) {
  auto store = Client(TcpStoreDialect::kTorch113, "/");
  ASSERT_NE(store, nullptr);
  ASSERT_TRUE(store->Set("from_cohort", "hi torch").ok());
  EXPECT_EQ(Torch({"get", "from_cohort"}), "hi torch");
  Torch({"set", "from_torch", "hi cohort"});
  EXPECT_EQ(store->Get("from_torch", absl::Seconds(5)).value_or("?"),
            "hi cohort");
  // Without the prefix the same key is another key.
  auto bare = Client();
  ASSERT_NE(bare, nullptr);
  EXPECT_TRUE(bare->Check({"/from_torch"}).value_or(false));
  EXPECT_FALSE(bare->Check({"from_torch"}).value_or(true));
}

TEST_F(TorchServerTest, ServerGoneIsUnavailableAfterConnectTimeout) {
  TcpStoreClientOptions options;
  options.address = absl::StrCat("127.0.0.1:", port_);
  options.dialect = TcpStoreDialect::kTorch113;
  options.connect_timeout = absl::Seconds(1);
  auto store = TcpStoreClient::Connect(options);
  ASSERT_TRUE(store.ok()) << store.status();
  server_.reset();
  const absl::Time t0 = absl::Now();
  absl::Status s = (*store)->Set("k", "v");
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(900));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("cannot connect to the TCPStore server "
                                     "at 127.0.0.1:"));
}

// A scripted server on 127.0.0.1: `serve(fd, n)` handles the n-th
// accepted connection (0-based), then the connection is closed.
class FakeServer {
 public:
  explicit FakeServer(std::function<void(int fd, int n)> serve)
      : serve_(std::move(serve)) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    listen(listen_fd_, 16);
    socklen_t len = sizeof(addr);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] {
      for (int n = 0; !stop_; ++n) {
        pollfd p{listen_fd_, POLLIN, 0};
        if (poll(&p, 1, 50) <= 0) {
          --n;
          continue;
        }
        int fd = accept(listen_fd_, nullptr, nullptr);
        if (fd < 0) continue;
        // Counted before serving: a client that saw this connection close
        // must find it counted.
        accepted_ = n + 1;
        serve_(fd, n);
        close(fd);
      }
    });
  }
  ~FakeServer() {
    stop_ = true;
    thread_.join();
    close(listen_fd_);
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  int accepted() const { return accepted_; }

  static void Write(int fd, absl::string_view bytes) {
    EXPECT_EQ(write(fd, bytes.data(), bytes.size()),
              static_cast<ssize_t>(bytes.size()));
  }

  // Reads up to `n` bytes, waiting at most 2 s for them.
  static std::string Read(int fd, size_t n) {
    std::string got;
    char buf[256];
    while (got.size() < n) {
      pollfd p{fd, POLLIN, 0};
      if (poll(&p, 1, 2000) <= 0) break;
      ssize_t r = read(fd, buf, std::min(sizeof(buf), n - got.size()));
      if (r <= 0) break;
      got.append(buf, r);
    }
    return got;
  }

 private:
  std::function<void(int, int)> serve_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> accepted_{0};
  std::thread thread_;
};

TcpStoreClientOptions FakeOptions(const FakeServer& server,
                                  TcpStoreDialect dialect) {
  TcpStoreClientOptions options;
  options.address = server.address();
  options.dialect = dialect;
  options.connect_timeout = absl::Seconds(5);
  options.reply_timeout = absl::Seconds(2);
  options.probe_timeout = absl::Milliseconds(300);
  options.initial_backoff = absl::Milliseconds(10);
  return options;
}

// Answers VALIDATE + PING with `nonce_xor` applied to the nonce.
void Handshake21(int fd, uint32_t nonce_xor) {
  std::string got = FakeServer::Read(fd, 10);
  if (got.size() != 10) return;
  std::string reply = got.substr(6, 4);
  reply[0] = static_cast<char>(reply[0] ^ nonce_xor);
  FakeServer::Write(fd, reply);
}

TEST(FakeServerTest, WrongPingNonceIsAnInternalError) {
  FakeServer server([](int fd, int) { Handshake21(fd, 1); });
  auto store =
      TcpStoreClient::Connect(FakeOptions(server, TcpStoreDialect::kTorch21));
  EXPECT_EQ(store.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(store.status().message(), HasSubstr("PING nonce"));
}

TEST(FakeServerTest, ProbeFallsBackTo21WhenTheServerClosesIt) {
  std::atomic<bool> validated{false};
  FakeServer server([&](int fd, int n) {
    if (n == 0) {  // The probe: a 1.13 GETNUMKEYS, which 2.1+ refuses.
      EXPECT_EQ(FakeServer::Read(fd, 1), std::string(1, '\x06'));
      return;
    }
    std::string got = FakeServer::Read(fd, 10);
    validated = got.substr(0, 5) == std::string("\x00\xCE\xF7\x85\x3C", 5);
    FakeServer::Write(fd, got.substr(6, 4));
    FakeServer::Read(fd, 1);  // Until the client goes.
  });
  auto store =
      TcpStoreClient::Connect(FakeOptions(server, TcpStoreDialect::kProbe));
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->dialect(), tcpstore::Dialect::kTorch21);
  EXPECT_TRUE(validated);
}

TEST(FakeServerTest, BadReplyByteDropsTheConnection) {
  FakeServer server([](int fd, int) {
    FakeServer::Read(fd, 1 + 8 + 8 + 1);  // CHECK of one 1-byte key.
    FakeServer::Write(fd, "\x07");
  });
  auto store =
      TcpStoreClient::Connect(FakeOptions(server, TcpStoreDialect::kTorch113));
  ASSERT_TRUE(store.ok()) << store.status();
  absl::StatusOr<bool> ready = (*store)->Check({"k"});
  EXPECT_EQ(ready.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(ready.status().message(), HasSubstr("CHECK answered 7"));
}

TEST(FakeServerTest, ClosedMidCall) {
  // Every connection is closed once a request has arrived.
  FakeServer server([](int fd, int) { FakeServer::Read(fd, 1); });
  auto store =
      TcpStoreClient::Connect(FakeOptions(server, TcpStoreDialect::kTorch113));
  ASSERT_TRUE(store.ok()) << store.status();
  // Not repeatable: one attempt, and the caller is told it may have landed.
  absl::StatusOr<int64_t> added = (*store)->Add("n", 1);
  EXPECT_EQ(added.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(added.status().message(),
              HasSubstr("may or may not have been applied"));
  // Repeatable: retried on fresh connections until the server has refused
  // it three times.
  const int before = server.accepted();
  absl::Status s = (*store)->Set("k", "v");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("refuses it"));
  EXPECT_GE(server.accepted() - before, 3);
}

TEST(TcpStoreClientTest, BadOptions) {
  TcpStoreClientOptions options;
  options.address = "no-port";
  EXPECT_EQ(TcpStoreClient::Connect(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.address = "[::1]:";
  EXPECT_EQ(TcpStoreClient::Connect(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.address = "127.0.0.1:1,no-port";
  EXPECT_EQ(TcpStoreClient::Connect(options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cohort
