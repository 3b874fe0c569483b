// TCPStore queues (QUEUE_PUSH/POP/LEN) against real cohortd processes, byte
// by byte on the wire: a kill -9 and a restart on the same RocksDB data dir
// keep every pushed, unpopped item in push order; the items are store keys
// that gRPC lists and reads; on the etcd engine, two replicas share the
// queues (a push through one wakes a blocked pop on the other, and a
// cohortd killed with -9 comes back to what etcd keeps).
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/remote_store.h"
#include "gtest/gtest.h"
#include "proto/tcpstore/wire.h"
#include "tests/testing/cohortd_process.h"

namespace cohort {
namespace {

using tcpstore::Dialect;
using tcpstore::Op;
using tcpstore::Request;
using testing::CohortdProcess;

constexpr uint8_t kStopWaiting = 0;

// The item keys' layout (store/queue_keys.h), written out: what an
// operator lists, and a test of the layout itself.
std::string ItemPrefix(absl::string_view queue) {
  return absl::StrCat("/cohort/queues/", queue.size(), ":", queue, "/");
}

// A TCPStore connection that has sent VALIDATE, speaking 2.x.
class Wire {
 public:
  explicit Wire(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<struct sockaddr*>(&addr),
                         sizeof(addr)) == 0;
    int one = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    Request v;
    v.op = Op::kValidate;
    v.word = tcpstore::kValidateMagic;
    Send(v);
  }
  ~Wire() { close(fd_); }
  bool connected() const { return connected_; }
  int fd() const { return fd_; }

  void Send(const Request& r) {
    std::string bytes;
    tcpstore::EncodeRequest(Dialect::kTorch21, r, &bytes);
    size_t sent = 0;
    while (sent < bytes.size()) {
      ssize_t n =
          send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return;
      sent += n;
    }
  }
  void Send(Op op, absl::string_view key, absl::string_view value = "") {
    Request r;
    r.op = op;
    r.key = key;
    r.value = value;
    Send(r);
  }
  void Wait(absl::string_view key) {
    Request r;
    r.op = Op::kWait;
    r.keys = {key};
    Send(r);
  }

