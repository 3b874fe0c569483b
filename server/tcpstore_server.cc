#include "server/tcpstore_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/log_limiter.h"
#include "proto/c10d/rules.h"
#include "proto/tcpstore/wire.h"
#include "server/listener.h"
#include "server/quota.h"
#include "store/queue_keys.h"

namespace cohort::server {
namespace {

using tcpstore::CheckReply;
using tcpstore::Dialect;
using tcpstore::Encoder;
using tcpstore::Op;
using tcpstore::ParseResult;
using tcpstore::ParseStatus;
using tcpstore::Request;
using tcpstore::WaitReply;

// One read buffer for the whole loop: a connection holds bytes of its own
// only while a request is split across reads, so 10,000 idle connections
// cost no read buffers.
constexpr size_t kReadBufferBytes = 64 << 10;

std::string PeerName(const uv_tcp_t* tcp) {
  struct sockaddr_storage addr = {};
  int len = sizeof(addr);
  if (uv_tcp_getpeername(tcp, reinterpret_cast<struct sockaddr*>(&addr),
                         &len) != 0) {
    return "unknown peer";
  }
  char host[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET6) {
    const auto* a6 = reinterpret_cast<const struct sockaddr_in6*>(&addr);
    uv_ip6_name(a6, host, sizeof(host));
    return absl::StrCat("[", host, "]:", ntohs(a6->sin6_port));
  }
  const auto* a4 = reinterpret_cast<const struct sockaddr_in*>(&addr);
  uv_ip4_name(a4, host, sizeof(host));
  return absl::StrCat(host, ":", ntohs(a4->sin_port));
}

std::vector<std::string> Strings(const std::vector<absl::string_view>& views) {
  return std::vector<std::string>(views.begin(), views.end());
}

// Whether a client may make the writes `r` asks for: not in cohortd's
// reserved namespace. Keys are the store's keys as they arrive (torch's
// TCPStore client puts a "/" before the user's key, so
// store.set("cohort/runs/x") reaches "/cohort/runs/x").
absl::Status CheckClientWrites(const Request& r) {
  switch (r.op) {
    case Op::kSet:
    case Op::kAppend:
    case Op::kAdd:
    case Op::kCompareSet:
    case Op::kDeleteKey:
    case Op::kBarrier:  // Adds to its counter key.
      return c10d::CheckClientWrite(r.key);
    case Op::kMultiSet:
      for (absl::string_view key : r.keys) {
        if (absl::Status s = c10d::CheckClientWrite(key); !s.ok()) return s;
      }
      return absl::OkStatus();
    default:
      // Reads, and queues: a queue's items are the store's own keys
      // (store/queue_keys.h), whatever the queue's name.
      return absl::OkStatus();
  }
}

// `r` with the namespace in front of each of its keys, whose strings are
// kept in `keys`. Empty keys stay empty, and are refused as before.
Request InNamespace(absl::string_view name_space, const Request& r,
                    std::deque<std::string>& keys) {
  auto full = [&](absl::string_view key) -> absl::string_view {
    if (key.empty()) return key;
    return keys.emplace_back(absl::StrCat(name_space, key));
  };
  Request out = r;
  out.key = full(r.key);
  for (absl::string_view& key : out.keys) key = full(key);
  return out;
}

// A peer network of TcpStoreServerOptions::allow: an address family, its
// address bytes and a prefix length.
struct Network {
  int family = AF_INET;
  unsigned char bytes[16] = {};
  int bits = 0;

  bool Contains(int peer_family, const unsigned char* peer) const {
    if (peer_family != family) return false;
    const int whole = bits / 8;
    if (std::memcmp(bytes, peer, whole) != 0) return false;
    const int rest = bits % 8;
    if (rest == 0) return true;
    const unsigned char mask = static_cast<unsigned char>(0xff << (8 - rest));
    return (bytes[whole] & mask) == (peer[whole] & mask);
  }
};

// "A.B.C.D[/N]" or "X:Y::Z[/N]"; a bare address is one host.
absl::StatusOr<Network> ParseNetwork(absl::string_view text) {
  Network n;
  const size_t slash = text.find('/');
  const std::string address(text.substr(0, slash));
  const int max_bits = address.find(':') == std::string::npos ? 32 : 128;
  n.family = max_bits == 32 ? AF_INET : AF_INET6;
  n.bits = max_bits;
  if (inet_pton(n.family, address.c_str(), n.bytes) != 1 ||
      (slash != absl::string_view::npos &&
       (!absl::SimpleAtoi(text.substr(slash + 1), &n.bits) || n.bits < 0 ||
        n.bits > max_bits))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TCPStore allow list: '", text,
        "' is not a network: use ADDRESS or ADDRESS/BITS, as 10.0.0.0/8, "
        "127.0.0.1 or fd00::/8"));
  }
  return n;
}

// The peer's family and address bytes, IPv4-mapped IPv6 addresses (a
// dual-stack listener's IPv4 peers) as IPv4.
bool PeerAddress(const uv_tcp_t* tcp, int* family, unsigned char bytes[16]) {
  struct sockaddr_storage addr = {};
  int len = sizeof(addr);
  if (uv_tcp_getpeername(tcp, reinterpret_cast<struct sockaddr*>(&addr),
                         &len) != 0) {
    return false;
  }
  if (addr.ss_family == AF_INET) {
    *family = AF_INET;
    std::memcpy(bytes,
                &reinterpret_cast<const struct sockaddr_in*>(&addr)->sin_addr,
                4);
    return true;
  }
  const auto* a6 = reinterpret_cast<const struct sockaddr_in6*>(&addr);
  if (IN6_IS_ADDR_V4MAPPED(&a6->sin6_addr)) {
    *family = AF_INET;
    std::memcpy(bytes, a6->sin6_addr.s6_addr + 12, 4);
  } else {
    *family = AF_INET6;
    std::memcpy(bytes, a6->sin6_addr.s6_addr, 16);
  }
  return true;
}

}  // namespace

class TcpStoreServer::Loop {
 public:
  Loop(store::KvStore* store, TcpStoreServerOptions options)
      : store_(store),
        options_(std::move(options)),
        limits_{store_->limits().c10d_limits(), options_.max_request_bytes},
        own_budget_(
            options_.budget == nullptr
                ? std::make_unique<ConnectionBudget>(options_.max_connections)
                : nullptr),
        budget_(options_.budget != nullptr ? options_.budget
                                           : own_budget_.get()),
        log_(options_.log, options_.log_every) {
    read_buffer_.resize(kReadBufferBytes);
  }

  ~Loop() { Stop(); }

  absl::Status Start(int fd) {
    uv_loop_init(&loop_);
    uv_async_init(&loop_, &async_, &Loop::OnAsync);
    async_.data = this;
    // Requests read in one pass over the ready sockets are applied after
    // it, together (Drain).
    uv_check_init(&loop_, &check_);
    check_.data = this;
    uv_check_start(&check_, &Loop::OnCheck);
    uv_tcp_init(&loop_, &listener_);
    listener_.data = this;
    if (int rc = uv_tcp_open(&listener_, fd); rc != 0) {
      close(fd);
      return absl::InternalError(
          absl::StrCat("uv_tcp_open: ", uv_strerror(rc)));
    }
    if (int rc = uv_listen(reinterpret_cast<uv_stream_t*>(&listener_),
                           MaxBacklog(), &Loop::OnConnection);
        rc != 0) {
      return absl::InternalError(absl::StrCat("uv_listen: ", uv_strerror(rc)));
    }
    started_ = true;
    thread_ = std::thread([this] { Run(); });
    return absl::OkStatus();
  }

