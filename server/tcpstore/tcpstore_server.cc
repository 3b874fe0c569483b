#include "server/tcpstore/tcpstore_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>
#include <uv.h>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/log_limiter.h"
#include "base/net.h"
#include "server/tcpstore/peer_filter.h"
#include "server/tcpstore/session.h"

namespace cohort::server {
namespace {

// One read buffer for the whole loop: a connection holds bytes of its own
// only while a request is split across reads, so 10,000 idle connections
// cost no read buffers.
constexpr size_t kReadBufferBytes = 64 << 10;

// The peer's address; false if the socket has none.
bool PeerAddress(const uv_tcp_t* tcp, sockaddr_storage* addr) {
  *addr = {};
  int len = sizeof(*addr);
  return uv_tcp_getpeername(tcp, reinterpret_cast<sockaddr*>(addr), &len) == 0;
}

std::string PeerName(const uv_tcp_t* tcp) {
  sockaddr_storage addr;
  if (!PeerAddress(tcp, &addr)) return "unknown peer";
  char host[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET6) {
    const auto* a6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    uv_ip6_name(a6, host, sizeof(host));
    return absl::StrCat("[", host, "]:", ntohs(a6->sin6_port));
  }
  const auto* a4 = reinterpret_cast<const sockaddr_in*>(&addr);
  uv_ip4_name(a4, host, sizeof(host));
  return absl::StrCat(host, ":", ntohs(a4->sin_port));
}

TcpStoreSessionOptions SessionOptions(const TcpStoreServerOptions& o) {
  return {.max_request_bytes = o.max_request_bytes,
          .max_queue_bytes_total = o.max_queue_bytes_total,
          .quotas = o.quotas,
          .prefix = o.prefix,
          .authorize = o.authorize,
          .require_token = o.require_token,
          .on_query = o.on_query};
}

}  // namespace

// The event loop: sockets, reads and writes, the bounds on unsent replies,
// accepting and the peer filter. What the bytes mean is the sessions'
// (session.h): the loop feeds each connection's bytes to its session and
// sends what the session puts in its output.
class TcpStoreServer::Loop final : public TcpStoreProtocol::Host {
 public:
  Loop(store::KvStore* store, TcpStoreServerOptions options, PeerFilter peers)
      : store_(store),
        options_(std::move(options)),
        peers_(std::move(peers)),
        own_budget_(
            options_.budget == nullptr
                ? std::make_unique<ConnectionBudget>(options_.max_connections)
                : nullptr),
        budget_(options_.budget != nullptr ? options_.budget
                                           : own_budget_.get()),
        log_(options_.log, options_.log_every),
        policy_(options_.spin_after_activity),
        protocol_(store, SessionOptions(options_), this) {
    read_buffer_.resize(kReadBufferBytes);
  }

