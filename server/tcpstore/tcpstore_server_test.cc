// TcpStoreServer byte by byte: every query of both dialects, written from
// the protocol's facts (no PyTorch 2.1+ client is installable here; the 1.13
// client is driven for real by tests/interop/torch_interop_test.sh), deferred
// replies, the CANCEL_WAIT race, bad input and a client that never reads.
#include "server/tcpstore/tcpstore_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "proto/tcpstore/wire.h"
#include "server/auth/quota.h"
#include "store/kv_engine.h"
#include "store/kv_store.h"
#include "store/queue_keys.h"

namespace cohort::server {
namespace {

using tcpstore::Dialect;
using tcpstore::Encoder;
using tcpstore::Op;
using tcpstore::Request;

// A raw client socket: bytes in, bytes out, nothing interpreted.
class Wire {
 public:
  // Connects to `host` (an IPv4 address, loopback by default).
  explicit Wire(int port, uint32_t host = INADDR_LOOPBACK) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(host);
    connected_ = connect(fd_, reinterpret_cast<struct sockaddr*>(&addr),
                         sizeof(addr)) == 0;
    int one = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  ~Wire() { close(fd_); }
  bool connected() const { return connected_; }
  int fd() const { return fd_; }

  void Send(const std::string& bytes) {
    size_t sent = 0;
    while (sent < bytes.size()) {
      ssize_t n =
          send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return;
      sent += n;
    }
  }
  // Sends one request in `dialect`.
  void Send(Dialect dialect, const Request& r) {
    std::string out;
    tcpstore::EncodeRequest(dialect, r, &out);
    Send(out);
  }
  // Exactly n bytes, or nullopt if they do not arrive within `timeout`.
  std::optional<std::string> Read(size_t n,
                                  absl::Duration timeout = absl::Seconds(5)) {
    std::string got;
    const absl::Time deadline = absl::Now() + timeout;
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
  // Whether the server closed the connection within `timeout`.
  bool Closed(absl::Duration timeout = absl::Seconds(5)) {
    const absl::Time deadline = absl::Now() + timeout;
    for (;;) {
      struct pollfd p = {fd_, POLLIN, 0};
      int ms =
          static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
      if (ms <= 0 || poll(&p, 1, ms) <= 0) return false;
      char buf[4096];
      ssize_t r = recv(fd_, buf, sizeof(buf), 0);
      if (r <= 0) return true;
    }
  }
  // Whether bytes are waiting to be read (without reading them); gives up
  // after `give_up`, which only a broken server reaches.
  bool Readable(absl::Duration give_up = absl::Seconds(30)) {
    struct pollfd p = {fd_, POLLIN, 0};
    return poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(give_up))) ==
           1;
  }
  // Nothing arrives within `quiet`.
  bool Silent(absl::Duration quiet = absl::Milliseconds(200)) {
    struct pollfd p = {fd_, POLLIN, 0};
    return poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(quiet))) == 0;
  }

  std::optional<uint8_t> U8() {
    auto b = Read(1);
    if (!b) return std::nullopt;
    return static_cast<uint8_t>((*b)[0]);
  }
  std::optional<int64_t> I64() {
    auto b = Read(8);
    if (!b) return std::nullopt;
    tcpstore::Decoder d(*b);
    int64_t v = 0;
    d.I64(&v);
    return v;
  }
  std::optional<std::string> Bytes() {
    auto n = I64();
    if (!n) return std::nullopt;
    if (*n == 0) return std::string();
    return Read(*n);
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

Request Q(Op op, absl::string_view key = "", absl::string_view value = "") {
  Request r;
  r.op = op;
  r.key = key;
  r.value = value;
  return r;
}

Request Keys(Op op, std::vector<absl::string_view> keys) {
  Request r;
  r.op = op;
  r.keys = std::move(keys);
  return r;
}

// Sends VALIDATE and a PING on `w`; whether the PING was echoed (a
// connection the server closed answers nothing).
bool Pings(Wire& w) {
  Request v = Q(Op::kValidate);
  v.word = tcpstore::kValidateMagic;
  w.Send(Dialect::kTorch21, v);
  Request ping = Q(Op::kPing);
  ping.word = 77;
  w.Send(Dialect::kTorch21, ping);
  return w.Read(4).has_value();
}

constexpr uint8_t kStopWaiting = 0;
constexpr uint8_t kWaitCanceled = 1;

class TcpStoreServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store::StoreLimits limits;
    limits.max_key_bytes = 1024;
    limits.max_value_bytes = 1 << 20;
    store_ = std::make_unique<store::KvStore>(store::NewMemoryEngine(), limits);
    auto server = TcpStoreServer::Start(store_.get(),
                                        {.listen = "127.0.0.1:0",
                                         .max_request_bytes = 8 << 20,
                                         .max_unsent_bytes = 1 << 20,
                                         .log =
                                             [this](absl::string_view line) {
                                               absl::MutexLock lock(&mu_);
                                               log_.emplace_back(line);
                                             },
                                         .log_every = absl::ZeroDuration()});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }
  void TearDown() override {
    server_.reset();
    store_.reset();
  }

  // A connection that has sent VALIDATE (and a PING to prove it).
  std::unique_ptr<Wire> Validated() {
    auto w = std::make_unique<Wire>(server_->port());
    Request v = Q(Op::kValidate);
    v.word = tcpstore::kValidateMagic;
    w->Send(Dialect::kTorch21, v);
    Request ping = Q(Op::kPing);
    ping.word = 0xABCD1234;
    w->Send(Dialect::kTorch21, ping);
    auto echo = w->Read(4);
    EXPECT_TRUE(echo.has_value());
    if (echo) {
      uint32_t got = 0;
      tcpstore::Decoder(*echo).U32(&got);
      EXPECT_EQ(got, 0xABCD1234u);
    }
    return w;
  }

  // A connection bound to `name_space` by a hello, speaking 2.1+.
  std::unique_ptr<Wire> InNamespace(absl::string_view name_space) {
    auto w = std::make_unique<Wire>(server_->port());
    std::string hello;
    tcpstore::EncodeNamespaceHello(name_space, &hello);
    Request v = Q(Op::kValidate);
    v.word = tcpstore::kValidateMagic;
    tcpstore::EncodeRequest(Dialect::kTorch21, v, &hello);
    w->Send(hello);
    return w;
  }

  // Polls until `done()` holds; false once `give_up` passed (a broken
  // server: the caller's assertion then fails rather than the test hang).
  template <typename Condition>
  static bool Eventually(Condition done,
                         absl::Duration give_up = absl::Seconds(30)) {
    const absl::Time until = absl::Now() + give_up;
    while (!done()) {
      if (absl::Now() > until) return false;
      absl::SleepFor(absl::Microseconds(200));
    }
    return true;
  }

  // Until `n` connections are blocked in WAIT or BARRIER: the server has
  // taken the requests before them.
  bool Blocked(size_t n) {
    return Eventually([&] { return server_->stats().blocked == n; });
  }

  bool LogMentions(absl::string_view a, absl::string_view b = "") {
    absl::MutexLock lock(&mu_);
    for (const std::string& line : log_) {
      if (absl::StrContains(line, a) && absl::StrContains(line, b)) {
        return true;
      }
    }
    return false;
  }

  std::unique_ptr<store::KvStore> store_;
  std::unique_ptr<TcpStoreServer> server_;
  absl::Mutex mu_;
  std::vector<std::string> log_ ABSL_GUARDED_BY(mu_);
};