  // The loop thread. After traffic it polls without sleeping for up to
  // spin_after_activity, yielding the CPU between polls: a request that
  // arrives then is served without the wake-up of a sleeping thread (tens
  // of microseconds on a VM), and runnable clients still get the core.
  void Run() {
    loop_thread_ = std::this_thread::get_id();
    // libuv writes with write(2): to a peer that has gone, that raises
    // SIGPIPE, which would end the process that embeds the server unless
    // it ignores the signal. Blocked on this thread, the write fails with
    // EPIPE and the connection is closed.
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
    const int64_t spin_ns =
        absl::ToInt64Nanoseconds(options_.spin_after_activity);
    for (;;) {
      const int64_t now = absl::GetCurrentTimeNanos();
      if (!batch_.empty() && now - batch_since_ns_ >= kMaxBatchDelayNs) {
        Settle();
      }
      if (spin_ns > 0 && now - last_activity_ns_ < spin_ns) {
        if (uv_run(&loop_, UV_RUN_NOWAIT) == 0) break;
        sched_yield();
        continue;
      }
      // Nothing more is coming for now: commit before sleeping.
      if (!batch_.empty()) {
        Settle();
        continue;
      }
      if (uv_run(&loop_, UV_RUN_ONCE) == 0) break;
    }
  }

  void Stop() {
    if (!started_) return;
    {
      absl::MutexLock lock(&mu_);
      if (stop_requested_) return;
      stop_requested_ = true;
    }
    uv_async_send(&async_);
    thread_.join();
    uv_loop_close(&loop_);
  }

  TcpStoreServerStats Stats() {
    TcpStoreServerStats s;
    s.connections = connections_.load();
    s.blocked = blocked_.load();
    s.accepted = accepted_.load();
    s.closed_bad_input = closed_bad_input_.load();
    s.refused_not_allowed = refused_not_allowed_.load();
    s.refused_unauthenticated = refused_unauthenticated_.load();
    s.requests = requests_.load();
    s.unsent_bytes = unsent_total_reported_.load();
    s.peak_unsent_bytes = peak_unsent_.load();
    s.queue_bytes = store_->queue_stats().bytes;
    s.closed_slow_readers = closed_slow_readers_.load();
    s.refused_quota = refused_quota_.load();
    s.refused_no_budget = refused_no_budget_.load();
    return s;
  }

 private:
  enum class Block { kNone, kWait, kBarrier };

  struct WriteReq;

  struct Conn {
    uv_tcp_t tcp;
    Loop* loop = nullptr;
    uint64_t id = 0;
    std::string peer;
    // Whether the connection's first bytes were looked at for a namespace
    // hello, and the namespace it bound (empty: none).
    bool greeted = false;
    std::string name_space;
    std::optional<Dialect> dialect;
    // The quota owner it is charged to (null: none), and its token's
    // validity check (TcpStoreGrant).
    std::shared_ptr<const std::string> owner;
    std::function<absl::Status()> still_valid;
    bool charged_connection = false;
    size_t charged_wait_keys = 0;  // With one wait, while blocked.
    size_t counted = 0;    // Its unsent bytes as counted in unsent_total_.
    bool stalled = false;  // In stalled_ (as {counted, id}).
    std::string in;      // Unparsed bytes, when a request spans reads.
    size_t need = 0;     // Bytes `in` must hold before parsing again.
    std::string out;     // Replies not yet handed to the socket.
    size_t unsent = 0;   // Memory of the uv_write request not yet completed.
    // That request (one at a time); null when none.
    WriteReq* writing = nullptr;
    size_t used = 0;     // Bytes of `in` applied, erased after the commit.
    bool ready = false;  // Listed in ready_.
    bool reading = false;
    bool closing = false;
    Block block = Block::kNone;
    // The blocked request's query and when it was read (for on_query).
    Op blocked_op = Op::kWait;
    int64_t blocked_since_ns = 0;
    uint64_t seq = 0;  // Numbers blocking requests; stale completions differ.
    store::KvStore::WaitId wait_id = 0;
    // The keys of a 2.x WAIT, whose queues' pushes may end it.
    std::shared_ptr<const std::vector<std::string>> wait_keys;
    // Those of a WAIT a push ended, until the client pops: if it does
    // something else instead, the wake-up is passed on (PassWakes).
    std::shared_ptr<const std::vector<std::string>> woken_keys;
    // QUEUE_POPs of this connection in the batch not yet committed.
    size_t batched_pops = 0;
    std::string barrier_key;
  };

  // A change read but not committed: its connection and query.
  struct Queued {
    uint64_t conn = 0;
    Op op = Op::kSet;
    int64_t read_ns = 0;  // For on_query.
    // QUEUE_PUSH: the owner charged for it, and how much.
    std::shared_ptr<const std::string> owner;
    uint64_t charged = 0;
    // A QUEUE_POP whose connection closed before the commit: left out.
    bool dropped = false;
  };

  // Who was charged for a queue item (Quota::kQueueBytes), until it is
  // popped.
  struct ItemOwner {
    std::shared_ptr<const std::string> owner;
    uint64_t bytes = 0;
  };

  struct WriteReq {
    uv_write_t req;
    std::string data;
    uv_buf_t buf;
  };

  struct Barrier {
    store::KvStore::WatchId watch = 0;
    // conn id -> (seq, count to wait for)
    absl::flat_hash_map<uint64_t, std::pair<uint64_t, int64_t>> waiting;
  };

  // ---- libuv callbacks (loop thread) ----

  static void OnAsync(uv_async_t* handle) {
    static_cast<Loop*>(handle->data)->RunPosted();
  }

  static void OnCheck(uv_check_t* handle) {
    Loop* loop = static_cast<Loop*>(handle->data);
    loop->Drain();
    loop->AcceptDeferred();
  }

  static void OnConnection(uv_stream_t* server, int status) {
    static_cast<Loop*>(server->data)->Accept(status);
  }

  static void OnAlloc(uv_handle_t* handle, size_t, uv_buf_t* buf) {
    Loop* loop = static_cast<Conn*>(handle->data)->loop;
    *buf = uv_buf_init(loop->read_buffer_.data(), loop->read_buffer_.size());
  }

  static void OnRead(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buf) {
    Conn* c = static_cast<Conn*>(stream->data);
    Loop* loop = c->loop;
    if (nread < 0) {
      loop->Close(*c,
                  nread == UV_EOF || nread == UV_ECONNRESET
                      ? std::string()
                      : absl::StrCat("read failed: ", uv_strerror(nread)),
                  /*bad_input=*/false);
      return;
    }
    c->in.append(buf->base, nread);
    loop->last_activity_ns_ = absl::GetCurrentTimeNanos();
    loop->MarkReady(*c);
  }

  static void OnWritten(uv_write_t* req, int status) {
    auto* w = reinterpret_cast<WriteReq*>(req);
    Conn* c = static_cast<Conn*>(req->data);
    delete w;
    if (c->closing) return;
    c->writing = nullptr;
    c->unsent = 0;
    Loop* loop = c->loop;
    loop->Recount(*c);
    if (status < 0) {
      loop->Close(*c, absl::StrCat("write failed: ", uv_strerror(status)),
                  false);
      return;
    }
    loop->MarkReady(*c);
  }