  ~Loop() override { Stop(); }

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
                           base::MaxBacklog(), &Loop::OnConnection);
        rc != 0) {
      return absl::InternalError(absl::StrCat("uv_listen: ", uv_strerror(rc)));
    }
    started_ = true;
    thread_ = std::thread([this] { Run(); });
    return absl::OkStatus();
  }

  // The loop thread: polls briefly after traffic, then sleeps
  // (base::PollThenSleep), committing the batch before it sleeps.
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
    for (;;) {
      const int64_t now = absl::GetCurrentTimeNanos();
      if (protocol_.Overdue(now)) Settle();
      if (policy_.Polling(now)) {
        if (uv_run(&loop_, UV_RUN_NOWAIT) == 0) break;
        base::PollThenSleep::Yield();
        continue;
      }
      // Nothing more is coming for now: commit before sleeping.
      if (protocol_.has_batch()) {
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
    const TcpStoreProtocol::Stats p = protocol_.stats();
    TcpStoreServerStats s;
    s.connections = connections_.load();
    s.blocked = p.blocked;
    s.accepted = accepted_.load();
    s.closed_bad_input = closed_bad_input_.load();
    s.refused_not_allowed = refused_not_allowed_.load();
    s.refused_unauthenticated = p.refused_unauthenticated;
    s.requests = p.requests;
    s.unsent_bytes = unsent_total_reported_.load();
    s.peak_unsent_bytes = peak_unsent_.load();
    s.queue_bytes = store_->queue_stats().bytes;
    s.closed_slow_readers = closed_slow_readers_.load();
    s.refused_quota = p.refused_quota;
    s.refused_no_budget = refused_no_budget_.load();
    return s;
  }

  // ---- TcpStoreProtocol::Host (loop thread, but Post) ----

  void Close(TcpStoreSession& session, absl::string_view why,
             bool bad_input) override {
    if (Conn* c = Find(session.id())) {
      Close(*c, why, bad_input);
    } else {
      session.End();
    }
  }

  void Ready(TcpStoreSession& session) override {
    if (Conn* c = Find(session.id())) MarkReady(*c);
  }

  // Runs `fn` on the loop thread: after the current callback when called
  // from it (a write on this loop completing a wait), else soon.
  void Post(std::function<void()> fn) override {
    if (std::this_thread::get_id() == loop_thread_) {
      local_.push_back(std::move(fn));
      return;
    }
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    posted_.push_back(std::move(fn));
    uv_async_send(&async_);
  }

  int64_t NowNanos() override { return absl::GetCurrentTimeNanos(); }

 private:
  struct WriteReq;

  struct Conn {
    uv_tcp_t tcp;
    Loop* loop = nullptr;
    // Its protocol; made once the connection is let in.
    std::optional<TcpStoreSession> session;
    size_t counted = 0;    // Its unsent bytes as counted in unsent_total_.
    bool stalled = false;  // In stalled_ (as {counted, id}).
    std::string in;        // Unparsed bytes, when a request spans reads.
    size_t need = 0;       // Bytes `in` must hold before parsing again.
    size_t unsent = 0;     // Memory of the uv_write request not yet completed.
    // That request (one at a time); null when none.
    WriteReq* writing = nullptr;
    size_t used = 0;     // Bytes of `in` applied, erased after the commit.
    bool ready = false;  // Listed in ready_.
    bool reading = false;
    bool closing = false;

    uint64_t id() const { return session->id(); }
    // Replies not yet handed to the socket.
    std::string& out() { return session->output(); }
    const std::string& out() const { return session->output(); }
  };

  struct WriteReq {
    uv_write_t req;
    std::string data;
    uv_buf_t buf;
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
    loop->policy_.Active(absl::GetCurrentTimeNanos());
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
      log_.Log(
          absl::StrCat("refusing TCPStore connection from ", PeerName(&c->tcp),
                       ": not in the allowed networks (--tcpstore_allow)"));
      uv_close(reinterpret_cast<uv_handle_t*>(&c->tcp), &Loop::OnClosed);
      return;
    }
    uv_tcp_nodelay(&c->tcp, 1);
    c->session.emplace(protocol_, next_conn_id_++, PeerName(&c->tcp));
    conns_.emplace(c->id(), c);
    connections_ = conns_.size();
    UpdateReading(*c);
  }

  bool Allowed(const uv_tcp_t& tcp) const {
    if (peers_.allows_all()) return true;
    sockaddr_storage addr;
    return PeerAddress(&tcp, &addr) && peers_.Allows(addr);
  }

  Conn* Find(uint64_t id) {
    auto it = conns_.find(id);
    return it == conns_.end() ? nullptr : it->second;
  }

  void Close(Conn& c, absl::string_view why, bool bad_input) {
    if (c.closing) return;
    if (!why.empty()) {
      log_.Log(absl::StrCat("closing TCPStore connection from ",
                            c.session->peer(), ": ", why));
    }
    if (bad_input) ++closed_bad_input_;
    c.session->End();
    c.closing = true;
    // Its replies' memory goes now, not once libuv has closed the socket
    // (after this pass), so that what CloseSlowReaders frees is free before
    // anything more is served. libuv closes the descriptor here and never
    // reads a pending write's bytes again.
    if (c.writing != nullptr) std::string().swap(c.writing->data);
    std::string().swap(c.out());
    std::string().swap(c.in);
    Recount(c);
    budget_->Give();  // Taken when it was accepted.
    conns_.erase(c.id());
    connections_ = conns_.size();
    uv_close(reinterpret_cast<uv_handle_t*>(&c.tcp), &Loop::OnClosed);
  }

  // The memory the connection's replies hold: buffers' capacities, which
  // the bytes still to send may be far short of.
  static size_t Unsent(const Conn& c) {
    return c.unsent + (c.out().empty() ? 0 : c.out().capacity());
  }

  // Brings unsent_total_ and stalled_ up to date with the connection's
  // replies.
  void Recount(Conn& c) {
    const size_t now = c.closing ? 0 : Unsent(c);
    if (c.stalled) stalled_.erase({c.counted, c.id()});
    c.stalled = !c.closing && c.unsent > 0;
    if (c.stalled) stalled_.insert({now, c.id()});
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
    std::string& out = c.out();
    if (c.closing || out.empty() || c.unsent > 0) return;
    auto* stream = reinterpret_cast<uv_stream_t*>(&c.tcp);
    uv_buf_t b = uv_buf_init(out.data(), out.size());
    int n = uv_try_write(stream, &b, 1);
    if (n < 0 && n != UV_EAGAIN) {
      Close(c, absl::StrCat("write failed: ", uv_strerror(n)), false);
      return;
    }
    if (n > 0 && static_cast<size_t>(n) == out.size()) {
      // A big reply's buffer is let go, not kept for the next, small one.
      if (out.capacity() > kReadBufferBytes) {
        std::string().swap(out);
      } else {
        out.clear();
      }
      return;
    }
    auto* w = new WriteReq;
    if (n > 0) {
      // The rest in a buffer of its own size: the one the replies were
      // built in may be many times larger, and it would be held (and
      // counted) until the peer reads.
      w->data.assign(out, n);
      std::string().swap(out);
    } else {
      w->data = std::move(out);
      out.clear();
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
    ready_.push_back(c.id());
  }

  // Whether the connection has requests to serve now: complete ones in
  // `in`, none blocked, room for their replies.
  bool HasWork(const Conn& c) const {
    return !c.in.empty() && c.in.size() >= c.need && !c.session->blocked() &&
           !Backlogged(c);
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
      if (MustCommit()) protocol_.CommitBatch();
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
        if (HasWork(*c)) MarkReady(*c);
      }
      RunLocal();
      CloseSlowReaders();
    }
  }

  // Whether the batch is committed at the end of this pass: when the
  // protocol says so (TcpStoreProtocol::MustCommit), and always when the
  // loop never polls (it would sleep on uncommitted changes).
  bool MustCommit() const {
    return !policy_.enabled() || protocol_.MustCommit();
  }

  // Commits what is queued outside a pass, then serves what that readied.
  void Settle() {
    protocol_.CommitBatch();
    RunLocal();
    Drain();
  }

  // Feeds `bytes` to the connection's session until it stops or the
  // connection's replies pile up. Returns the bytes used.
  size_t Process(Conn& c, absl::string_view bytes) {
    size_t pos = 0;
    c.need = 0;
    while (!c.closing && pos < bytes.size() && !Backlogged(c)) {
      const TcpStoreSession::Step step = c.session->Next(bytes.substr(pos));
      pos += step.used;
      if (step.progress == TcpStoreSession::Progress::kStopped) {
        c.need = step.need;
        break;
      }
      if (step.progress != TcpStoreSession::Progress::kRequest) continue;
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

  // ---- cross-thread hand-off ----

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
    protocol_.CommitBatch();
    uv_close(reinterpret_cast<uv_handle_t*>(&listener_), nullptr);
    std::vector<Conn*> all;
    for (auto& [id, c] : conns_) all.push_back(c);
    for (Conn* c : all) Close(*c, "", false);
    protocol_.Shutdown();
    {
      absl::MutexLock lock(&mu_);
      stopped_ = true;
    }
    uv_close(reinterpret_cast<uv_handle_t*>(&check_), nullptr);
    uv_close(reinterpret_cast<uv_handle_t*>(&async_), nullptr);
  }

  store::KvStore* const store_;
  const TcpStoreServerOptions options_;
  const PeerFilter peers_;
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
  // Replies queued for all connections (each one's `counted`).
  size_t unsent_total_ = 0;
  // The connections holding replies the kernel would not take, by bytes
  // held: the slow readers CloseSlowReaders closes first.
  std::set<std::pair<size_t, uint64_t>> stalled_;
  std::vector<std::function<void()>> local_;
  std::vector<uint64_t> ready_;
  static constexpr int kAcceptBurst = 64;
  int accepted_this_pass_ = 0;
  bool accept_deferred_ = false;
  base::LogLimiter log_;
  base::PollThenSleep policy_;
  // What the bytes mean. Its sessions live in the Conns, which are all
  // gone once the loop thread has ended.
  TcpStoreProtocol protocol_;

  absl::Mutex mu_;
  std::vector<std::function<void()>> posted_ ABSL_GUARDED_BY(mu_);
  bool stop_requested_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;

  std::atomic<size_t> connections_{0};
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> closed_bad_input_{0};
  std::atomic<uint64_t> refused_not_allowed_{0};
  std::atomic<size_t> unsent_total_reported_{0};
  std::atomic<size_t> peak_unsent_{0};
  std::atomic<uint64_t> closed_slow_readers_{0};
  std::atomic<uint64_t> refused_no_budget_{0};
};

absl::StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Start(
    store::KvStore* store, TcpStoreServerOptions options) {
  absl::StatusOr<PeerFilter> peers = PeerFilter::Parse(options.allow);
  if (!peers.ok()) return peers.status();
  if (absl::Status s = CheckTcpStorePrefix(options.prefix); !s.ok()) return s;
  absl::StatusOr<base::ListeningSocket> socket = base::ListenExclusive(
      options.listen,
      {.when_in_use = "another process, perhaps another cohortd, serves this "
                      "port"});
  if (!socket.ok()) return socket.status();
  std::unique_ptr<TcpStoreServer> server(new TcpStoreServer);
  server->port_ = socket->port;
  server->loop_ =
      std::make_unique<Loop>(store, std::move(options), *std::move(peers));
  if (absl::Status s = server->loop_->Start(socket->fd); !s.ok()) return s;
  return server;
}

TcpStoreServer::~TcpStoreServer() { Stop(); }

void TcpStoreServer::Stop() {
  if (loop_ != nullptr) loop_->Stop();
}

TcpStoreServerStats TcpStoreServer::stats() { return loop_->Stats(); }

}  // namespace cohort::server