TEST_F(TcpStoreServerTest, Torch21EveryKeyValueQuery) {
  auto w = Validated();
  const Dialect d = Dialect::kTorch21;
  w->Send(d, Q(Op::kSet, "/a", "alpha"));
  w->Send(d, Q(Op::kGet, "/a"));
  EXPECT_EQ(w->Bytes(), "alpha");
  // The key is the store's, seen as gRPC would see it.
  EXPECT_EQ(*store_->TryGet("/a"), std::optional<std::string>("alpha"));

  Request add = Q(Op::kAdd, "/n");
  add.number = 5;
  w->Send(d, add);
  EXPECT_EQ(w->I64(), 5);
  add.number = -2;
  w->Send(d, add);
  EXPECT_EQ(w->I64(), 3);
  w->Send(d, Q(Op::kGet, "/n"));
  EXPECT_EQ(w->Bytes(), "3");  // Counters are decimal text.

  // compare_set's four cases.
  Request cas = Q(Op::kCompareSet, "/c", "v1");
  cas.expected = "";
  w->Send(d, cas);
  EXPECT_EQ(w->Bytes(), "v1");  // Missing, expected empty: written.
  cas.expected = "nope";
  cas.value = "v2";
  w->Send(d, cas);
  EXPECT_EQ(w->Bytes(), "v1");  // Mismatch: the current value.
  cas.expected = "v1";
  w->Send(d, cas);
  EXPECT_EQ(w->Bytes(), "v2");  // Match: the new value.
  cas = Q(Op::kCompareSet, "/missing", "d");
  cas.expected = "guess";
  w->Send(d, cas);
  EXPECT_EQ(w->Bytes(), "guess");  // Missing, expected given: no write.
  EXPECT_EQ(*store_->TryGet("/missing"), std::nullopt);

  w->Send(d, Keys(Op::kCheck, {"/a", "/n"}));
  EXPECT_EQ(w->U8(), 0);  // READY
  w->Send(d, Keys(Op::kCheck, {"/a", "/missing"}));
  EXPECT_EQ(w->U8(), 1);  // NOT_READY

  w->Send(d, Q(Op::kNumKeys));
  EXPECT_EQ(w->I64(), 3);
  w->Send(d, Q(Op::kDeleteKey, "/c"));
  EXPECT_EQ(w->I64(), 1);
  w->Send(d, Q(Op::kDeleteKey, "/c"));
  EXPECT_EQ(w->I64(), 0);

  w->Send(d, Q(Op::kAppend, "/log", "x"));
  w->Send(d, Q(Op::kAppend, "/log", "yz"));
  Request mset = Keys(Op::kMultiSet, {"/m1", "/m2"});
  mset.values = {"one", ""};
  w->Send(d, mset);
  w->Send(d, Keys(Op::kMultiGet, {"/log", "/m1", "/m2"}));
  EXPECT_EQ(w->Bytes(), "xyz");
  EXPECT_EQ(w->Bytes(), "one");
  EXPECT_EQ(w->Bytes(), "");

  // GET of a missing key answers empty in 2.1+ (as the libuv server does).
  w->Send(d, Q(Op::kGet, "/absent"));
  EXPECT_EQ(w->Bytes(), "");

  w->Send(d, Q(Op::kListKeys));
  EXPECT_EQ(w->I64(), 5);
  std::vector<std::string> keys;
  for (int i = 0; i < 5; ++i) keys.push_back(w->Bytes().value_or("?"));
  std::sort(keys.begin(), keys.end());
  EXPECT_EQ(keys, (std::vector<std::string>{"/a", "/log", "/m1", "/m2", "/n"}));
  EXPECT_TRUE(w->Silent());
}

TEST_F(TcpStoreServerTest, Torch21WaitIsDeferredUntilAnyWriterSetsTheKeys) {
  auto waiter = Validated();
  auto writer = Validated();
  waiter->Send(Dialect::kTorch21, Keys(Op::kWait, {"/w1", "/w2"}));
  EXPECT_TRUE(waiter->Silent());
  writer->Send(Dialect::kTorch21, Q(Op::kSet, "/w1", "1"));
  EXPECT_TRUE(waiter->Silent());
  // The second key comes through the store directly, as a gRPC Set would.
  ASSERT_TRUE(store_->Set("/w2", "2").ok());
  EXPECT_EQ(waiter->U8(), kStopWaiting);
  // Requests sent behind a wait are answered after it, in order.
  waiter->Send(Dialect::kTorch21, Keys(Op::kWait, {"/w3"}));
  waiter->Send(Dialect::kTorch21, Q(Op::kGet, "/w3"));
  EXPECT_TRUE(waiter->Silent());
  writer->Send(Dialect::kTorch21, Q(Op::kSet, "/w3", "three"));
  EXPECT_EQ(waiter->U8(), kStopWaiting);
  EXPECT_EQ(waiter->Bytes(), "three");
}

TEST_F(TcpStoreServerTest, SetsWithoutRepliesAreCommittedWithNothingAfter) {
  // SETs have no reply and may share a commit, but none waits for another
  // request to carry it: each reaches the store (and its write-ahead log)
  // on its own, with nothing sent after it. (How soon is bench/'s to say.)
  auto w = Validated();
  for (int i = 0; i < 3; ++i) {
    const std::string key = absl::StrCat("/quiet", i);
    w->Send(Dialect::kTorch21, Q(Op::kSet, key, "v"));
    EXPECT_TRUE(Eventually([&] { return store_->TryGet(key)->has_value(); }))
        << key << " was never committed";
  }
  // A stream of SETs, then a request with a reply on the same connection:
  // every SET is in the store before that reply is sent.
  std::string stream;
  for (int i = 0; i < 2000; ++i) {
    const std::string key = absl::StrCat("/s", i);
    tcpstore::EncodeRequest(Dialect::kTorch21, Q(Op::kSet, key, "x"), &stream);
  }
  Request ping = Q(Op::kPing);
  ping.word = 7;
  tcpstore::EncodeRequest(Dialect::kTorch21, ping, &stream);
  w->Send(stream);
  ASSERT_TRUE(w->Read(4).has_value());
  for (int i = 0; i < 2000; ++i) {
    ASSERT_TRUE(store_->TryGet(absl::StrCat("/s", i))->has_value()) << i;
  }
}

TEST_F(TcpStoreServerTest, CancelWaitIsAlwaysAnsweredWithWaitCanceled) {
  auto w = Validated();
  const Dialect d = Dialect::kTorch21;
  // A pending wait: cancelled, and a later write does not answer it.
  w->Send(d, Keys(Op::kWait, {"/never"}));
  EXPECT_TRUE(w->Silent());
  w->Send(d, Q(Op::kCancelWait));
  EXPECT_EQ(w->U8(), kWaitCanceled);
  ASSERT_TRUE(store_->Set("/never", "now").ok());
  EXPECT_TRUE(w->Silent());
  // No wait at all.
  w->Send(d, Q(Op::kCancelWait));
  EXPECT_EQ(w->U8(), kWaitCanceled);
  // The race: the wait completes just before the cancel arrives. The
  // client then reads STOP_WAITING followed by WAIT_CANCELED. (The cancel
  // is sent once STOP_WAITING is in the client's socket.)
  w->Send(d, Keys(Op::kWait, {"/race"}));
  ASSERT_TRUE(store_->Set("/race", "x").ok());
  ASSERT_TRUE(w->Readable()) << "the completed wait was never answered";
  w->Send(d, Q(Op::kCancelWait));
  EXPECT_EQ(w->U8(), kStopWaiting);
  EXPECT_EQ(w->U8(), kWaitCanceled);
  // Wait and cancel in one write, racing a writer on another thread: the
  // answer is one of the two valid sequences, and the connection stays
  // usable.
  for (int i = 0; i < 50; ++i) {
    const std::string key = absl::StrCat("/r", i);
    std::string both;
    tcpstore::EncodeRequest(d, Keys(Op::kWait, {key}), &both);
    tcpstore::EncodeRequest(d, Q(Op::kCancelWait), &both);
    std::thread writer([&] { ASSERT_TRUE(store_->Set(key, "v").ok()); });
    w->Send(both);
    writer.join();
    auto first = w->U8();
    ASSERT_TRUE(first.has_value());
    if (*first == kStopWaiting)
      EXPECT_EQ(w->U8(), kWaitCanceled);
    else
      EXPECT_EQ(*first, kWaitCanceled);
    w->Send(d, Q(Op::kGet, key));
    EXPECT_EQ(w->Bytes(), "v");
  }
}