  static void OnClosed(uv_handle_t* handle) {
    delete static_cast<Conn*>(handle->data);
  }

  // ---- connections ----

  void Accept(int status) {
    if (status < 0) {
      log_.Log(absl::StrCat("TCPStore listener: accept failed: ",
                            uv_strerror(status)));
      return;
    }
    // An accept storm (thousands of ranks connecting at once) is taken
    // kAcceptBurst connections per loop pass, and the connections already
    // open are served in between: the rest wait in the kernel's backlog
    // (sized from somaxconn). Not accepting here makes libuv stop watching
    // the socket until AcceptDeferred's uv_accept watches it again.
    if (accepted_this_pass_ >= kAcceptBurst) {
      accept_deferred_ = true;
      return;
    }
    ++accepted_this_pass_;
    AcceptOne();
  }

  // Called at each pass's end.
  void AcceptDeferred() {
    accepted_this_pass_ = 0;
    if (!accept_deferred_) return;
    accept_deferred_ = false;
    ++accepted_this_pass_;
    AcceptOne();
  }

  void AcceptOne() {
    auto* c = new Conn;
    c->loop = this;
    uv_tcp_init(&loop_, &c->tcp);
    c->tcp.data = c;
    if (uv_accept(reinterpret_cast<uv_stream_t*>(&listener_),
                  reinterpret_cast<uv_stream_t*>(&c->tcp)) != 0) {
      uv_close(reinterpret_cast<uv_handle_t*>(&c->tcp), &Loop::OnClosed);
      return;
    }
    ++accepted_;
    if (!budget_->TryTake()) {
      ++refused_no_budget_;
      log_.Log(absl::StrCat(
          "refusing TCPStore connection from ", PeerName(&c->tcp), ": ",
          budget_->max(),
          " connections are open across cohortd's gRPC and TCPStore "
          "listeners (--max_connections)"));
      uv_close(reinterpret_cast<uv_handle_t*>(&c->tcp), &Loop::OnClosed);
      return;
    }
    if (!Allowed(c->tcp)) {
      budget_->Give();
      ++refused_not_allowed_;
      log_.Log(absl::StrCat("refusing TCPStore connection from ",
                            PeerName(&c->tcp),
                            ": not in the allowed networks (--tcpstore_allow)"));
      uv_close(reinterpret_cast<uv_handle_t*>(&c->tcp), &Loop::OnClosed);
      return;
    }
    uv_tcp_nodelay(&c->tcp, 1);
    c->peer = PeerName(&c->tcp);
    c->name_space = options_.prefix;
    c->id = next_conn_id_++;
    conns_.emplace(c->id, c);
    connections_ = conns_.size();
    UpdateReading(*c);
  }

  bool Allowed(const uv_tcp_t& tcp) const {
    if (networks_.empty()) return true;
    int family = 0;
    unsigned char bytes[16] = {};
    if (!PeerAddress(&tcp, &family, bytes)) return false;
    for (const Network& n : networks_) {
      if (n.Contains(family, bytes)) return true;
    }
    return false;
  }

  Conn* Find(uint64_t id) {
    auto it = conns_.find(id);
    return it == conns_.end() ? nullptr : it->second;
  }

  void Close(Conn& c, absl::string_view why, bool bad_input) {
    if (c.closing) return;
    if (!why.empty()) {
      log_.Log(
          absl::StrCat("closing TCPStore connection from ", c.peer, ": ", why));
    }
    if (bad_input) ++closed_bad_input_;
    CancelBlock(c);
    PassWakes(c);
    if (c.batched_pops > 0) {
      // Its pops are not committed: nobody would get their items. A pop a
      // push woke it for passes the wake-up on.
      std::vector<std::string> queues;
      for (size_t i = 0; i < batch_from_.size(); ++i) {
        Queued& q = batch_from_[i];
        if (q.conn != c.id || q.op != Op::kQueuePop) continue;
        q.dropped = true;
        queues.emplace_back(batch_[i].key);
      }
      c.batched_pops = 0;
      store_->PassQueueWakes(queues);
    }
    c.closing = true;
    // Its replies' memory goes now, not once libuv has closed the socket
    // (after this pass), so that what CloseSlowReaders frees is free before
    // anything more is served. libuv closes the descriptor here and never
    // reads a pending write's bytes again.
    if (c.writing != nullptr) std::string().swap(c.writing->data);
    std::string().swap(c.out);
    std::string().swap(c.in);
    Recount(c);
    budget_->Give();  // Taken when it was accepted.
    if (c.charged_connection) Uncharge(c.owner, Quota::kConnections, 1);
    c.charged_connection = false;
    conns_.erase(c.id);
    connections_ = conns_.size();
    uv_close(reinterpret_cast<uv_handle_t*>(&c.tcp), &Loop::OnClosed);
  }

  // The memory the connection's replies hold: buffers' capacities, which
  // the bytes still to send may be far short of.
  static size_t Unsent(const Conn& c) {
    return c.unsent + (c.out.empty() ? 0 : c.out.capacity());
  }

  // Brings unsent_total_ and stalled_ up to date with the connection's
  // replies.
  void Recount(Conn& c) {
    const size_t now = c.closing ? 0 : Unsent(c);
    if (c.stalled) stalled_.erase({c.counted, c.id});
    c.stalled = !c.closing && c.unsent > 0;
    if (c.stalled) stalled_.insert({now, c.id});
    unsent_total_ = unsent_total_ - c.counted + now;
    c.counted = now;
    unsent_total_reported_.store(unsent_total_, std::memory_order_relaxed);
    if (unsent_total_ > peak_unsent_.load(std::memory_order_relaxed)) {
      peak_unsent_.store(unsent_total_, std::memory_order_relaxed);
    }
  }

  bool UnderPressure() const {
    return unsent_total_ > options_.max_unsent_bytes_total;
  }

  // Over its own bound; or, while all connections together are over theirs,
  // holding any replies at all.
  bool Backlogged(const Conn& c) const {
    const size_t unsent = Unsent(c);
    return unsent > options_.max_unsent_bytes ||
           (unsent > 0 && UnderPressure());
  }

  // While the replies queued for all connections pass
  // max_unsent_bytes_total, closes the connections holding replies the
  // kernel would not take (their peers are not reading), the largest first.
  // Connections whose peers read hold nothing here, so they are never
  // chosen.
  void CloseSlowReaders() {
    const size_t held = unsent_total_;
    while (UnderPressure() && !stalled_.empty()) {
      Conn* c = Find(std::prev(stalled_.end())->second);
      if (c == nullptr) {  // Not expected: Close recounts.
        stalled_.erase(std::prev(stalled_.end()));
        continue;
      }
      ++closed_slow_readers_;
      Close(*c,
            absl::StrCat("it has not read ", Unsent(*c),
                         " bytes of replies, and ", held,
                         " bytes are queued for all connections, over "
                         "--tcpstore_max_unsent_bytes_total=",
                         options_.max_unsent_bytes_total,
                         ": a client must read the replies to what it sends"),
            false);
    }
  }

