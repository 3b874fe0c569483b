// The TCPStore listener check: its bytes and reply rules from strings, then
// against fake listeners on loopback that refuse, close, stay silent,
// answer like another cohortd (PING, never the WAIT), or serve the store
// the check writes to. cohortd's own listener is checked end to end by
// tests/integration/cohortrun_test.sh.
#include "client/tcpstore_check.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/tcpstore/wire.h"
#include "tests/testing/in_process_store.h"

namespace cohort {
namespace {

using tcpstore::Dialect;
using tcpstore::Op;
using ::testing::HasSubstr;

std::string Ping(uint32_t nonce) {
  std::string out;
  tcpstore::Encoder(&out).U32(nonce);
  return out;
}

TEST(CheckOpeningTest, HelloValidatePingAndTheWait) {
  const std::string bytes = CheckOpening(
      {.name_space = "/cohortrun/job/", .token = "tok-0123456789abcdef"},
      "check-1", 77);
  absl::string_view ns, token;
  tcpstore::ParseResult hello =
      tcpstore::ParseNamespaceHello(bytes, &ns, &token);
  ASSERT_EQ(hello.status, tcpstore::ParseStatus::kComplete);
  EXPECT_EQ(ns, "/cohortrun/job/");
  EXPECT_EQ(token, "tok-0123456789abcdef");
  absl::string_view rest = absl::string_view(bytes).substr(hello.size);
  std::vector<std::string> seen;
  while (!rest.empty()) {
    tcpstore::Request r;
    tcpstore::ParseResult p =
        tcpstore::ParseRequest(Dialect::kTorch21, rest, {}, &r);
    ASSERT_EQ(p.status, tcpstore::ParseStatus::kComplete) << p.error;
    seen.push_back(absl::StrCat(tcpstore::OpName(r.op), " ", r.word,
                                r.keys.empty() ? "" : " ",
                                r.keys.empty() ? "" : r.keys[0]));
    rest.remove_prefix(p.size);
  }
  EXPECT_THAT(seen, ::testing::ElementsAre(
                        absl::StrCat("VALIDATE ", tcpstore::kValidateMagic),
                        "PING 77", "WAIT 0 check-1"));
  // No key: no WAIT, and a plain hello without a token.
  const std::string plain =
      CheckOpening({.name_space = "/cohortrun/job/"}, "", 77);
  EXPECT_EQ(plain.substr(0, 4), std::string("\xC0NS1", 4));
  EXPECT_LT(plain.size(), bytes.size());
}

TEST(ClassifyCheckReplyTest, EachReplyByItsBytes) {
  const std::string ping = Ping(0x01020304);
  const auto classify = [](absl::string_view bytes, bool ended, bool key) {
    return ClassifyCheckReply(bytes, ended, 0x01020304, key);
  };
  EXPECT_EQ(classify("", false, true), CheckReply::kIncomplete);
  EXPECT_EQ(classify("", true, true), CheckReply::kClosedEarly);
  EXPECT_EQ(classify(ping.substr(0, 2), false, true), CheckReply::kIncomplete);
  EXPECT_EQ(classify(ping.substr(0, 2), true, true), CheckReply::kWrongBytes);
  EXPECT_EQ(classify("HTTP/1.1 400", false, true), CheckReply::kWrongBytes);
  EXPECT_EQ(classify(ping, false, true), CheckReply::kPingOnly);
  EXPECT_EQ(classify(ping, true, true), CheckReply::kClosedLater);
  EXPECT_EQ(classify(ping + '\0', false, true), CheckReply::kAnswered);
  EXPECT_EQ(classify(ping + '\1', false, true), CheckReply::kWrongBytes);
  EXPECT_EQ(classify(ping + '\0' + '\0', false, true), CheckReply::kWrongBytes);
  EXPECT_EQ(classify(ping, false, false), CheckReply::kAnswered);
  EXPECT_EQ(classify(ping + '\0', false, false), CheckReply::kWrongBytes);
}

// One listening socket on 127.0.0.1. With `serve`, a thread accepts one
// connection and runs it (and closes the connection after); without, no
// connection is ever accepted (the kernel's backlog completes the connect).
class FakeListener {
 public:
  explicit FakeListener(std::function<void(int)> serve = nullptr) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    listen(fd_, 8);
    socklen_t len = sizeof(addr);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    if (serve) {
      thread_ = std::thread([this, serve] {
        const int conn = accept(fd_, nullptr, nullptr);
        if (conn < 0) return;
        serve(conn);
        close(conn);
      });
    }
  }
  ~FakeListener() {
    shutdown(fd_, SHUT_RDWR);
    if (thread_.joinable()) thread_.join();
    close(fd_);
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  int fd_ = -1;
  int port_ = 0;
  std::thread thread_;
};

// What a fake TCPStore server read of the check's opening.
struct Opening {
  std::string name_space;
  uint32_t nonce = 0;
  std::string waited_key;  // Empty: no WAIT.
};

// Reads the hello, VALIDATE, PING and (when `with_wait`) WAIT from `fd`.
bool ReadOpening(int fd, bool with_wait, Opening* out) {
  std::string bytes;
  for (;;) {
    absl::string_view ns;
    tcpstore::ParseResult hello = tcpstore::ParseNamespaceHello(bytes, &ns);
    if (hello.status == tcpstore::ParseStatus::kComplete) {
      out->name_space = std::string(ns);
      absl::string_view rest = absl::string_view(bytes).substr(hello.size);
      int parsed = 0;
      tcpstore::Request r;
      tcpstore::ParseResult p;
      while ((p = tcpstore::ParseRequest(Dialect::kTorch21, rest, {}, &r))
                 .status == tcpstore::ParseStatus::kComplete) {
        if (r.op == Op::kPing) out->nonce = r.word;
        if (r.op == Op::kWait) out->waited_key = std::string(r.keys[0]);
        rest.remove_prefix(p.size);
        ++parsed;
      }
      if (parsed == (with_wait ? 3 : 2)) return true;
    }
    char buf[512];
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) return false;
    bytes.append(buf, n);
  }
}

void DrainUntilClosed(int fd) {
  char buf[512];
  while (read(fd, buf, sizeof(buf)) > 0) {
  }
}

TcpStoreCheckOptions Options(const std::string& address) {
  return {.address = address,
          .name_space = "/cohortrun/job/",
          .timeout = absl::Seconds(2)};
}

TEST(ProbeTcpStoreListenerTest, RefusedSaysNothingListens) {
  std::string address;
  { address = FakeListener().address(); }  // Closed: the port refuses.
  absl::Status s = ProbeTcpStoreListener(Options(address), "k");
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("refused: nothing listens"));
}