TEST_F(TcpStoreServerTest, BarrierReleasesEveryoneWhenTheLastArrives) {
  std::vector<std::unique_ptr<Wire>> ranks;
  Request barrier = Q(Op::kBarrier, "/b");
  barrier.number = 3;
  for (int i = 0; i < 2; ++i) {
    ranks.push_back(Validated());
    ranks.back()->Send(Dialect::kTorch21, barrier);
  }
  for (auto& r : ranks) EXPECT_TRUE(r->Silent());
  ranks.push_back(Validated());
  ranks.back()->Send(Dialect::kTorch21, barrier);
  for (auto& r : ranks) EXPECT_EQ(r->U8(), kStopWaiting);
  EXPECT_EQ(*store_->TryGet("/b"), std::optional<std::string>("3"));
  // A barrier can also be completed by adds from elsewhere (gRPC Add).
  barrier = Q(Op::kBarrier, "/b2");
  barrier.number = 2;
  ranks[0]->Send(Dialect::kTorch21, barrier);
  EXPECT_TRUE(ranks[0]->Silent());
  ASSERT_TRUE(store_->Add("/b2", 1).ok());
  EXPECT_EQ(ranks[0]->U8(), kStopWaiting);
  // And cancelled.
  barrier = Q(Op::kBarrier, "/b3");
  barrier.number = 5;
  ranks[1]->Send(Dialect::kTorch21, barrier);
  ranks[1]->Send(Dialect::kTorch21, Q(Op::kCancelWait));
  EXPECT_EQ(ranks[1]->U8(), kWaitCanceled);
}

TEST_F(TcpStoreServerTest, QueuesPushPopAndWakeOneWaiter) {
  auto producer = Validated();
  auto a = Validated();
  auto b = Validated();
  const Dialect d = Dialect::kTorch21;
  producer->Send(d, Q(Op::kQueueLen, "/q"));
  EXPECT_EQ(producer->I64(), 0);
  producer->Send(d, Q(Op::kQueuePop, "/q"));
  EXPECT_EQ(producer->I64(), 0);  // Empty: no bytes follow.
  // Two blocking pops (WAIT, as the client does first); one push wakes one.
  a->Send(d, Keys(Op::kWait, {"/q"}));
  b->Send(d, Keys(Op::kWait, {"/q"}));
  ASSERT_TRUE(Blocked(2)) << "the two WAITs never blocked";
  producer->Send(d, Q(Op::kQueuePush, "/q", "job1"));
  // Whichever is answered first is the one woken; the other stays blocked.
  struct pollfd woke[2] = {{a->fd(), POLLIN, 0}, {b->fd(), POLLIN, 0}};
  ASSERT_GT(poll(woke, 2, 30000), 0) << "the push woke neither waiter";
  const bool a_woke = (woke[0].revents & POLLIN) != 0;
  Wire& woken = a_woke ? *a : *b;
  Wire& other = a_woke ? *b : *a;
  EXPECT_EQ(woken.U8(), kStopWaiting);
  EXPECT_TRUE(other.Silent()) << "one push woke both waiters";
  woken.Send(d, Q(Op::kQueuePop, "/q"));
  EXPECT_EQ(woken.I64(), 1);
  EXPECT_EQ(woken.Bytes(), "job1");
  producer->Send(d, Q(Op::kQueuePush, "/q", "job2"));
  EXPECT_EQ(other.U8(), kStopWaiting);
  producer->Send(d, Q(Op::kQueuePush, "/q", "job3"));
  producer->Send(d, Q(Op::kQueueLen, "/q"));
  EXPECT_EQ(producer->I64(), 2);
  // check() counts a non-empty queue as an existing key.
  producer->Send(d, Keys(Op::kCheck, {"/q"}));
  EXPECT_EQ(producer->U8(), 0);
  other.Send(d, Q(Op::kQueuePop, "/q"));
  EXPECT_EQ(other.I64(), 2);
  EXPECT_EQ(other.Bytes(), "job2");
}

TEST_F(TcpStoreServerTest, QueueItemsAreStoreKeysThatTorchsQueriesLeaveOut) {
  const Dialect d = Dialect::kTorch21;
  auto w = Validated();
  w->Send(d, Q(Op::kQueuePush, "/q", "a"));
  w->Send(d, Q(Op::kQueuePush, "/q", "b"));
  w->Send(d, Q(Op::kQueueLen, "/q"));
  EXPECT_EQ(w->I64(), 2);
  // In the store, where gRPC reads them: one key per item, in push order.
  auto items = store_->ListKeys(store::QueueItemPrefix("/q"), 0, "");
  ASSERT_TRUE(items.ok()) << items.status();
  ASSERT_EQ(items->keys.size(), 2u);
  EXPECT_EQ(*store_->TryGet(items->keys[0]), std::optional<std::string>("a"));
  EXPECT_EQ(*store_->TryGet(items->keys[1]), std::optional<std::string>("b"));
  // Queues are not keys to GETNUMKEYS, LIST_KEYS and GET.
  w->Send(d, Q(Op::kSet, "/k", "v"));
  w->Send(d, Q(Op::kNumKeys));
  EXPECT_EQ(w->I64(), 1);
  w->Send(d, Q(Op::kListKeys));
  EXPECT_EQ(w->I64(), 1);
  EXPECT_EQ(w->Bytes(), "/k");
  w->Send(d, Q(Op::kGet, "/q"));
  EXPECT_EQ(w->Bytes(), "");
  // A push through the store (another replica's, say) queues behind.
  ASSERT_TRUE(store_->QueuePush("/q", "c").ok());
  for (const char* want : {"a", "b", "c"}) {
    w->Send(d, Q(Op::kQueuePop, "/q"));
    EXPECT_GT(w->I64().value_or(0), 0);
    EXPECT_EQ(w->Bytes(), want);
  }
  w->Send(d, Q(Op::kQueuePop, "/q"));
  EXPECT_EQ(w->I64(), 0);
  EXPECT_EQ(store_->queue_stats().items, 0);
  // A namespaced connection's queue is the namespace's.
  auto ns = InNamespace("/job/a/");
  ns->Send(d, Q(Op::kQueuePush, "/q", "mine"));
  ns->Send(d, Q(Op::kQueueLen, "/q"));
  EXPECT_EQ(ns->I64(), 1);
  EXPECT_EQ(store_->QueueLen("/job/a//q").value_or(-1), 1);
  EXPECT_EQ(store_->QueueLen("/q").value_or(-1), 0);
  EXPECT_FALSE(LogMentions("closing"));
}

TEST_F(TcpStoreServerTest, AWokenPopperThatLeavesPassesTheItemOn) {
  const Dialect d = Dialect::kTorch21;
  auto producer = Validated();
  std::unique_ptr<Wire> a = Validated();
  std::unique_ptr<Wire> b = Validated();
  a->Send(d, Keys(Op::kWait, {"/q"}));
  b->Send(d, Keys(Op::kWait, {"/q"}));
  ASSERT_TRUE(Blocked(2)) << "the two WAITs never blocked";
  producer->Send(d, Q(Op::kQueuePush, "/q", "job"));
  struct pollfd woke[2] = {{a->fd(), POLLIN, 0}, {b->fd(), POLLIN, 0}};
  ASSERT_GT(poll(woke, 2, 30000), 0) << "the push woke neither waiter";
  const bool a_woke = (woke[0].revents & POLLIN) != 0;
  std::unique_ptr<Wire>& woken = a_woke ? a : b;
  std::unique_ptr<Wire>& other = a_woke ? b : a;
  EXPECT_TRUE(other->Silent()) << "one push woke both waiters";
  // The woken client goes without popping: the item is still queued, and
  // the other waiter is woken for it.
  woken.reset();
  EXPECT_EQ(other->U8(), kStopWaiting);
  other->Send(d, Q(Op::kQueuePop, "/q"));
  EXPECT_EQ(other->I64(), 1);
  EXPECT_EQ(other->Bytes(), "job");

  // Likewise a client whose wait timed out as the push woke it: its
  // CANCEL_WAIT comes after the STOP_WAITING.
  std::unique_ptr<Wire> c = Validated();
  c->Send(d, Keys(Op::kWait, {"/q"}));
  other->Send(d, Keys(Op::kWait, {"/q"}));
  ASSERT_TRUE(Blocked(2));
  producer->Send(d, Q(Op::kQueuePush, "/q", "job2"));
  struct pollfd woke2[2] = {{c->fd(), POLLIN, 0}, {other->fd(), POLLIN, 0}};
  ASSERT_GT(poll(woke2, 2, 30000), 0) << "the push woke neither waiter";
  Wire& first = (woke2[0].revents & POLLIN) != 0 ? *c : *other;
  Wire& second = &first == c.get() ? *other : *c;
  EXPECT_EQ(first.U8(), kStopWaiting);
  first.Send(d, Q(Op::kCancelWait));
  EXPECT_EQ(first.U8(), kWaitCanceled);
  EXPECT_EQ(second.U8(), kStopWaiting);
  second.Send(d, Q(Op::kQueuePop, "/q"));
  EXPECT_EQ(second.I64(), 1);
  EXPECT_EQ(second.Bytes(), "job2");
}