  // Charges the connection's owner; OK when it has none or quotas are off.
  absl::Status Charge(const Conn& c, Quota quota, uint64_t amount) {
    if (options_.quotas == nullptr || c.owner == nullptr) {
      return absl::OkStatus();
    }
    return options_.quotas->Take(*c.owner, quota, amount);
  }

  void Uncharge(const std::shared_ptr<const std::string>& owner, Quota quota,
                uint64_t amount) {
    if (options_.quotas == nullptr || owner == nullptr || amount == 0) return;
    options_.quotas->Give(*owner, quota, amount);
  }

  // Closes the connection for a request over a quota.
  void OverQuota(Conn& c, Op op, const absl::Status& why) {
    ++refused_quota_;
    Close(c, absl::StrCat(OpName(op), " refused: ", why.message()), false);
  }

  // Binds the connection to its quota owner and charges it the connection.
  // False when that is over the quota (the connection is then closed).
  bool Bind(Conn& c, std::string owner) {
    if (!owner.empty()) {
      c.owner = std::make_shared<const std::string>(std::move(owner));
    }
    if (absl::Status s = Charge(c, Quota::kConnections, 1); !s.ok()) {
      ++refused_quota_;
      Close(c, absl::StrCat("refused: ", s.message()), false);
      return false;
    }
    c.charged_connection = c.owner != nullptr && options_.quotas != nullptr;
    return true;
  }

  // Reads while the connection can use more input: not while its replies
  // pile up unread, nor while complete requests wait in `in` (behind a
  // blocked one, or for the replies to drain).
  void UpdateReading(Conn& c) {
    if (c.closing) return;
    const bool want =
        !Backlogged(c) && !(!c.in.empty() && c.in.size() >= c.need);
    if (want == c.reading) return;
    auto* stream = reinterpret_cast<uv_stream_t*>(&c.tcp);
    if (want) {
      uv_read_start(stream, &Loop::OnAlloc, &Loop::OnRead);
    } else {
      uv_read_stop(stream);
    }
    c.reading = want;
  }

  void Flush(Conn& c) {
    if (c.closing || c.out.empty() || c.unsent > 0) return;
    auto* stream = reinterpret_cast<uv_stream_t*>(&c.tcp);
    uv_buf_t b = uv_buf_init(c.out.data(), c.out.size());
    int n = uv_try_write(stream, &b, 1);
    if (n < 0 && n != UV_EAGAIN) {
      Close(c, absl::StrCat("write failed: ", uv_strerror(n)), false);
      return;
    }
    if (n > 0 && static_cast<size_t>(n) == c.out.size()) {
      // A big reply's buffer is let go, not kept for the next, small one.
      if (c.out.capacity() > kReadBufferBytes) {
        std::string().swap(c.out);
      } else {
        c.out.clear();
      }
      return;
    }
    auto* w = new WriteReq;
    if (n > 0) {
      // The rest in a buffer of its own size: the one the replies were
      // built in may be many times larger, and it would be held (and
      // counted) until the peer reads.
      w->data.assign(c.out, n);
      std::string().swap(c.out);
    } else {
      w->data = std::move(c.out);
      c.out.clear();
    }
    w->buf = uv_buf_init(w->data.data(), w->data.size());
    w->req.data = &c;
    c.unsent += w->data.capacity();
    c.writing = w;
    uv_write(&w->req, stream, &w->buf, 1, &Loop::OnWritten);
  }

  // Has Drain look at the connection: new bytes, a wait that ended, room
  // for replies.
  void MarkReady(Conn& c) {
    if (c.ready || c.closing) return;
    c.ready = true;
    ready_.push_back(c.id);
  }

  // Applies what the ready connections sent, commits their changes as one
  // batch, and sends the replies; again while that readies more (waits it
  // completed).
  void Drain() {
    // Waits ended outside a pass (a connection closed, passing its
    // wake-up on) ready their connections here.
    RunLocal();
    while (!ready_.empty()) {
      std::vector<uint64_t> round;
      round.swap(ready_);
      for (uint64_t id : round) {
        Conn* c = Find(id);
        if (c == nullptr) continue;
        c->ready = false;
        if (!c->in.empty() && c->in.size() >= c->need) {
          c->used = Process(*c, c->in);
        }
      }
      if (MustCommit()) CommitBatch();
      for (uint64_t id : round) {
        Conn* c = Find(id);
        if (c == nullptr) continue;
        if (c->used > 0) c->in.erase(0, std::exchange(c->used, 0));
        if (c->in.empty() && c->in.capacity() > kReadBufferBytes) {
          std::string().swap(c->in);
        }
        Flush(*c);
        if (c->closing) continue;
        Recount(*c);
        UpdateReading(*c);
        // Requests it sent are still to be served, and no write completion
        // will ready it (the kernel took every reply).
        if (!c->in.empty() && c->in.size() >= c->need &&
            c->block == Block::kNone && !Backlogged(*c)) {
          MarkReady(*c);
        }
      }
      RunLocal();
      CloseSlowReaders();
    }
  }

  // Whether the queued changes must be committed at the end of this pass.
  // Changes without a reply (SET, APPEND) may wait for more, so that a
  // stream of them shares write-ahead log writes: until a request needs a
  // reply (from any connection: every read commits first), the batch is
  // large, kMaxBatchDelayNs pass, or the loop is about to sleep. Nobody
  // has been told of them, so nothing acknowledged waits; and as with
  // torch's own server, a SET still in flight is not yet visible.
  bool MustCommit() const {
    return batch_wants_reply_ ||
           options_.spin_after_activity <= absl::ZeroDuration() ||
           batch_.size() >= kMaxBatchChanges ||
           batch_bytes_ >= kMaxBatchBytes ||
           absl::GetCurrentTimeNanos() - batch_since_ns_ >= kMaxBatchDelayNs;
  }

  // Commits what is queued outside a pass, then serves what that readied.
  void Settle() {
    CommitBatch();
    RunLocal();
    Drain();
  }

  // Applies the changes queued since the last commit as one KvStore batch
  // (one write-ahead log record) and queues their replies.
  void CommitBatch() {
    if (batch_.empty()) return;
    // Pops of connections closed since they were read are left out.
    std::vector<Queued> from;
    std::vector<store::Change> changes;
    for (size_t i = 0; i < batch_.size(); ++i) {
      if (batch_from_[i].dropped) continue;
      changes.push_back(batch_[i]);
      from.push_back(std::move(batch_from_[i]));
    }
    batch_.clear();
    batch_from_.clear();
    batch_bytes_ = 0;
    batch_push_bytes_ = 0;
    batch_wants_reply_ = false;
    std::vector<store::ChangeResult> results = store_->ApplyBatch(changes);
    for (size_t i = 0; i < results.size(); ++i) {
      const store::ChangeResult& r = results[i];
      const Op op = from[i].op;
      Observe(op, from[i].read_ns,
              r.status.ok() ? TcpStoreOutcome::kOk : TcpStoreOutcome::kFailed);
      if (op == Op::kQueuePush) Charged(from[i], r);
      if (op == Op::kQueuePop && r.status.ok()) Popped(r);
      Conn* c = Find(from[i].conn);
      if (c == nullptr) continue;
      if (op == Op::kQueuePop) --c->batched_pops;
      if (!r.status.ok()) {
        Close(*c, absl::StrCat(OpName(op), " failed: ", r.status.message()),
              false);
        continue;
      }
      Encoder reply(&c->out);
      if (op == Op::kAdd || op == Op::kDeleteKey) reply.I64(r.number);
      if (op == Op::kCompareSet) reply.Bytes(r.value);
      if (op == Op::kQueuePop) {
        reply.I64(r.number);
        if (r.number > 0) reply.Bytes(r.value);
      }
    }
    batch_strings_.clear();
  }