  // Exactly n bytes; nullopt if they do not come within `give_up`, which
  // only a broken server reaches.
  std::optional<std::string> Read(size_t n,
                                  absl::Duration give_up = absl::Seconds(60)) {
    std::string got;
    const absl::Time deadline = absl::Now() + give_up;
    while (got.size() < n) {
      struct pollfd p = {fd_, POLLIN, 0};
      int ms =
          static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
      if (ms <= 0 || poll(&p, 1, ms) <= 0) return std::nullopt;
      char buf[65536];
      ssize_t r = recv(fd_, buf, std::min(sizeof(buf), n - got.size()), 0);
      if (r <= 0) return std::nullopt;
      got.append(buf, r);
    }
    return got;
  }
  std::optional<int64_t> I64() {
    auto b = Read(8);
    if (!b) return std::nullopt;
    int64_t v = 0;
    tcpstore::Decoder(*b).I64(&v);
    return v;
  }
  std::optional<std::string> Bytes() {
    auto n = I64();
    if (!n) return std::nullopt;
    if (*n == 0) return std::string();
    return Read(*n);
  }
  // QUEUE_LEN: its answer also means every request before it was applied.
  std::optional<int64_t> Len(absl::string_view queue) {
    Send(Op::kQueueLen, queue);
    return I64();
  }
  // QUEUE_POP: the item, "<empty>" when the queue was, nullopt on a broken
  // connection.
  std::optional<std::string> Pop(absl::string_view queue) {
    Send(Op::kQueuePop, queue);
    auto n = I64();
    if (!n) return std::nullopt;
    if (*n == 0) return "<empty>";
    return Bytes();
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

std::unique_ptr<RemoteStore> Grpc(const CohortdProcess& server) {
  RemoteStoreOptions options;
  options.address = server.address();
  auto store = RemoteStore::Connect(options);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? std::move(*store) : nullptr;
}

std::string Item(int i) { return absl::StrCat("item-", i, "-", i * i); }

TEST(QueueDurabilityTest, RocksDbKeepsEveryUnpoppedItemOverKill9InPushOrder) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/queues-rocksdb");
  std::filesystem::remove_all(dir);
  auto server = CohortdProcess::Start({"--data_dir=" + dir});
  ASSERT_TRUE(server.ok()) << server.status();
  constexpr int kItems = 50, kPopped = 10;
  {
    Wire w(server->tcpstore_port());
    ASSERT_TRUE(w.connected());
    for (int i = 0; i < kItems; ++i) w.Send(Op::kQueuePush, "/jobs", Item(i));
    for (const char* item : {"x", "y", "z"}) {
      w.Send(Op::kQueuePush, "/other", item);
    }
    for (int i = 0; i < kPopped; ++i) EXPECT_EQ(w.Pop("/jobs"), Item(i));
    ASSERT_EQ(w.Len("/jobs"), kItems - kPopped);
  }
  // gRPC sees the items as keys in push order, each valued its item.
  auto grpc = Grpc(*server);
  ASSERT_NE(grpc, nullptr);
  auto listed = grpc->ListKeys(ItemPrefix("/jobs"));
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->keys.size(), static_cast<size_t>(kItems - kPopped));
  EXPECT_EQ(grpc->Get(listed->keys.front(), absl::Seconds(10)).value_or("?"),
            Item(kPopped));
  EXPECT_EQ(grpc->Get(listed->keys.back(), absl::Seconds(10)).value_or("?"),
            Item(kItems - 1));
  // Queues are not keys to num_keys, through either protocol.
  EXPECT_EQ(grpc->NumKeys().value_or(-1), 0);
  // Clients cannot write there.
  EXPECT_EQ(grpc->Set(listed->keys.front(), "forged").code(),
            absl::StatusCode::kPermissionDenied);
  grpc.reset();

  const int port = server->port();
  const int tcpstore_port = server->tcpstore_port();
  EXPECT_EQ(WTERMSIG(server->Stop(SIGKILL)), SIGKILL);
  auto restarted = CohortdProcess::Start(
      {"--data_dir=" + dir,
       absl::StrCat("--tcpstore_listen=127.0.0.1:", tcpstore_port)},
      port);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  Wire w(restarted->tcpstore_port());
  EXPECT_EQ(w.Len("/jobs"), kItems - kPopped);
  EXPECT_EQ(w.Len("/other"), 3);
  for (int i = kPopped; i < kItems; ++i) EXPECT_EQ(w.Pop("/jobs"), Item(i));
  EXPECT_EQ(w.Pop("/jobs"), "<empty>");
  // A push after the restart queues behind what was kept.
  w.Send(Op::kQueuePush, "/other", "after");
  for (const char* item : {"x", "y", "z", "after"}) {
    EXPECT_EQ(w.Pop("/other"), item);
  }
}

// A free TCP port on loopback (for etcd, which cannot pick its own).
int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<struct sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<struct sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// One etcd member (Debian's etcd-server) on loopback, killed at the end.
class Etcd {
 public:
  explicit Etcd(const std::string& dir) {
    client_port_ = FreePort();
    const int peer_port = FreePort();
    const std::string client = absl::StrCat("http://127.0.0.1:", client_port_);
    const std::string peer = absl::StrCat("http://127.0.0.1:", peer_port);
    std::vector<std::string> args = {"etcd",
                                     "--name=e0",
                                     "--data-dir=" + dir,
                                     "--listen-client-urls=" + client,
                                     "--advertise-client-urls=" + client,
                                     "--listen-peer-urls=" + peer,
                                     "--initial-advertise-peer-urls=" + peer,
                                     "--initial-cluster=e0=" + peer};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    // Its log goes beside its data, not into the test's output.
    std::filesystem::create_directories(dir);
    const std::string log = dir + ".log";
    pid_ = fork();
    if (pid_ == 0) {
      int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, STDOUT_FILENO);
        dup2(fd, STDERR_FILENO);
      }
      execvp("etcd", argv.data());
      _exit(127);
    }
  }
  ~Etcd() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  std::string endpoint() const {
    return absl::StrCat("127.0.0.1:", client_port_);
  }

 private:
  pid_t pid_ = -1;
  int client_port_ = 0;
};