TEST_F(TcpStoreServerTest,
       APopWhoseConnectionClosesBeforeItsCommitTakesNothing) {
  const Dialect d = Dialect::kTorch21;
  ASSERT_TRUE(store_->QueuePush("/q", "kept").ok());
  auto w = Validated();
  // One write: the pop, then bytes that close the connection in the same
  // pass, before the pop is committed.
  std::string bytes;
  tcpstore::EncodeRequest(d, Q(Op::kQueuePop, "/q"), &bytes);
  bytes.push_back(static_cast<char>(0x7f));
  w->Send(bytes);
  EXPECT_TRUE(w->Closed());
  auto other = Validated();
  other->Send(d, Q(Op::kQueuePop, "/q"));
  EXPECT_EQ(other->I64(), 1);
  EXPECT_EQ(other->Bytes(), "kept");
}

TEST_F(TcpStoreServerTest, Torch113DialectAndWatchKeyRefusal) {
  Wire w(server_->port());
  const Dialect d = Dialect::kTorch113;
  w.Send(d, Q(Op::kSet, "/k", "old"));
  Request add = Q(Op::kAdd, "init/");
  add.number = 1;
  w.Send(d, add);
  EXPECT_EQ(w.I64(), 1);
  w.Send(d, Keys(Op::kWait, {"/k", "init/"}));
  EXPECT_EQ(w.U8(), kStopWaiting);
  w.Send(d, Q(Op::kGet, "/k"));
  EXPECT_EQ(w.Bytes(), "old");
  w.Send(d, Q(Op::kNumKeys));
  EXPECT_EQ(w.I64(), 2);
  w.Send(d, Q(Op::kDeleteKey, "/k"));
  EXPECT_EQ(w.I64(), 1);
  // In 1.13, byte 6 is GETNUMKEYS; in 2.1+ it would be WAIT.
  w.Send(std::string(1, '\x06'));
  EXPECT_EQ(w.I64(), 1);
  w.Send(d, Q(Op::kWatchKey, "/k"));
  EXPECT_TRUE(w.Closed());
  EXPECT_TRUE(LogMentions("WATCH_KEY is not supported"));
}

// Issue 25: a 1.13 client has no CANCEL_WAIT. After its wait timed out it
// sends its next request on the same connection; that request must be
// served (it was held behind the WAIT until the key appeared), and the
// WAIT must never be answered later, when the key appears, since the
// client would read that byte as the start of another reply.
TEST_F(TcpStoreServerTest, Torch113RequestsAfterATimedOutWaitAreServed) {
  Wire w(server_->port());
  const Dialect d = Dialect::kTorch113;
  w.Send(d, Keys(Op::kWait, {"/late"}));
  ASSERT_TRUE(Blocked(1));
  // The client gave up waiting: set, add, get, delete, num_keys follow.
  w.Send(d, Q(Op::kSet, "/a", "1"));
  Request add = Q(Op::kAdd, "/n");
  add.number = 5;
  w.Send(d, add);
  EXPECT_EQ(w.I64(), 5);
  w.Send(d, Q(Op::kGet, "/a"));
  EXPECT_EQ(w.Bytes(), "1");
  EXPECT_EQ(server_->stats().blocked, 0u);
  // Another client sees the SET at once.
  Wire other(server_->port());
  other.Send(d, Keys(Op::kWait, {"/a"}));
  EXPECT_EQ(other.U8(), kStopWaiting);
  // The waited key appears: nothing arrives for the forgotten WAIT, and the
  // next reply is exactly the next request's.
  ASSERT_TRUE(store_->Set("/late", "x").ok());
  EXPECT_TRUE(w.Silent());
  w.Send(d, Q(Op::kDeleteKey, "/a"));
  EXPECT_EQ(w.I64(), 1);
  w.Send(d, Q(Op::kNumKeys));
  EXPECT_EQ(w.I64(), 2);  // /n and /late.
  EXPECT_TRUE(w.Silent());
}

// cohortd's records live under "/cohort/": a torch client may read them but
// not write them. The protocol has no error reply, so the connection closes
// and the log says why.
TEST_F(TcpStoreServerTest, WritesToTheReservedNamespaceCloseTheConnection) {
  ASSERT_TRUE(store_->Set("/cohort/runs/r", "record").ok());
  const Dialect d = Dialect::kTorch21;
  Request add = Q(Op::kAdd, "/cohort/runs/r");
  add.number = 1;
  Request cas = Q(Op::kCompareSet, "/cohort/runs/r", "mine");
  cas.expected = "record";
  Request multi = Keys(Op::kMultiSet, {"/ok", "/cohort/runs/r"});
  multi.values = {"1", "2"};
  Request barrier = Q(Op::kBarrier, "/cohort/b");
  barrier.number = 2;
  const std::vector<Request> writes = {Q(Op::kSet, "/cohort/runs/r", "mine"),
                                       Q(Op::kAppend, "/cohort/runs/r", "x"),
                                       add,
                                       cas,
                                       Q(Op::kDeleteKey, "/cohort/runs/r"),
                                       multi,
                                       barrier};
  for (const Request& r : writes) {
    auto w = Validated();
    w->Send(d, r);
    EXPECT_TRUE(w->Closed()) << OpName(r.op);
    EXPECT_TRUE(LogMentions(absl::StrCat(OpName(r.op), " refused: key \"/"),
                            "is in cohortd's reserved namespace \"/cohort/\""))
        << OpName(r.op);
  }
  EXPECT_EQ(*store_->TryGet("/cohort/runs/r"), "record");
  EXPECT_FALSE(store_->TryGet("/ok")->has_value());
  EXPECT_FALSE(store_->TryGet("/cohort/b")->has_value());

  // Reads stay allowed, and torch's store.set("/cohort/x") is the user's
  // own "//cohort/x".
  auto w = Validated();
  w->Send(d, Q(Op::kGet, "/cohort/runs/r"));
  EXPECT_EQ(w->Bytes(), "record");
  w->Send(d, Keys(Op::kCheck, {"/cohort/runs/r"}));
  EXPECT_EQ(w->U8(), static_cast<uint8_t>(tcpstore::CheckReply::kReady));
  w->Send(d, Q(Op::kSet, "//cohort/runs/r", "user"));
  w->Send(d, Q(Op::kGet, "//cohort/runs/r"));
  EXPECT_EQ(w->Bytes(), "user");
}

// Two jobs whose clients name the same keys, each bound to its namespace
// by a hello, and a connection without one: every query sees only its own
// namespace's keys.
// The listener's access policy, which has no credentials to go on: the
// peer's network and a prefix every connection is confined to.
class TcpStoreServerPolicyTest : public ::testing::Test {
 protected:
  absl::StatusOr<std::unique_ptr<TcpStoreServer>> Start(
      std::vector<std::string> allow, std::string prefix = "") {
    return TcpStoreServer::Start(store_.get(),
                                 {.listen = "127.0.0.1:0",
                                  .allow = std::move(allow),
                                  .prefix = std::move(prefix),
                                  .log =
                                      [this](absl::string_view line) {
                                        absl::MutexLock lock(&mu_);
                                        log_.emplace_back(line);
                                      },
                                  .log_every = absl::ZeroDuration()});
  }
  bool Logged(absl::string_view what) {
    absl::MutexLock lock(&mu_);
    for (const std::string& line : log_) {
      if (absl::StrContains(line, what)) return true;
    }
    return false;
  }

  std::unique_ptr<store::KvStore> store_ = std::make_unique<store::KvStore>(
      store::NewMemoryEngine(), store::StoreLimits());
  absl::Mutex mu_;
  std::vector<std::string> log_ ABSL_GUARDED_BY(mu_);
};