TEST(ProbeTcpStoreListenerTest, AnUnresolvableHost) {
  absl::Status s =
      ProbeTcpStoreListener(Options("no-such-host.invalid:29400"), "k");
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("does not resolve"));
}

TEST(ProbeTcpStoreListenerTest, SilenceIsNoAnswerToThePing) {
  FakeListener silent;
  absl::Status s = ProbeTcpStoreListener(Options(silent.address()), "k");
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("did not answer a TCPStore PING"));
}

TEST(ProbeTcpStoreListenerTest, ClosedAtTheHelloIsNotCohortd) {
  FakeListener closes([](int) {});
  absl::Status s = ProbeTcpStoreListener(Options(closes.address()), "k");
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("closed it without answering"));
}

TEST(ProbeTcpStoreListenerTest, OtherBytesAreNotTcpStore) {
  FakeListener http([](int fd) {
    constexpr char kReply[] = "HTTP/1.1 400 Bad Request\r\n\r\n";
    (void)!write(fd, kReply, sizeof(kReply) - 1);
    DrainUntilClosed(fd);
  });
  absl::Status s = ProbeTcpStoreListener(Options(http.address()), "k");
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("not TCPStore replies (\"HTTP/1.1 400"));
}

TEST(ProbeTcpStoreListenerTest, HttpTwoIsAGrpcPort) {
  FakeListener grpc([](int fd) {
    // An empty SETTINGS frame, as a gRPC server sends first.
    constexpr char kSettings[] = {0, 0, 0, 4, 0, 0, 0, 0, 0};
    (void)!write(fd, kSettings, sizeof(kSettings));
    DrainUntilClosed(fd);
  });
  absl::Status s = ProbeTcpStoreListener(Options(grpc.address()), "k");
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("HTTP/2: a gRPC port"));
}

TEST(ProbeTcpStoreListenerTest, APingWithoutTheKeyIsAnotherCohortd) {
  FakeListener other([](int fd) {
    Opening opening;
    if (!ReadOpening(fd, true, &opening)) return;
    const std::string ping = Ping(opening.nonce);
    (void)!write(fd, ping.data(), ping.size());
    DrainUntilClosed(fd);  // The WAIT is never answered.
  });
  absl::Status s = ProbeTcpStoreListener(Options(other.address()), "k");
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("belongs to a different cohortd"));
}