  // A push committed (its owner's charge now follows the item), or not
  // (the charge is given back).
  void Charged(const Queued& q, const store::ChangeResult& r) {
    if (q.owner == nullptr || options_.quotas == nullptr) return;
    if (!r.status.ok()) {
      Uncharge(q.owner, Quota::kQueueBytes, q.charged);
      return;
    }
    item_owners_[r.queue_item] = {q.owner, q.charged};
  }

  // An item popped: its pusher's charge is given back (items pushed before
  // a restart, or through another replica, were charged to nobody here).
  void Popped(const store::ChangeResult& r) {
    if (r.number == 0) return;
    auto it = item_owners_.find(r.queue_item);
    if (it == item_owners_.end()) return;
    Uncharge(it->second.owner, Quota::kQueueBytes, it->second.bytes);
    item_owners_.erase(it);
  }

  // Queues a change for the next commit, with copies of its strings (the
  // connection's buffer moves on before then).
  Queued& Queue(Conn& c, Op op, store::Change change) {
    auto keep = [this](absl::string_view bytes) -> absl::string_view {
      if (bytes.empty()) return bytes;
      batch_bytes_ += bytes.size();
      return batch_strings_.emplace_back(bytes);
    };
    change.key = keep(change.key);
    change.value = keep(change.value);
    change.expected = keep(change.expected);
    if (batch_.empty()) batch_since_ns_ = absl::GetCurrentTimeNanos();
    batch_.push_back(change);
    batch_from_.push_back({.conn = c.id, .op = op, .read_ns = read_ns_});
    if (op != Op::kSet && op != Op::kAppend && op != Op::kQueuePush) {
      batch_wants_reply_ = true;
    }
    return batch_from_.back();
  }

  // Parses and applies requests from the front of `bytes` until one is
  // incomplete or blocks. Returns the bytes used.
  size_t Process(Conn& c, absl::string_view bytes) {
    size_t pos = 0;
    c.need = 0;
    while (!c.closing && pos < bytes.size() && !Backlogged(c)) {
      absl::string_view rest = bytes.substr(pos);
      if (!c.greeted) {
        if (!tcpstore::IsNamespaceHello(rest[0])) {
          if (options_.require_token) {
            ++refused_unauthenticated_;
            Close(c,
                  "this listener needs a token (cohortd runs with "
                  "--auth_tokens) and a torch client cannot send one: run "
                  "the job under cohortrun, whose node proxy sends its "
                  "workers' token",
                  /*bad_input=*/false);
            break;
          }
          c.greeted = true;
          if (!Bind(c, absl::StrCat("connection ", c.peer))) break;
          continue;
        }
        absl::string_view name_space, token;
        ParseResult hello =
            tcpstore::ParseNamespaceHello(rest, &name_space, &token);
        if (hello.status == ParseStatus::kIncomplete) {
          c.need = hello.size;
          break;
        }
        if (hello.status == ParseStatus::kInvalid) {
          Close(c, absl::StrCat("bad namespace hello: ", hello.error),
                /*bad_input=*/true);
          break;
        }
        const std::string bound = absl::StrCat(options_.prefix, name_space);
        std::string owner = absl::StrCat("connection ", c.peer);
        if (!token.empty() || options_.require_token) {
          absl::StatusOr<TcpStoreGrant> allowed =
              token.empty()
                  ? absl::UnauthenticatedError("its hello carries no token")
              : options_.authorize
                  ? options_.authorize(token, bound)
                  : absl::FailedPreconditionError(
                        "this listener takes no tokens (cohortd runs "
                        "without --auth_tokens)");
          if (!allowed.ok()) {
            ++refused_unauthenticated_;
            Close(c, absl::StrCat("refused: ", allowed.status().message()),
                  /*bad_input=*/false);
            break;
          }
          owner = std::move(allowed->owner);
          c.still_valid = std::move(allowed->still_valid);
        }
        c.name_space = bound;
        c.greeted = true;
        pos += hello.size;
        if (!Bind(c, std::move(owner))) break;
        continue;
      }
      if (!c.dialect.has_value()) {
        c.dialect = tcpstore::DetectDialect(rest);
        if (!c.dialect.has_value()) {
          c.need = rest.size() + 1;
          break;
        }
      }
      if (c.block == Block::kWait && *c.dialect == Dialect::kTorch113) {
        // A 1.13 client has no CANCEL_WAIT, and it sends nothing while it
        // waits (it is synchronous): a request now means its wait timed
        // out on its side. Forget the wait without a word (a STOP_WAITING
        // later would be read as the start of another reply) and serve
        // the request.
        CancelBlock(c);
      }
      if (c.block != Block::kNone) {
        // Replies go out in order, so only CANCEL_WAIT may pass a request
        // that is still waiting.
        if (*c.dialect == Dialect::kTorch21 &&
            static_cast<uint8_t>(rest[0]) ==
                *tcpstore::OpCode(Dialect::kTorch21, Op::kCancelWait)) {
          CancelBlock(c);
          Encoder(&c.out).U8(static_cast<uint8_t>(WaitReply::kWaitCanceled));
          ++pos;
          if (options_.on_query) {
            Observe(Op::kCancelWait, absl::GetCurrentTimeNanos(),
                    TcpStoreOutcome::kOk);
          }
          continue;
        }
        break;
      }
      Request request;
      ParseResult parsed =
          tcpstore::ParseRequest(*c.dialect, rest, limits_, &request);
      if (parsed.status == ParseStatus::kIncomplete) {
        c.need = parsed.size;
        break;
      }
      if (parsed.status == ParseStatus::kInvalid) {
        Close(c,
              absl::StrCat(parsed.error, " (", DialectName(*c.dialect),
                           " protocol; first bytes \"",
                           absl::CHexEscape(rest.substr(0, 16)), "\")"),
              /*bad_input=*/true);
        break;
      }
      pos += parsed.size;
      ++requests_;
      read_ns_ = options_.on_query ? absl::GetCurrentTimeNanos() : 0;
      if (c.still_valid) {
        // A token revoked (or expired) since the hello ends its connection
        // at its next request.
        if (absl::Status valid = c.still_valid(); !valid.ok()) {
          ++refused_unauthenticated_;
          Close(c,
                absl::StrCat("its token is no longer valid: ", valid.message()),
                false);
          break;
        }
      }
      if (c.name_space.empty()) {
        Handle(c, request);
      } else {
        std::deque<std::string> keys;
        Handle(c, InNamespace(c.name_space, request, keys));
      }
      Handled(c, request.op);
      if (c.closing) break;
      if (UnderPressure()) {
        // Hand the reply to the kernel now: a reader's leaves cohortd at
        // once, and one stranded by a peer that does not read is counted
        // before anything else is served.
        Flush(c);
        if (c.closing) break;
        Recount(c);
        CloseSlowReaders();
      } else {
        Recount(c);
      }
    }
    return pos;
  }