TEST_F(TcpStoreServerPolicyTest, OnlyAllowedNetworksGetServed) {
  auto elsewhere = Start({"10.0.0.0/8", "fd00::/8", "192.168.1.7"});
  ASSERT_TRUE(elsewhere.ok()) << elsewhere.status();
  Wire refused((*elsewhere)->port());
  ASSERT_TRUE(refused.connected());
  EXPECT_FALSE(Pings(refused));
  EXPECT_TRUE(refused.Closed());
  EXPECT_EQ((*elsewhere)->stats().refused_not_allowed, 1u);
  EXPECT_EQ((*elsewhere)->stats().connections, 0u);
  EXPECT_TRUE(Logged("not in the allowed networks (--tcpstore_allow)"));

  auto loopback = Start({"10.0.0.0/8", "127.0.0.0/8"});
  ASSERT_TRUE(loopback.ok()) << loopback.status();
  Wire served((*loopback)->port());
  EXPECT_TRUE(Pings(served));
  EXPECT_EQ((*loopback)->stats().refused_not_allowed, 0u);
  auto host = Start({"127.0.0.1"});
  ASSERT_TRUE(host.ok()) << host.status();
  Wire one_host((*host)->port());
  EXPECT_TRUE(Pings(one_host));
}

TEST_F(TcpStoreServerPolicyTest, ThePrefixConfinesEveryConnection) {
  ASSERT_TRUE(store_->Set("/outside", "x").ok());
  auto server = Start({}, "/jobs/a/");
  ASSERT_TRUE(server.ok()) << server.status();
  const Dialect d = Dialect::kTorch21;
  Wire plain((*server)->port());
  ASSERT_TRUE(Pings(plain));
  plain.Send(d, Q(Op::kSet, "/k", "v"));
  plain.Send(d, Keys(Op::kCheck, {"/outside"}));
  EXPECT_EQ(plain.U8(), 1);  // Out of its reach: NOT_READY.
  plain.Send(d, Keys(Op::kCheck, {"/k"}));
  EXPECT_EQ(plain.U8(), 0);
  plain.Send(d, Q(Op::kNumKeys));
  EXPECT_EQ(plain.I64(), 1);  // Its own key only, not "/outside".
  EXPECT_EQ(*store_->TryGet("/jobs/a//k"), std::optional<std::string>("v"));

  // A namespace hello narrows it further, under the prefix.
  Wire named((*server)->port());
  std::string hello;
  tcpstore::EncodeNamespaceHello("/run/1/", &hello);
  Request v = Q(Op::kValidate);
  v.word = tcpstore::kValidateMagic;
  tcpstore::EncodeRequest(d, v, &hello);
  named.Send(hello);
  named.Send(d, Q(Op::kSet, "/k", "w"));
  named.Send(d, Q(Op::kNumKeys));
  EXPECT_EQ(named.I64(), 1);
  EXPECT_EQ(*store_->TryGet("/jobs/a//run/1//k"),
            std::optional<std::string>("w"));
  EXPECT_EQ(*store_->TryGet("/outside"), std::optional<std::string>("x"));
}

TEST_F(TcpStoreServerPolicyTest, WithTokensRequiredOnlyTokenHellosAreServed) {
  std::vector<std::string> checked;
  auto server = TcpStoreServer::Start(
      store_.get(), {.listen = "127.0.0.1:0",
                     .authorize = [&checked](absl::string_view token,
                                             absl::string_view name_space)
                         -> absl::StatusOr<TcpStoreGrant> {
                       checked.push_back(absl::StrCat(token, " ", name_space));
                       if (token != "good-token-0123456789") {
                         return absl::UnauthenticatedError("unknown token");
                       }
                       if (!absl::StartsWith(name_space, "/cohortrun/job1/")) {
                         return absl::PermissionDeniedError("outside job1/");
                       }
                       return TcpStoreGrant{};
                     },
                     .require_token = true,
                     .log =
                         [this](absl::string_view line) {
                           absl::MutexLock lock(&mu_);
                           log_.emplace_back(line);
                         },
                     .log_every = absl::ZeroDuration()});
  ASSERT_TRUE(server.ok()) << server.status();
  const Dialect d = Dialect::kTorch21;
  auto hello = [](absl::string_view name_space, absl::string_view token) {
    std::string bytes;
    tcpstore::EncodeNamespaceHello(name_space, &bytes, token);
    Request v = Q(Op::kValidate);
    v.word = tcpstore::kValidateMagic;
    tcpstore::EncodeRequest(Dialect::kTorch21, v, &bytes);
    return bytes;
  };

  Wire torch((*server)->port());  // A plain torch client: no hello.
  EXPECT_FALSE(Pings(torch));
  EXPECT_TRUE(torch.Closed());
  EXPECT_TRUE(Logged("this listener needs a token"));

  Wire no_token((*server)->port());
  no_token.Send(hello("/cohortrun/job1/0/", ""));
  no_token.Send(d, Q(Op::kNumKeys));
  EXPECT_TRUE(no_token.Closed());

  Wire bad((*server)->port());
  bad.Send(hello("/cohortrun/job1/0/", "bad-token-0123456789"));
  bad.Send(d, Q(Op::kNumKeys));
  EXPECT_TRUE(bad.Closed());
  EXPECT_TRUE(Logged("refused: unknown token"));

  Wire elsewhere((*server)->port());
  elsewhere.Send(hello("/cohortrun/job2/0/", "good-token-0123456789"));
  elsewhere.Send(d, Q(Op::kNumKeys));
  EXPECT_TRUE(elsewhere.Closed());
  EXPECT_TRUE(Logged("outside job1/"));

  Wire good((*server)->port());
  good.Send(hello("/cohortrun/job1/0/", "good-token-0123456789"));
  good.Send(d, Q(Op::kSet, "k", "v"));
  good.Send(d, Q(Op::kNumKeys));
  EXPECT_EQ(good.I64(), 1);
  EXPECT_EQ(*store_->TryGet("/cohortrun/job1/0/k"),
            std::optional<std::string>("v"));
  EXPECT_EQ((*server)->stats().refused_unauthenticated, 4u);
  EXPECT_EQ(checked.size(), 3u);  // The hello without a token asks nobody.
}

TEST_F(TcpStoreServerPolicyTest, ATokenHelloNeedsAListenerThatTakesTokens) {
  auto server = Start({});
  ASSERT_TRUE(server.ok()) << server.status();
  std::string bytes;
  tcpstore::EncodeNamespaceHello("/ns/", &bytes, "some-token-0123456789");
  Wire w((*server)->port());
  w.Send(bytes);
  w.Send(Dialect::kTorch21, Q(Op::kNumKeys));
  EXPECT_TRUE(w.Closed());
  EXPECT_TRUE(Logged("takes no tokens"));
}

TEST_F(TcpStoreServerPolicyTest, ItServesOnlyTheAddressItIsBoundTo) {
  // Its own bind address, apart from gRPC's: 127.0.0.2 is loopback too,
  // but a listener there is not reachable at 127.0.0.1.
  auto server = TcpStoreServer::Start(store_.get(), {.listen = "127.0.0.2:0"});
  ASSERT_TRUE(server.ok()) << server.status();
  Wire bound((*server)->port(), 0x7F000002);
  EXPECT_TRUE(Pings(bound));
  Wire elsewhere((*server)->port(), INADDR_LOOPBACK);
  EXPECT_FALSE(elsewhere.connected());
}

TEST_F(TcpStoreServerPolicyTest, ABadPolicyIsRefusedAtStart) {
  for (const char* bad : {"10.0.0.0/33", "nonsense", "10.0.0/8", "::1/129"}) {
    auto s = Start({bad});
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(s.status().message(), bad)) << s.status();
  }
  // Inside "/cohort/", or a start of it ("/cohort" + "/auth/x" is
  // "/cohort/auth/x").
  for (const char* prefix : {"/cohort/runs/", "/cohort/", "/cohort", "/co", "/"}) {
    auto reserved = Start({}, prefix);
    EXPECT_EQ(reserved.status().code(), absl::StatusCode::kInvalidArgument)
        << prefix;
    EXPECT_TRUE(absl::StrContains(reserved.status().message(), "reserved"))
        << reserved.status();
  }
  for (const char* prefix : {"/cohortrun/", "/cohorts/", "torch/"}) {
    EXPECT_TRUE(Start({}, prefix).ok()) << prefix;
  }
}