// A TCPStore listener over `store` with keys under `prefix` + namespace:
// answers the PING, and the WAIT once the key exists there (until the
// client hangs up).
std::function<void(int)> ServeStore(Store* store, std::string prefix,
                                    bool with_wait, Opening* seen) {
  return [store, prefix, with_wait, seen](int fd) {
    if (!ReadOpening(fd, with_wait, seen)) return;
    std::string reply = Ping(seen->nonce);
    (void)!write(fd, reply.data(), reply.size());
    if (with_wait) {
      const std::string key =
          absl::StrCat(prefix, seen->name_space, seen->waited_key);
      for (;;) {
        if (absl::StatusOr<bool> there = store->Check({key});
            there.ok() && *there) {
          const char stop =
              static_cast<char>(tcpstore::WaitReply::kStopWaiting);
          (void)!write(fd, &stop, 1);
          break;
        }
        pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, 10) != 0) return;  // The client hung up.
      }
    }
    DrainUntilClosed(fd);
  };
}

TEST(CheckTcpStoreListenerTest, TheSameStoreServesTheKeyWhichIsThenDeleted) {
  InProcessStore store;
  Opening seen;
  auto same =
      std::make_unique<FakeListener>(ServeStore(&store, "jobs/", true, &seen));
  TcpStoreCheckOptions options = Options(same->address());
  options.listener_prefix = "jobs/";
  absl::StatusOr<TcpStoreCheckResult> result =
      CheckTcpStoreListener(store, options);
  same.reset();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(result->same_store);
  EXPECT_THAT(seen.waited_key, ::testing::StartsWith("check-"));
  EXPECT_EQ(*store.NumKeys(), 0);
}

TEST(CheckTcpStoreListenerTest, AnotherStoreIsNotFound) {
  InProcessStore written, served;
  Opening seen;
  FakeListener other(ServeStore(&served, "", true, &seen));
  absl::StatusOr<TcpStoreCheckResult> result =
      CheckTcpStoreListener(written, Options(other.address()));
  EXPECT_TRUE(absl::IsNotFound(result.status())) << result.status();
  EXPECT_EQ(*written.NumKeys(), 0);
}

// A gRPC store whose token may not write the check key.
class ReadOnlyStore final : public Store {
 public:
  absl::Status Set(absl::string_view, absl::string_view) override {
    return absl::PermissionDeniedError("outside the token's prefix");
  }
  absl::StatusOr<std::string> Get(absl::string_view, absl::Duration) override {
    return absl::UnimplementedError("");
  }
  absl::StatusOr<int64_t> Add(absl::string_view, int64_t) override {
    return absl::UnimplementedError("");
  }
  absl::StatusOr<std::string> CompareSet(absl::string_view, absl::string_view,
                                         absl::string_view) override {
    return absl::UnimplementedError("");
  }
  absl::Status Wait(absl::Span<const std::string>, absl::Duration) override {
    return absl::UnimplementedError("");
  }
  absl::StatusOr<bool> Check(absl::Span<const std::string>) override {
    return absl::UnimplementedError("");
  }
  absl::StatusOr<bool> DeleteKey(absl::string_view) override {
    return absl::UnimplementedError("");
  }
  absl::StatusOr<int64_t> NumKeys() override {
    return absl::UnimplementedError("");
  }
  absl::StatusOr<std::vector<std::string>> MultiGet(
      absl::Span<const std::string>, absl::Duration) override {
    return absl::UnimplementedError("");
  }
  absl::Status MultiSet(absl::Span<const std::string>,
                        absl::Span<const std::string>) override {
    return absl::UnimplementedError("");
  }
  absl::Status Append(absl::string_view, absl::string_view) override {
    return absl::UnimplementedError("");
  }
  absl::StatusOr<KeyList> ListKeys(absl::string_view) override {
    return absl::UnimplementedError("");
  }
  absl::StatusOr<std::unique_ptr<WatchHandle>> Watch(absl::string_view, int64_t,
                                                     WatchCallback) override {
    return absl::UnimplementedError("");
  }
};

TEST(CheckTcpStoreListenerTest, AKeyItMayNotWriteLeavesOnlyTheHandshake) {
  ReadOnlyStore store;
  Opening seen;
  auto answers =
      std::make_unique<FakeListener>(ServeStore(&store, "", false, &seen));
  absl::StatusOr<TcpStoreCheckResult> result =
      CheckTcpStoreListener(store, Options(answers->address()));
  answers.reset();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_FALSE(result->same_store);
  EXPECT_THAT(result->unverified, HasSubstr("outside the token's prefix"));
  EXPECT_TRUE(seen.waited_key.empty());
}

TEST(CheckTcpStoreListenerTest, ABadNamespaceIsRefusedBeforeAnything) {
  InProcessStore store;
  TcpStoreCheckOptions options = Options("127.0.0.1:1");
  options.name_space = "no-slashes";
  EXPECT_TRUE(
      absl::IsInvalidArgument(CheckTcpStoreListener(store, options).status()));
  EXPECT_EQ(*store.NumKeys(), 0);
}

}  // namespace
}  // namespace cohort
