// TcpStoreProxy against a fake cohortd that records each connection's
// namespace hello and echoes what follows. The real listener behind the
// proxy, with PyTorch's clients, is tests/interop/torch_cohortrun_test.sh.
#include "worker/launch/tcpstore_proxy.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "proto/tcpstore/wire.h"

namespace cohort {
namespace {

int Bound(int* port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return fd;
}

int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
}

void SendAll(int fd, const std::string& bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n =
        send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;
    sent += n;
  }
}

// Exactly n bytes, or what arrived before EOF or the timeout.
std::string Receive(int fd, size_t n,
                    absl::Duration timeout = absl::Seconds(5)) {
  std::string got;
  const absl::Time deadline = absl::Now() + timeout;
  char buf[65536];
  while (got.size() < n) {
    pollfd p = {fd, POLLIN, 0};
    const int ms =
        static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (ms <= 0 || poll(&p, 1, ms) <= 0) break;
    const ssize_t r = recv(fd, buf, std::min(sizeof(buf), n - got.size()), 0);
    if (r <= 0) break;
    got.append(buf, r);
  }
  return got;
}

// Whether the peer closed fd within the timeout (reading what comes).
bool Closed(int fd, absl::Duration timeout = absl::Seconds(5)) {
  const absl::Time deadline = absl::Now() + timeout;
  char buf[4096];
  for (;;) {
    pollfd p = {fd, POLLIN, 0};
    const int ms =
        static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (ms <= 0 || poll(&p, 1, ms) <= 0) return false;
    if (recv(fd, buf, sizeof(buf), 0) <= 0) return true;
  }
}

// A stand-in for cohortd's TCPStore listener: reads each connection's
// hello, then echoes every byte until the proxy closes the connection, or
// closes it itself on "bye".
class FakeCohortd {
 public:
  // Bound at once; accepting only from Listen().
  FakeCohortd() { fd_ = Bound(&port_); }
  ~FakeCohortd() {
    shutdown(fd_, SHUT_RDWR);
    close(fd_);
    if (acceptor_.joinable()) acceptor_.join();
    for (std::thread& t : connections_) t.join();
  }

  int port() const { return port_; }
  void Listen() {
    ASSERT_EQ(listen(fd_, 64), 0);
    acceptor_ = std::thread([this] {
      for (;;) {
        const int fd = accept(fd_, nullptr, nullptr);
        if (fd < 0) return;
        absl::MutexLock lock(&mu_);
        connections_.emplace_back([this, fd] { Serve(fd); });
      }
    });
  }

  std::vector<std::string> namespaces() {
    absl::MutexLock lock(&mu_);
    return namespaces_;
  }
  // What each closed connection sent after its hello, in closing order,
  // once `n` have closed (fewer if they have not after 30 s: a proxy that
  // never closes them).
  std::vector<std::string> Finished(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return finished_.size() >= n;
    };
    mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(30));
    return finished_;
  }

 private:
  void Serve(int fd) {
    std::string in;
    std::string received;
    size_t echoed = 0;
    char buf[65536];
    bool greeted = false;
    for (;;) {
      const ssize_t n = recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) break;
      if (greeted) {
        received.append(buf, n);
      } else {
        in.append(buf, n);
        absl::string_view name_space;
        tcpstore::ParseResult hello =
            tcpstore::ParseNamespaceHello(in, &name_space);
        if (hello.status == tcpstore::ParseStatus::kIncomplete) continue;
        EXPECT_EQ(hello.status, tcpstore::ParseStatus::kComplete);
        {
          absl::MutexLock lock(&mu_);
          namespaces_.emplace_back(name_space);
        }
        greeted = true;
        received = in.substr(hello.size);
      }
      if (absl::EndsWith(received, "bye")) break;
      SendAll(fd, received.substr(echoed));
      echoed = received.size();
    }
    close(fd);
    absl::MutexLock lock(&mu_);
    finished_.push_back(received);
  }

  int fd_ = -1;
  int port_ = 0;
  std::thread acceptor_;
  absl::Mutex mu_;
  std::vector<std::thread> connections_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> namespaces_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> finished_ ABSL_GUARDED_BY(mu_);
};

class TcpStoreProxyTest : public ::testing::Test {
 protected:
  std::unique_ptr<TcpStoreProxy> StartProxy(
      absl::Duration connect_timeout = absl::Seconds(5)) {
    auto proxy = TcpStoreProxy::Start(
        {.upstream = absl::StrCat("127.0.0.1:", cohortd_.port()),
         .name_space = "/cohortrun/job/0/",
         .connect_timeout = connect_timeout,
         .log = [this](absl::string_view line) {
           absl::MutexLock lock(&mu_);
           log_.emplace_back(line);
         }});
    EXPECT_TRUE(proxy.ok()) << proxy.status();
    return proxy.ok() ? *std::move(proxy) : nullptr;
  }

  std::string Log() {
    absl::MutexLock lock(&mu_);
    return absl::StrJoin(log_, "\n");
  }

  FakeCohortd cohortd_;
  absl::Mutex mu_;
  std::vector<std::string> log_ ABSL_GUARDED_BY(mu_);
};