TEST_F(TcpStoreServerTest, NamespacedConnectionsSeeOnlyTheirKeys) {
  const Dialect d = Dialect::kTorch21;
  ASSERT_TRUE(store_->Set("/k", "outside").ok());
  auto a = InNamespace("/job/a/");
  auto b = InNamespace("/job/b/");
  auto plain = Validated();
  a->Send(d, Q(Op::kSet, "/k", "va"));
  b->Send(d, Q(Op::kSet, "/k", "vb"));
  a->Send(d, Q(Op::kGet, "/k"));
  b->Send(d, Q(Op::kGet, "/k"));
  plain->Send(d, Q(Op::kGet, "/k"));
  EXPECT_EQ(a->Bytes(), "va");
  EXPECT_EQ(b->Bytes(), "vb");
  EXPECT_EQ(plain->Bytes(), "outside");
  EXPECT_EQ(*store_->TryGet("/job/a//k"), std::optional<std::string>("va"));

  Request add = Q(Op::kAdd, "init/");
  add.number = 1;
  a->Send(d, add);
  EXPECT_EQ(a->I64(), 1);
  b->Send(d, add);
  EXPECT_EQ(b->I64(), 1);
  Request cas = Q(Op::kCompareSet, "/c", "v1");
  a->Send(d, cas);
  EXPECT_EQ(a->Bytes(), "v1");
  b->Send(d, Keys(Op::kCheck, {"/k", "/c"}));
  EXPECT_EQ(b->U8(), 1);  // NOT_READY: "/c" is a's.
  a->Send(d, Keys(Op::kCheck, {"/k", "/c"}));
  EXPECT_EQ(a->U8(), 0);
  a->Send(d, Q(Op::kAppend, "/log", "x"));
  Request mset = Keys(Op::kMultiSet, {"/m1", "/m2"});
  mset.values = {"one", "two"};
  a->Send(d, mset);
  a->Send(d, Keys(Op::kMultiGet, {"/log", "/m2"}));
  EXPECT_EQ(a->Bytes(), "x");
  EXPECT_EQ(a->Bytes(), "two");
  b->Send(d, Keys(Op::kMultiGet, {"/m1"}));
  EXPECT_EQ(b->Bytes(), "");
  b->Send(d, Q(Op::kDeleteKey, "/m1"));
  EXPECT_EQ(b->I64(), 0);

  // GETNUMKEYS and LIST_KEYS: the namespace's keys, without it.
  a->Send(d, Q(Op::kNumKeys));
  EXPECT_EQ(a->I64(), 6);
  b->Send(d, Q(Op::kNumKeys));
  EXPECT_EQ(b->I64(), 2);
  plain->Send(d, Q(Op::kNumKeys));
  EXPECT_EQ(plain->I64(), 9);
  b->Send(d, Q(Op::kListKeys));
  EXPECT_EQ(b->I64(), 2);
  std::vector<std::string> keys;
  for (int i = 0; i < 2; ++i) keys.push_back(b->Bytes().value_or("?"));
  std::sort(keys.begin(), keys.end());
  EXPECT_EQ(keys, (std::vector<std::string>{"/k", "init/"}));

  // WAIT: a write in another namespace does not end it; one in its own
  // (here through the store, as gRPC would write it) does.
  a->Send(d, Keys(Op::kWait, {"/w"}));
  b->Send(d, Q(Op::kSet, "/w", "b's"));
  EXPECT_TRUE(a->Silent());
  ASSERT_TRUE(store_->Set("/job/a//w", "a's").ok());
  EXPECT_EQ(a->U8(), kStopWaiting);

  // BARRIER: counted per namespace.
  auto a2 = InNamespace("/job/a/");
  Request barrier = Q(Op::kBarrier, "/b");
  barrier.number = 2;
  a->Send(d, barrier);
  b->Send(d, barrier);
  EXPECT_TRUE(a->Silent());
  a2->Send(d, barrier);
  EXPECT_EQ(a->U8(), kStopWaiting);
  EXPECT_EQ(a2->U8(), kStopWaiting);
  EXPECT_TRUE(b->Silent());
  b->Send(d, Q(Op::kCancelWait));
  EXPECT_EQ(b->U8(), kWaitCanceled);

  // Queues too.
  a->Send(d, Q(Op::kQueuePush, "/q", "job"));
  b->Send(d, Q(Op::kQueueLen, "/q"));
  EXPECT_EQ(b->I64(), 0);
  a2->Send(d, Q(Op::kQueueLen, "/q"));
  EXPECT_EQ(a2->I64(), 1);

  // The 1.13 dialect after a hello, sent in pieces: a byte at a time.
  Wire old(server_->port());
  std::string bytes;
  tcpstore::EncodeNamespaceHello("/job/a/", &bytes);
  tcpstore::EncodeRequest(Dialect::kTorch113, Q(Op::kGet, "/k"), &bytes);
  for (char byte : bytes) old.Send(std::string(1, byte));
  EXPECT_EQ(old.Bytes(), "va");
  EXPECT_FALSE(LogMentions("closing"));
}

TEST_F(TcpStoreServerTest, BadNamespaceHellosCloseTheConnection) {
  auto hello = [](absl::string_view name_space) {
    std::string wire(tcpstore::kNamespaceHelloMagic, 4);
    Encoder(&wire).U32(name_space.size());
    wire.append(name_space.data(), name_space.size());
    return wire;
  };
  std::string twice;
  tcpstore::EncodeNamespaceHello("/a/", &twice);
  tcpstore::EncodeNamespaceHello("/b/", &twice);
  struct Case {
    std::string bytes;
    std::string logged;
  };
  const std::vector<Case> cases = {
      {hello("/cohort/runs/"), "bad namespace hello: namespace \"/cohort/"},
      {hello("job"), "bad namespace hello: namespace \"job\" must start"},
      {std::string("\xC0NSX", 4), "bad namespace hello magic"},
      // Only a connection's first bytes may be a hello.
      {twice, "unknown query type 192"},
  };
  for (const Case& c : cases) {
    Wire w(server_->port());
    w.Send(c.bytes);
    EXPECT_TRUE(w.Closed()) << c.logged;
    EXPECT_TRUE(LogMentions("closing TCPStore connection from", c.logged))
        << c.logged;
  }
  // Namespace "/" is allowed, but cannot reach cohortd's reserved keys.
  auto root = InNamespace("/");
  root->Send(Dialect::kTorch21, Q(Op::kSet, "cohort/x", "v"));
  EXPECT_TRUE(root->Closed());
  EXPECT_TRUE(LogMentions("SET refused: key \"/cohort/x\""));
  EXPECT_FALSE(store_->TryGet("/cohort/x")->has_value());
}

// A client that writes and goes away at once (a rank that sets a key and
// exits, or cohortrun's proxy passing that on): what it sent is applied.
TEST_F(TcpStoreServerTest, RequestsSentJustBeforeCloseAreApplied) {
  for (int i = 0; i < 20; ++i) {
    const std::string key = absl::StrCat("/last", i);
    {
      auto w = i % 2 == 0 ? Validated() : InNamespace("/ns/");
      std::string both;
      tcpstore::EncodeRequest(Dialect::kTorch21, Q(Op::kSet, key, "v"), &both);
      Request add = Q(Op::kAdd, "/count");
      add.number = 1;
      tcpstore::EncodeRequest(Dialect::kTorch21, add, &both);
      w->Send(both);
    }
    const std::string stored = i % 2 == 0 ? key : absl::StrCat("/ns/", key);
    EXPECT_TRUE(Eventually([&] { return store_->TryGet(stored)->has_value(); }))
        << stored << " was never applied";
  }
  EXPECT_EQ(*store_->TryGet("/count"), std::optional<std::string>("10"));
  EXPECT_EQ(*store_->TryGet("/ns//count"), std::optional<std::string>("10"));
}