  // Reports a request Handle dealt with at once; those it queued are
  // reported by CommitBatch, those that block when they end (ClearBlock).
  void Handled(Conn& c, Op op) {
    if (!options_.on_query) return;
    if (c.closing) return Observe(op, read_ns_, TcpStoreOutcome::kFailed);
    if (c.block != Block::kNone) {
      c.blocked_op = op;
      c.blocked_since_ns = read_ns_;
      return;
    }
    switch (op) {
      case Op::kSet:
      case Op::kAppend:
      case Op::kAdd:
      case Op::kCompareSet:
      case Op::kDeleteKey:
      case Op::kQueuePush:
      case Op::kQueuePop:
        return;
      default:
        return Observe(op, read_ns_, TcpStoreOutcome::kOk);
    }
  }

  void Observe(Op op, int64_t read_ns, TcpStoreOutcome outcome) {
    if (!options_.on_query) return;
    options_.on_query(op, outcome,
                      absl::Nanoseconds(absl::GetCurrentTimeNanos() - read_ns));
  }

  // ---- requests ----

  void Handle(Conn& c, const Request& r) {
    using Kind = store::Change::Kind;
    // The protocol has no error reply: a refused request closes the
    // connection, which torch's client reports as a failed call.
    if (absl::Status s = CheckClientWrites(r); !s.ok()) {
      Close(c, absl::StrCat(OpName(r.op), " refused: ", s.message()), false);
      return;
    }
    if (c.woken_keys != nullptr) {
      // After a WAIT, a client pops the queue that ended it; anything else
      // means it will not, and the push's wake-up goes to another waiter.
      if (r.op == Op::kQueuePop &&
          std::find(c.woken_keys->begin(), c.woken_keys->end(), r.key) !=
              c.woken_keys->end()) {
        c.woken_keys = nullptr;
      } else {
        PassWakes(c);
      }
    }
    switch (r.op) {
      case Op::kSet:
        Queue(c, r.op, {.kind = Kind::kSet, .key = r.key, .value = r.value});
        return;
      case Op::kAppend:
        Queue(c, r.op, {.kind = Kind::kAppend, .key = r.key, .value = r.value});
        return;
      case Op::kAdd:
        Queue(c, r.op, {.kind = Kind::kAdd, .key = r.key, .delta = r.number});
        return;
      case Op::kCompareSet:
        Queue(c, r.op,
              {.kind = Kind::kCompareSet,
               .key = r.key,
               .value = r.value,
               .expected = r.expected});
        return;
      case Op::kDeleteKey:
        Queue(c, r.op, {.kind = Kind::kDelete, .key = r.key});
        return;
      case Op::kQueuePush:
        return QueuePush(c, r);
      case Op::kQueuePop:
        // Committed with the batch, like a write (it is one); its reply
        // follows those of the changes before it.
        Queue(c, r.op, {.kind = Kind::kQueuePop, .key = r.key});
        ++c.batched_pops;
        return;
      default:
        break;
    }
    // Everything else reads the store or answers at once: its reply goes
    // after those of the changes queued before it.
    CommitBatch();
    if (c.closing) return;
    Encoder reply(&c.out);
    auto fail = [&](absl::string_view what, const absl::Status& status) {
      Close(c, absl::StrCat(what, " failed: ", status.message()), false);
    };
    switch (r.op) {
      case Op::kSet:
      case Op::kAppend:
      case Op::kAdd:
      case Op::kCompareSet:
      case Op::kDeleteKey:
      case Op::kQueuePush:
      case Op::kQueuePop:
        return;
      case Op::kValidate:
        if (r.word != tcpstore::kValidateMagic) {
          Close(c,
                absl::StrFormat("VALIDATE with magic 0x%08x, not 0x%08x",
                                r.word, tcpstore::kValidateMagic),
                true);
        }
        return;
      case Op::kPing:
        reply.U32(r.word);
        return;
      case Op::kMultiSet:
        if (auto s = store_->MultiSet(Strings(r.keys), Strings(r.values));
            !s.ok()) {
          fail("MULTI_SET", s.status());
        }
        return;
      case Op::kGet: {
        auto s = store_->TryGet(r.key);
        if (!s.ok()) return fail("GET", s.status());
        if (s->has_value()) {
          reply.Bytes(**s);
        } else if (*c.dialect == Dialect::kTorch21) {
          reply.Bytes("");
        } else {
          // 1.13's server drops such a connection too; its client always
          // waits for the key before getting it.
          Close(c,
                absl::StrCat("GET of missing key \"", absl::CHexEscape(r.key),
                             "\""),
                false);
        }
        return;
      }
      case Op::kCheck: {
        // A key whose queue holds items exists too, as on torch's server.
        auto s = store_->CheckKeysOrQueues(Strings(r.keys));
        if (!s.ok()) return fail("CHECK", s.status());
        reply.U8(static_cast<uint8_t>(s->all_exist ? CheckReply::kReady
                                                   : CheckReply::kNotReady));
        return;
      }
      case Op::kWait:
        StartWait(c, r.keys);
        return;
      case Op::kNumKeys: {
        // (Queue items are not counted: KvStore::NumKeys.)
        auto s = store_->NumKeys(c.name_space);
        if (!s.ok()) return fail("GETNUMKEYS", s.status());
        reply.I64(s->num_keys);
        return;
      }
      case Op::kMultiGet:
        for (absl::string_view key : r.keys) {
          auto s = store_->TryGet(key);
          if (!s.ok()) return fail("MULTI_GET", s.status());
          reply.Bytes(s->has_value() ? absl::string_view(**s) : "");
        }
        return;
      case Op::kCancelWait:
        CancelBlock(c);
        reply.U8(static_cast<uint8_t>(WaitReply::kWaitCanceled));
        return;
      case Op::kListKeys: {
        std::vector<std::string> keys;
        std::string token;
        do {
          auto page = store_->ListKeys(c.name_space, 0, token);
          if (!page.ok()) return fail("LIST_KEYS", page.status());
          for (std::string& k : page->keys) {
            if (absl::StartsWith(k, store::kQueuePrefix)) continue;
            k.erase(0, c.name_space.size());
            keys.push_back(std::move(k));
          }
          token = std::move(page->next_page_token);
        } while (!token.empty());
        reply.I64(keys.size());
        for (const std::string& k : keys) reply.Bytes(k);
        return;
      }
      case Op::kBarrier: {
        auto s = store_->Add(r.key, 1);
        if (!s.ok()) return fail("BARRIER", s.status());
        if (s->value >= r.number) {
          reply.U8(static_cast<uint8_t>(WaitReply::kStopWaiting));
        } else {
          StartBarrier(c, r.key, r.number, s->revision);
        }
        return;
      }
      case Op::kQueueLen: {
        auto s = store_->QueueLen(r.key);
        if (!s.ok()) return fail("QUEUE_LEN", s.status());
        reply.I64(*s);
        return;
      }
      case Op::kWatchKey:
        Close(c,
              "WATCH_KEY is not supported (PyTorch removed Store.watch_key in "
              "2.1); watch keys with `cohortctl watch` or the gRPC Watch call",
              false);
        return;
    }
  }