TEST_F(TcpStoreProxyTest, SplicesBothWaysAfterTheHello) {
  cohortd_.Listen();
  auto proxy = StartProxy();
  const int fd = Connect(proxy->port());
  SendAll(fd, "ping");
  EXPECT_EQ(Receive(fd, 4), "ping");
  EXPECT_EQ(cohortd_.namespaces(),
            std::vector<std::string>{"/cohortrun/job/0/"});

  // 16 MiB each way while the client writes and reads at once: nothing is
  // lost, reordered or held back.
  std::string big(16 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 31);
  std::thread writer([&] { SendAll(fd, big); });
  const std::string back = Receive(fd, big.size(), absl::Seconds(30));
  writer.join();
  EXPECT_TRUE(back == big) << back.size() << " of " << big.size();
  EXPECT_EQ(proxy->stats().open, 1u);
  // The proxy counts a chunk after splice() returns, which can be just after
  // the client has read it: wait for the counter rather than race it.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (proxy->stats().bytes_down < 4 + big.size() && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(proxy->stats().bytes_down, 4 + big.size());
  close(fd);
  EXPECT_EQ(cohortd_.Finished(1).size(), 1u);
}

TEST_F(TcpStoreProxyTest, SetNamespaceBindsNewConnectionsOnly) {
  cohortd_.Listen();
  auto proxy = StartProxy();
  const int first = Connect(proxy->port());
  SendAll(first, "a");
  EXPECT_EQ(Receive(first, 1), "a");
  ASSERT_TRUE(proxy->SetNamespace("/cohortrun/job/1/").ok());
  const int second = Connect(proxy->port());
  SendAll(second, "b");
  EXPECT_EQ(Receive(second, 1), "b");
  SendAll(first, "c");
  EXPECT_EQ(Receive(first, 1), "c");
  EXPECT_EQ(
      cohortd_.namespaces(),
      (std::vector<std::string>{"/cohortrun/job/0/", "/cohortrun/job/1/"}));
  absl::Status bad = proxy->SetNamespace("/cohort/runs/");
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.message(), "reserved")) << bad;
  close(first);
  close(second);
}

TEST_F(TcpStoreProxyTest, ClosingEitherSideClosesTheOther) {
  cohortd_.Listen();
  auto proxy = StartProxy();
  // A worker that writes and exits at once: its bytes still reach cohortd,
  // then cohortd's side closes.
  const int quick = Connect(proxy->port());
  SendAll(quick, "last words");
  close(quick);
  EXPECT_EQ(cohortd_.Finished(1), std::vector<std::string>{"last words"});
  // cohortd closing (here on "bye") closes the worker's connection.
  const int fd = Connect(proxy->port());
  SendAll(fd, "bye");
  EXPECT_TRUE(Closed(fd));
  close(fd);
  // The proxy notices the close on its own thread: wait for it (giving up
  // after 30 s only so that a proxy that never does fails here).
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (proxy->stats().open > 0 && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_EQ(proxy->stats().open, 0u);
  EXPECT_EQ(proxy->stats().accepted, 2u);
}

TEST_F(TcpStoreProxyTest, WaitsForCohortdToListen) {
  // A connect timeout longer than the test: the proxy waits, however long
  // this thread takes to start listening.
  auto proxy = StartProxy(absl::Minutes(10));
  // cohortd's port refuses connections for a while (cohortd restarting);
  // what the worker sends meanwhile waits in its socket.
  const int fd = Connect(proxy->port());
  SendAll(fd, "early");
  absl::SleepFor(absl::Milliseconds(300));
  cohortd_.Listen();
  EXPECT_EQ(Receive(fd, 5), "early");
  EXPECT_EQ(cohortd_.namespaces(),
            std::vector<std::string>{"/cohortrun/job/0/"});
  close(fd);
}

TEST_F(TcpStoreProxyTest, GivesUpAfterConnectTimeoutAndSaysWhy) {
  auto proxy = StartProxy(absl::Milliseconds(300));
  const int fd = Connect(proxy->port());
  EXPECT_TRUE(Closed(fd));
  close(fd);
  EXPECT_EQ(proxy->stats().refused, 1u);
  EXPECT_TRUE(absl::StrContains(
      Log(), absl::StrCat("cannot reach cohortd's TCPStore listener at "
                          "127.0.0.1:",
                          cohortd_.port(), " (Connection refused)")))
      << Log();
}

TEST(TcpStoreProxyStartTest, RefusesBadOptions) {
  TcpStoreProxyOptions options;
  options.upstream = "127.0.0.1:29400";
  options.name_space = "job";
  EXPECT_EQ(TcpStoreProxy::Start(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.name_space = "/job/";
  options.upstream = "no-port";
  EXPECT_EQ(TcpStoreProxy::Start(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.upstream = "127.0.0.1:29400";
  auto first = TcpStoreProxy::Start(options);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_GT((*first)->port(), 0);
  options.listen = absl::StrCat("127.0.0.1:", (*first)->port());
  absl::Status taken = TcpStoreProxy::Start(options).status();
  EXPECT_EQ(taken.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(taken.message(), "Address already in use"))
      << taken;
}

}  // namespace
}  // namespace cohort