TEST_F(TcpStoreServerTest, BadInputClosesOnlyThatConnection) {
  auto bystander = Validated();
  struct Case {
    std::string name;
    std::string bytes;
    std::string logged;
  };
  std::string absurd(1, '\x00');  // 1.13 SET
  Encoder(&absurd).U64(uint64_t{1} << 60);
  std::string validated_unknown;
  Encoder(&validated_unknown).U8(0);
  Encoder(&validated_unknown).U32(tcpstore::kValidateMagic);
  Encoder(&validated_unknown).U8(77);
  std::string many_keys(1, '\x05');  // 1.13 WAIT with 2^40 keys
  Encoder(&many_keys).U64(uint64_t{1} << 40);
  std::string big_value;  // A 2 MiB value over the 1 MiB limit.
  tcpstore::EncodeRequest(Dialect::kTorch21, Q(Op::kSet, "/v"), &big_value);
  big_value.resize(1 + 8 + 2);
  Encoder(&big_value).U64(2 << 20);
  std::vector<Case> cases = {
      {"absurd length", absurd, "over max_key_bytes"},
      {"unknown type", validated_unknown, "unknown query type 77"},
      {"http", "GET / HTTP/1.1\r\nHost: x\r\n\r\n", "unknown query type 71"},
      {"too many keys", many_keys, "max_keys_per_call"},
      {"value too big", big_value, "over max_value_bytes"},
  };
  for (const Case& c : cases) {
    Wire w(server_->port());
    w.Send(c.bytes);
    EXPECT_TRUE(w.Closed()) << c.name;
    EXPECT_TRUE(
        LogMentions("closing TCPStore connection from 127.0.0.1:", c.logged))
        << c.name;
  }
  // A truncated frame: the peer goes away mid-request.
  {
    Wire w(server_->port());
    w.Send(std::string("\x02\x10\x00", 3));
  }
  EXPECT_GE(server_->stats().closed_bad_input, cases.size());
  bystander->Send(Dialect::kTorch21, Q(Op::kSet, "/still", "here"));
  bystander->Send(Dialect::kTorch21, Q(Op::kGet, "/still"));
  EXPECT_EQ(bystander->Bytes(), "here");
}

int64_t RssBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) << 10;
  }
  return -1;
}