  // Queues the push, once the limits allow it: all queues together hold at
  // most max_queue_bytes_total (counted by the store, so items kept over a
  // restart count too), each owner at most its quota.
  void QueuePush(Conn& c, const Request& r) {
    const uint64_t held = store_->queue_stats().bytes + batch_push_bytes_;
    if (held + r.value.size() > options_.max_queue_bytes_total) {
      return OverQuota(
          c, r.op,
          absl::ResourceExhaustedError(absl::StrCat(
              "the queues hold ", held, " bytes, and ", r.value.size(),
              " more would pass --tcpstore_max_queue_bytes=",
              options_.max_queue_bytes_total,
              ": pop what the queues hold first")));
    }
    if (absl::Status s = Charge(c, Quota::kQueueBytes, r.value.size());
        !s.ok()) {
      return OverQuota(c, r.op, s);
    }
    Queued& q = Queue(c, r.op,
                      {.kind = store::Change::Kind::kQueuePush,
                       .key = r.key,
                       .value = r.value});
    q.owner = c.owner;
    q.charged = r.value.size();
    batch_push_bytes_ += r.value.size();
  }

  // Passes on the wake-ups of the connection's last WAIT, which it will not
  // follow with a QUEUE_POP (see KvStore::PassQueueWakes).
  void PassWakes(Conn& c) {
    if (c.woken_keys == nullptr) return;
    store_->PassQueueWakes(*std::exchange(c.woken_keys, nullptr));
  }

  void StopWaiting(Conn& c) {
    Encoder(&c.out).U8(static_cast<uint8_t>(WaitReply::kStopWaiting));
  }

  // A key whose queue holds items counts as present, and a push ends one
  // WAIT only (KvStore::WaitForKeysOrQueues): torch's blocking queue_pop
  // is a WAIT, then a QUEUE_POP.
  void StartWait(Conn& c, const std::vector<absl::string_view>& keys) {
    std::vector<std::string> waited = Strings(keys);
    auto s = store_->CheckKeysOrQueues(waited);
    if (!s.ok()) {
      Close(c, absl::StrCat("WAIT failed: ", s.status().message()), false);
      return;
    }
    if (s->all_exist) {
      StopWaiting(c);
      return;
    }
    if (!ChargeWait(c, Op::kWait, waited.size())) return;
    c.block = Block::kWait;
    ++blocked_;
    const uint64_t id = c.id;
    const uint64_t seq = ++c.seq;
    std::shared_ptr<const std::vector<std::string>> queues;
    if (*c.dialect == Dialect::kTorch21) {
      // (1.13 has no queues.)
      queues = std::make_shared<const std::vector<std::string>>(waited);
      c.wait_keys = queues;
    }
    c.wait_id = store_->WaitForKeysOrQueues(
        std::move(waited), absl::InfiniteDuration(),
        [this, id, seq, queues](absl::StatusOr<store::ReadResult> result) {
          const bool push = result.ok() && result->queue_wake;
          Post([this, id, seq, queues, push, status = result.status()] {
            Conn* c = Find(id);
            if (c != nullptr && Complete(*c, seq, status, push)) return;
            // Ended by a push for a client that is gone or no longer
            // waits: another waiter must get the item.
            if (push && queues != nullptr) store_->PassQueueWakes(*queues);
          });
        });
  }

  // Charges a wait on `keys` keys to the connection's owner; false (and the
  // connection closed) when that is over a quota.
  bool ChargeWait(Conn& c, Op op, size_t keys) {
    if (absl::Status s = Charge(c, Quota::kWaits, 1); !s.ok()) {
      OverQuota(c, op, s);
      return false;
    }
    if (absl::Status s = Charge(c, Quota::kWaitedKeys, keys); !s.ok()) {
      Uncharge(c.owner, Quota::kWaits, 1);
      OverQuota(c, op, s);
      return false;
    }
    c.charged_wait_keys = keys;
    return true;
  }

  void StartBarrier(Conn& c, absl::string_view key, int64_t target,
                    int64_t revision) {
    if (!ChargeWait(c, Op::kBarrier, 1)) return;
    Barrier& b = barriers_[key];
    if (b.watch == 0) {
      std::string k(key);
      auto watch = store_->Watch(
          key, revision + 1,
          [this, k](std::vector<store::Event> events) {
            std::optional<int64_t> latest;
            for (const store::Event& e : events) {
              int64_t v = 0;
              if (e.key == k && e.value != nullptr &&
                  absl::SimpleAtoi(*e.value, &v)) {
                latest = v;
              }
            }
            if (latest.has_value()) {
              Post([this, k, v = *latest] { OnBarrierCount(k, v); });
            }
          },
          [this, k](absl::Status status) {
            Post([this, k, status] { OnBarrierClosed(k, status); });
          });
      if (!watch.ok()) {
        barriers_.erase(key);
        Uncharge(c.owner, Quota::kWaits, 1);
        Uncharge(c.owner, Quota::kWaitedKeys, 1);
        c.charged_wait_keys = 0;
        Close(c, absl::StrCat("BARRIER failed: ", watch.status().message()),
              false);
        return;
      }
      b.watch = watch->id;
    }
    c.block = Block::kBarrier;
    ++blocked_;
    c.barrier_key = std::string(key);
    b.waiting[c.id] = {++c.seq, target};
  }

  void OnBarrierCount(const std::string& key, int64_t count) {
    auto it = barriers_.find(key);
    if (it == barriers_.end()) return;
    std::vector<uint64_t> done;
    for (const auto& [id, wait] : it->second.waiting) {
      if (count >= wait.second) done.push_back(id);
    }
    for (uint64_t id : done) {
      it = barriers_.find(key);
      if (it == barriers_.end()) return;
      auto wait = it->second.waiting.find(id);
      Conn* c = Find(id);
      if (wait == it->second.waiting.end() || c == nullptr) continue;
      Complete(*c, wait->second.first, absl::OkStatus());
    }
  }

  void OnBarrierClosed(const std::string& key, const absl::Status& status) {
    auto it = barriers_.find(key);
    if (it == barriers_.end()) return;
    std::vector<uint64_t> ids;
    for (const auto& [id, wait] : it->second.waiting) ids.push_back(id);
    it->second.watch = 0;  // Ended by the store; nothing to cancel.
    for (uint64_t id : ids) {
      if (Conn* c = Find(id)) {
        Close(*c, absl::StrCat("BARRIER ended: ", status.message()), false);
      }
    }
  }

  // Ends the connection's blocked request with STOP_WAITING (or closes it
  // with the store's error), then carries on with what it sent since.
  // Whether it was still waiting for this. `push`: a WAIT ended by a push,
  // whose item the client is expected to pop.
  bool Complete(Conn& c, uint64_t seq, const absl::Status& status,
                bool push = false) {
    if (c.closing || c.block == Block::kNone || c.seq != seq) return false;
    if (!status.ok()) {
      ClearBlock(c, TcpStoreOutcome::kFailed);
      Close(c, absl::StrCat("wait ended: ", status.message()), false);
      return true;
    }
    if (push) c.woken_keys = c.wait_keys;
    ClearBlock(c, TcpStoreOutcome::kOk);
    StopWaiting(c);
    MarkReady(c);
    return true;
  }