TEST(QueueDurabilityTest, EtcdReplicasShareQueuesAndKeepThemOverKill9) {
  ASSERT_EQ(system("command -v etcd >/dev/null"), 0)
      << "no etcd: run tools/setup.sh (Debian's etcd-server)";
  const std::string dir = absl::StrCat(::testing::TempDir(), "/queues-etcd");
  std::filesystem::remove_all(dir);
  Etcd etcd(dir);
  const std::vector<std::string> flags = {"--engine=etcd",
                                          "--etcd_endpoints=" + etcd.endpoint(),
                                          "--election_ttl=2s"};
  auto a = CohortdProcess::Start(flags);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = CohortdProcess::Start(flags);
  ASSERT_TRUE(b.ok()) << b.status();

  // Two blocked pops on replica b; one push through replica a wakes one.
  Wire on_a(a->tcpstore_port());
  Wire waiter1(b->tcpstore_port()), waiter2(b->tcpstore_port());
  waiter1.Wait("/jobs");
  waiter2.Wait("/jobs");
  // Both WAITs are parked once a later request on b is answered.
  Wire probe(b->tcpstore_port());
  ASSERT_EQ(probe.Len("/jobs"), 0);
  on_a.Send(Op::kQueuePush, "/jobs", "j0");
  struct pollfd woke[2] = {{waiter1.fd(), POLLIN, 0},
                           {waiter2.fd(), POLLIN, 0}};
  ASSERT_GT(poll(woke, 2, 60000), 0) << "the push through a woke no waiter";
  Wire& woken = (woke[0].revents & POLLIN) != 0 ? waiter1 : waiter2;
  Wire& other = &woken == &waiter1 ? waiter2 : waiter1;
  ASSERT_EQ(woken.Read(1), std::string(1, kStopWaiting));
  EXPECT_EQ(woken.Pop("/jobs"), "j0");
  for (const char* item : {"j1", "j2", "j3"}) {
    on_a.Send(Op::kQueuePush, "/jobs", item);
  }
  ASSERT_EQ(on_a.Len("/jobs"), 3);
  ASSERT_EQ(other.Read(1), std::string(1, kStopWaiting));
  EXPECT_EQ(other.Pop("/jobs"), "j1");

  // gRPC on either replica lists the items left.
  auto grpc = Grpc(*b);
  ASSERT_NE(grpc, nullptr);
  auto listed = grpc->ListKeys(ItemPrefix("/jobs"));
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->keys.size(), 2u);
  EXPECT_EQ(grpc->Get(listed->keys.front(), absl::Seconds(10)).value_or("?"),
            "j2");

  // Replica a killed and restarted: the queue is what etcd kept.
  const int port = a->port();
  const int tcpstore_port = a->tcpstore_port();
  a->Stop(SIGKILL);
  std::vector<std::string> again = flags;
  again.push_back(absl::StrCat("--tcpstore_listen=127.0.0.1:", tcpstore_port));
  auto restarted = CohortdProcess::Start(again, port);
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  Wire w(restarted->tcpstore_port());
  EXPECT_EQ(w.Len("/jobs"), 2);
  EXPECT_EQ(w.Pop("/jobs"), "j2");
  EXPECT_EQ(probe.Pop("/jobs"), "j3");
  EXPECT_EQ(w.Pop("/jobs"), "<empty>");
}

}  // namespace
}  // namespace cohort