TEST_F(TcpStoreServerTest, AClientThatNeverReadsCannotGrowTheServer) {
  ASSERT_TRUE(store_->Set("/big", std::string(1 << 20, 'b')).ok());
  Wire hog(server_->port());
  int small = 4096;
  setsockopt(hog.fd(), SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  std::string gets;
  for (int i = 0; i < 2000; ++i) {
    tcpstore::EncodeRequest(Dialect::kTorch113, Q(Op::kGet, "/big"), &gets);
  }
  const int64_t before = RssBytes();
  // 2,000 replies of 1 MiB would be 2 GiB; the server stops reading after
  // max_unsent_bytes (1 MiB here) plus what the socket buffers hold.
  std::thread sender([&] { hog.Send(gets); });
  absl::SleepFor(absl::Seconds(1));
  const int64_t grown = RssBytes() - before;
  EXPECT_LT(grown, 64 << 20) << "RSS grew by " << grown;
  auto other = Validated();
  other->Send(Dialect::kTorch21, Q(Op::kGet, "/big"));
  auto value = other->Bytes();
  ASSERT_TRUE(value.has_value());
  EXPECT_EQ(value->size(), size_t{1} << 20);
  shutdown(hog.fd(), SHUT_RDWR);
  sender.join();
}

// A server on its own options, logging into `log`.
absl::StatusOr<std::unique_ptr<TcpStoreServer>> StartWith(
    store::KvStore* store, TcpStoreServerOptions options,
    std::shared_ptr<std::vector<std::string>> log,
    std::shared_ptr<absl::Mutex> mu) {
  options.listen = "127.0.0.1:0";
  options.log = [log, mu](absl::string_view line) {
    absl::MutexLock lock(mu.get());
    log->emplace_back(line);
  };
  options.log_every = absl::ZeroDuration();
  return TcpStoreServer::Start(store, std::move(options));
}

bool Mentions(const std::vector<std::string>& log, absl::Mutex& mu,
              absl::string_view a, absl::string_view b) {
  absl::MutexLock lock(&mu);
  for (const std::string& line : log) {
    if (absl::StrContains(line, a) && absl::StrContains(line, b)) return true;
  }
  return false;
}

template <typename Condition>
bool Eventually(Condition done, absl::Duration give_up = absl::Seconds(60)) {
  const absl::Time until = absl::Now() + give_up;
  while (!done()) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

TEST(TcpStoreSlowReadersTest, TogetherTheyHoldNoMoreThanTheTotalBound) {
  store::KvStore store(store::NewMemoryEngine(), store::StoreLimits());
  constexpr size_t kValue = 256 << 10;
  constexpr size_t kPerConnection = 1 << 20;
  constexpr size_t kTotal = 4 << 20;
  constexpr int kReaders = 32;
  ASSERT_TRUE(store.Set("/big", std::string(kValue, 'b')).ok());
  auto log = std::make_shared<std::vector<std::string>>();
  auto mu = std::make_shared<absl::Mutex>();
  auto server = StartWith(
      &store,
      {.max_unsent_bytes = kPerConnection, .max_unsent_bytes_total = kTotal},
      log, mu);
  ASSERT_TRUE(server.ok()) << server.status();
  // Each asks for 64 replies of 256 KiB (16 MiB) and reads none: on their
  // own bounds alone they would hold 32 x 1 MiB.
  std::string gets;
  for (int i = 0; i < 64; ++i) {
    tcpstore::EncodeRequest(Dialect::kTorch21, Q(Op::kGet, "/big"), &gets);
  }
  std::vector<std::unique_ptr<Wire>> hogs;
  for (int i = 0; i < kReaders; ++i) {
    auto w = std::make_unique<Wire>((*server)->port());
    int small = 4096;
    setsockopt(w->fd(), SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    ASSERT_TRUE(Pings(*w));
    // The kernel takes only part: the rest waits in the socket.
    int flags = MSG_NOSIGNAL | MSG_DONTWAIT;
    (void)!send(w->fd(), gets.data(), gets.size(), flags);
    hogs.push_back(std::move(w));
  }
  // A client that reads its replies is served all along.
  Wire reader((*server)->port());
  ASSERT_TRUE(Pings(reader));
  for (int i = 0; i < 20; ++i) {
    reader.Send(Dialect::kTorch21, Q(Op::kGet, "/big"));
    auto value = reader.Bytes();
    ASSERT_TRUE(value.has_value()) << "GET " << i << " was not answered";
    ASSERT_EQ(value->size(), kValue);
  }
  ASSERT_TRUE(Eventually([&] {
    return (*server)->stats().closed_slow_readers > 0;
  })) << "no slow reader was closed; unsent "
      << (*server)->stats().unsent_bytes;
  ASSERT_TRUE(
      Eventually([&] { return (*server)->stats().unsent_bytes <= kTotal; }));
  // Past the total, a connection is served only while it holds nothing,
  // one request at a time, and each reply the kernel would not take is
  // counted (and the largest holders closed) before the next request: the
  // most ever queued is the total plus one reply (a GET's value and its
  // 8-byte length).
  const TcpStoreServerStats stats = (*server)->stats();
  EXPECT_LE(stats.peak_unsent_bytes, kTotal + kValue + 8);
  EXPECT_TRUE(Mentions(*log, *mu, "--tcpstore_max_unsent_bytes_total",
                       "must read the replies"));
  // And still, after all that, the reader is served.
  reader.Send(Dialect::kTorch21, Q(Op::kGet, "/big"));
  auto value = reader.Bytes();
  ASSERT_TRUE(value.has_value());
  EXPECT_EQ(value->size(), kValue);
}

TEST(TcpStoreBudgetTest, ListenersSharingABudgetRefuseTogether) {
  store::KvStore store(store::NewMemoryEngine(), store::StoreLimits());
  auto log = std::make_shared<std::vector<std::string>>();
  auto mu = std::make_shared<absl::Mutex>();
  ConnectionBudget budget(3);
  auto a = StartWith(&store, {.budget = &budget}, log, mu);
  auto b = StartWith(&store, {.budget = &budget}, log, mu);
  ASSERT_TRUE(a.ok() && b.ok());
  auto a1 = std::make_unique<Wire>((*a)->port());
  Wire a2((*a)->port()), b1((*b)->port());
  ASSERT_TRUE(Pings(*a1) && Pings(a2) && Pings(b1));
  EXPECT_EQ(budget.in_use(), 3u);
  Wire b2((*b)->port());
  EXPECT_FALSE(Pings(b2));
  EXPECT_TRUE(b2.Closed());
  EXPECT_EQ((*b)->stats().refused_no_budget, 1u);
  EXPECT_TRUE(Mentions(*log, *mu, "across cohortd's gRPC and TCPStore",
                       "--max_connections"));
  // A connection closed on one listener makes room on the other.
  a1.reset();
  ASSERT_TRUE(Eventually([&] { return budget.in_use() == 2; }));
  Wire b3((*b)->port());
  EXPECT_TRUE(Pings(b3));
}

TEST(TcpStoreQuotaTest, QueuesAndWaitsAreChargedToTheirOwner) {
  store::KvStore store(store::NewMemoryEngine(), store::StoreLimits());
  auto log = std::make_shared<std::vector<std::string>>();
  auto mu = std::make_shared<absl::Mutex>();
  QuotaLimits limits;
  limits.queue_bytes = 1000;
  limits.waits = 1;
  limits.waited_keys = 2;
  limits.connections = 3;
  Quotas quotas(limits);
  auto server = StartWith(
      &store,
      {.max_queue_bytes_total = 1500,
       .quotas = &quotas,
       // The token names its owner: "a-..." or "b-...".
       .authorize = [](absl::string_view token,
                       absl::string_view) -> absl::StatusOr<TcpStoreGrant> {
         return TcpStoreGrant{.owner = std::string(token.substr(0, 1))};
       }},
      log, mu);
  ASSERT_TRUE(server.ok()) << server.status();
  auto as = [&](absl::string_view token) {
    auto w = std::make_unique<Wire>((*server)->port());
    std::string hello;
    tcpstore::EncodeNamespaceHello("/ns/", &hello, token);
    w->Send(hello);
    EXPECT_TRUE(Pings(*w));
    return w;
  };
  auto a1 = as("a-token-0123456789"), b1 = as("b-token-0123456789");
  // Queue bytes: a's 600 fit, 600 more do not; b's own share is untouched.
  a1->Send(Dialect::kTorch21, Q(Op::kQueuePush, "q", std::string(600, 'x')));
  ASSERT_TRUE(Pings(*a1));
  EXPECT_EQ(quotas.Used("a", Quota::kQueueBytes), 600u);
  auto a2 = as("a-token-0123456789");
  a2->Send(Dialect::kTorch21, Q(Op::kQueuePush, "q", std::string(600, 'y')));
  EXPECT_TRUE(a2->Closed());
  EXPECT_TRUE(Mentions(*log, *mu, "QUEUE_PUSH refused", "--quota_queue_bytes"));
  b1->Send(Dialect::kTorch21, Q(Op::kQueuePush, "q", std::string(600, 'z')));
  ASSERT_TRUE(Pings(*b1));
  // All queues together: 1,200 held, 400 more pass the total of 1,500
  // (though within b's own 1,000).
  auto b2 = as("b-token-0123456789");
  b2->Send(Dialect::kTorch21, Q(Op::kQueuePush, "r", std::string(400, 'w')));
  EXPECT_TRUE(b2->Closed());
  EXPECT_TRUE(Mentions(*log, *mu, "--tcpstore_max_queue_bytes", "pop"));
  // A pop, by anyone, gives the pusher's bytes back.
  b1->Send(Dialect::kTorch21, Q(Op::kQueuePop, "q"));
  EXPECT_EQ(b1->I64(), 2);
  EXPECT_EQ(b1->Bytes(), std::string(600, 'x'));
  EXPECT_EQ(quotas.Used("a", Quota::kQueueBytes), 0u);
  EXPECT_EQ(quotas.Used("b", Quota::kQueueBytes), 600u);

  // Waits: one parked wait for a; its second is refused, b's is not.
  a1->Send(Dialect::kTorch21, Keys(Op::kWait, {"k1", "k2"}));
  ASSERT_TRUE(Eventually([&] { return (*server)->stats().blocked == 1; }));
  EXPECT_EQ(quotas.Used("a", Quota::kWaits), 1u);
  EXPECT_EQ(quotas.Used("a", Quota::kWaitedKeys), 2u);
  auto a3 = as("a-token-0123456789");
  a3->Send(Dialect::kTorch21, Keys(Op::kWait, {"k3"}));
  EXPECT_TRUE(a3->Closed());
  EXPECT_TRUE(Mentions(*log, *mu, "WAIT refused", "--quota_waits"));
  b1->Send(Dialect::kTorch21, Keys(Op::kWait, {"k1"}));
  ASSERT_TRUE(Eventually([&] { return (*server)->stats().blocked == 2; }));
  // The keys arrive: both waits end, and their charges are given back.
  ASSERT_TRUE(store.Set("/ns/k1", "v").ok());
  ASSERT_TRUE(store.Set("/ns/k2", "v").ok());
  EXPECT_EQ(a1->U8(), kStopWaiting);
  EXPECT_EQ(b1->U8(), kStopWaiting);
  EXPECT_EQ(quotas.Used("a", Quota::kWaits), 0u);
  EXPECT_EQ(quotas.Used("a", Quota::kWaitedKeys), 0u);
  EXPECT_EQ(quotas.Used("b", Quota::kWaits), 0u);

  // Connections: a holds a1 (a2, a3 were closed); two more fit, a third
  // does not, and closing one gives it back.
  auto a4 = as("a-token-0123456789");
  auto a5 = as("a-token-0123456789");
  EXPECT_EQ(quotas.Used("a", Quota::kConnections), 3u);
  auto a6 = std::make_unique<Wire>((*server)->port());
  std::string hello;
  tcpstore::EncodeNamespaceHello("/ns/", &hello, "a-token-0123456789");
  a6->Send(hello);
  EXPECT_FALSE(Pings(*a6));
  EXPECT_TRUE(Mentions(*log, *mu, "refused", "--quota_connections"));
  a5.reset();
  ASSERT_TRUE(
      Eventually([&] { return quotas.Used("a", Quota::kConnections) == 2; }));
  auto a7 = as("a-token-0123456789");
  EXPECT_EQ(quotas.Used("a", Quota::kConnections), 3u);
}

TEST(TcpStoreQuotaTest, TheQueueBoundCountsWhatTheStoreHolds) {
  store::KvStore store(store::NewMemoryEngine(), store::StoreLimits());
  // Items the listener did not push (kept over a restart, or pushed
  // through another replica) count towards the bound too.
  ASSERT_TRUE(store.QueuePush("/q", std::string(90, 'x')).ok());
  auto log = std::make_shared<std::vector<std::string>>();
  auto mu = std::make_shared<absl::Mutex>();
  auto server = StartWith(&store, {.max_queue_bytes_total = 100}, log, mu);
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->stats().queue_bytes, 90u);
  Wire w((*server)->port());
  ASSERT_TRUE(Pings(w));
  w.Send(Dialect::kTorch21, Q(Op::kQueuePush, "/r", std::string(20, 'y')));
  EXPECT_TRUE(w.Closed());
  EXPECT_TRUE(Mentions(*log, *mu, "--tcpstore_max_queue_bytes=100", "pop"));
  Wire v((*server)->port());
  ASSERT_TRUE(Pings(v));
  v.Send(Dialect::kTorch21, Q(Op::kQueuePop, "/q"));
  EXPECT_EQ(v.I64(), 1);
  EXPECT_EQ(v.Bytes(), std::string(90, 'x'));
  v.Send(Dialect::kTorch21, Q(Op::kQueuePush, "/r", std::string(20, 'y')));
  ASSERT_TRUE(Pings(v));
  EXPECT_EQ(store.QueueLen("/r").value_or(-1), 1);
}

TEST_F(TcpStoreServerTest, StopEndsBlockedConnections) {
  auto w = Validated();
  w->Send(Dialect::kTorch21, Keys(Op::kWait, {"/forever"}));
  EXPECT_TRUE(Blocked(1)) << "the WAIT never blocked";
  EXPECT_TRUE(w->Silent());
  server_->Stop();
  EXPECT_TRUE(w->Closed());
  Wire late(server_->port());
  EXPECT_FALSE(late.connected());
}

}  // namespace
}  // namespace cohort::server