  // Forgets the connection's blocked request, wherever it is indexed; it
  // ended with `outcome`.
  void ClearBlock(Conn& c, TcpStoreOutcome outcome) {
    if (c.block == Block::kNone) return;
    Observe(c.blocked_op, c.blocked_since_ns, outcome);
    --blocked_;
    Uncharge(c.owner, Quota::kWaits, 1);
    Uncharge(c.owner, Quota::kWaitedKeys, c.charged_wait_keys);
    c.charged_wait_keys = 0;
    if (c.block == Block::kWait) {
      c.wait_keys = nullptr;
      c.wait_id = 0;
    } else {
      auto it = barriers_.find(c.barrier_key);
      if (it != barriers_.end()) {
        it->second.waiting.erase(c.id);
        if (it->second.waiting.empty()) {
          if (it->second.watch != 0) store_->CancelWatch(it->second.watch);
          barriers_.erase(it);
        }
      }
      c.barrier_key.clear();
    }
    c.block = Block::kNone;
    ++c.seq;
  }

  void CancelBlock(Conn& c) {
    if (c.block == Block::kWait) store_->CancelWait(c.wait_id);
    ClearBlock(c, TcpStoreOutcome::kCancelled);
  }

  // ---- cross-thread hand-off ----

  // Runs `fn` on the loop thread: after the current callback when called
  // from it (a write on this loop completing a wait), else soon.
  void Post(std::function<void()> fn) {
    if (std::this_thread::get_id() == loop_thread_) {
      local_.push_back(std::move(fn));
      return;
    }
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    posted_.push_back(std::move(fn));
    uv_async_send(&async_);
  }

  void RunLocal() {
    while (!local_.empty()) {
      std::vector<std::function<void()>> batch;
      batch.swap(local_);
      for (auto& fn : batch) fn();
    }
  }

  void RunPosted() {
    std::vector<std::function<void()>> batch;
    bool stop = false;
    {
      absl::MutexLock lock(&mu_);
      batch.swap(posted_);
      stop = stop_requested_;
    }
    for (auto& fn : batch) fn();
    RunLocal();
    if (stop) Shutdown();
  }

  void Shutdown() {
    CommitBatch();
    uv_close(reinterpret_cast<uv_handle_t*>(&listener_), nullptr);
    std::vector<Conn*> all;
    for (auto& [id, c] : conns_) all.push_back(c);
    for (Conn* c : all) Close(*c, "", false);
    for (auto& [key, b] : barriers_) {
      if (b.watch != 0) store_->CancelWatch(b.watch);
    }
    barriers_.clear();
    {
      absl::MutexLock lock(&mu_);
      stopped_ = true;
    }
    uv_close(reinterpret_cast<uv_handle_t*>(&check_), nullptr);
    uv_close(reinterpret_cast<uv_handle_t*>(&async_), nullptr);
  }

  store::KvStore* const store_;
  const TcpStoreServerOptions options_;
  const tcpstore::Limits limits_;
  std::unique_ptr<ConnectionBudget> own_budget_;  // Without options_.budget.
  ConnectionBudget* const budget_;

  uv_loop_t loop_;
  uv_tcp_t listener_;
  uv_async_t async_;
  uv_check_t check_;
  std::thread thread_;
  std::thread::id loop_thread_;
  bool started_ = false;

  // Loop thread only.
  std::string read_buffer_;
  uint64_t next_conn_id_ = 1;
  absl::flat_hash_map<uint64_t, Conn*> conns_;
  // The owners charged for queue items not yet popped, by item key.
  absl::flat_hash_map<std::string, ItemOwner> item_owners_;
  // Replies queued for all connections (each one's `counted`).
  size_t unsent_total_ = 0;
  // The connections holding replies the kernel would not take, by bytes
  // held: the slow readers CloseSlowReaders closes first.
  std::set<std::pair<size_t, uint64_t>> stalled_;
  absl::flat_hash_map<std::string, Barrier> barriers_;
  std::vector<std::function<void()>> local_;
  std::vector<uint64_t> ready_;
  static constexpr int kAcceptBurst = 64;
  int accepted_this_pass_ = 0;
  bool accept_deferred_ = false;
  int64_t last_activity_ns_ = 0;
  // When the request being handled was read (0 without on_query).
  int64_t read_ns_ = 0;
  // Changes read but not committed, the connection and query of each, and
  // the strings they point to.
  static constexpr size_t kMaxBatchChanges = 4096;
  static constexpr size_t kMaxBatchBytes = 4 << 20;
  static constexpr int64_t kMaxBatchDelayNs = 200'000;
  std::vector<store::Change> batch_;
  std::vector<Queued> batch_from_;
  std::deque<std::string> batch_strings_;
  size_t batch_bytes_ = 0;
  size_t batch_push_bytes_ = 0;  // Of QUEUE_PUSHes in the batch.
  bool batch_wants_reply_ = false;
  int64_t batch_since_ns_ = 0;
  base::LogLimiter log_;

  absl::Mutex mu_;
  std::vector<std::function<void()>> posted_ ABSL_GUARDED_BY(mu_);
  bool stop_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;

  std::atomic<size_t> connections_{0};
  std::atomic<size_t> blocked_{0};
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> closed_bad_input_{0};
  std::atomic<uint64_t> refused_not_allowed_{0};
  std::atomic<uint64_t> refused_unauthenticated_{0};
  std::atomic<uint64_t> requests_{0};
  std::atomic<size_t> unsent_total_reported_{0};
  std::atomic<size_t> peak_unsent_{0};
  std::atomic<uint64_t> closed_slow_readers_{0};
  std::atomic<uint64_t> refused_quota_{0};
  std::atomic<uint64_t> refused_no_budget_{0};

 public:
  // TcpStoreServerOptions::allow, parsed (by Start, before the loop runs).
  std::vector<Network> networks_;
};

absl::StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Start(
    store::KvStore* store, TcpStoreServerOptions options) {
  std::vector<Network> networks;
  for (const std::string& text : options.allow) {
    absl::StatusOr<Network> n = ParseNetwork(text);
    if (!n.ok()) return n.status();
    networks.push_back(*n);
  }
  if (!options.prefix.empty()) {
    // A prefix that "/cohort/" itself starts with ("/", "/cohort") is as
    // bad as one inside it: its key "/auth/x" would be "/cohort/auth/x".
    if (absl::StartsWith(c10d::kReservedPrefix, options.prefix)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "TCPStore prefix '", options.prefix, "' is the start of cohortd's "
          "reserved namespace '", c10d::kReservedPrefix, "': its clients' "
          "keys would reach cohortd's records there; use a prefix outside "
          "it that ends in '/', e.g. 'torch/'"));
    }
    if (absl::Status s = c10d::CheckClientWrite(options.prefix + "x"); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("TCPStore prefix '", options.prefix,
                       "' is inside cohortd's reserved namespace: ", s.message()));
    }
  }
  int port = 0;
  absl::StatusOr<int> fd = ListenExclusive(options.listen, &port);
  if (!fd.ok()) return fd.status();
  std::unique_ptr<TcpStoreServer> server(new TcpStoreServer);
  server->port_ = port;
  server->loop_ = std::make_unique<Loop>(store, std::move(options));
  server->loop_->networks_ = std::move(networks);
  if (absl::Status s = server->loop_->Start(*fd); !s.ok()) return s;
  return server;
}

TcpStoreServer::~TcpStoreServer() { Stop(); }

void TcpStoreServer::Stop() {
  if (loop_ != nullptr) loop_->Stop();
}

TcpStoreServerStats TcpStoreServer::stats() { return loop_->Stats(); }

}  // namespace cohort::server
