#include "worker/launch/tcpstore_proxy.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/log_limiter.h"
#include "base/net.h"
#include "proto/tcpstore/wire.h"

namespace cohort {
namespace {

// One read buffer for the whole loop; a connection keeps bytes of its own
// only while the side they are for cannot take them.
constexpr size_t kReadBufferBytes = 64 << 10;
constexpr absl::Duration kFirstBackoff = absl::Milliseconds(50);
constexpr absl::Duration kMaxBackoff = absl::Seconds(1);
// Out of file descriptors, accepting pauses this long.
constexpr absl::Duration kAcceptPause = absl::Milliseconds(100);
constexpr int kAcceptBurst = 64;
// epoll tags: the listener, the wake-up eventfd, and (id << 1 | side) for
// the two sides of connection id (ids start at 1).
constexpr uint64_t kListenerTag = 0;
constexpr uint64_t kWakeTag = 1;

// cohortd's TCPStore listener: "host:port" (or "[v6]:port") ->
// getaddrinfo's results, in its order.
absl::StatusOr<std::vector<base::SocketAddress>> ResolveUpstream(
    const std::string& address) {
  absl::StatusOr<base::HostPort> where =
      base::SplitHostPort(address, {.allow_empty_host = true});
  if (!where.ok()) return where.status();
  absl::StatusOr<std::vector<base::SocketAddress>> found =
      base::Resolve(*where);
  if (!found.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "cannot resolve \"", where->host, "\": ", found.status().message()));
  }
  return found;
}

void NoDelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

}  // namespace

class TcpStoreProxy::Loop {
 public:
  Loop(TcpStoreProxyOptions options, std::vector<base::SocketAddress> upstream,
       int listen_fd)
      : options_(std::move(options)),
        upstream_(std::move(upstream)),
        listen_fd_(listen_fd),
        name_space_(options_.name_space) {
    read_buffer_.resize(kReadBufferBytes);
  }

  ~Loop() {
    Stop();
    if (epoll_fd_ >= 0) close(epoll_fd_);
    if (wake_fd_ >= 0) close(wake_fd_);
    close(listen_fd_);
  }

  absl::Status Start() {
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (epoll_fd_ < 0 || wake_fd_ < 0) {
      return absl::InternalError(
          absl::StrCat("epoll/eventfd: ", std::strerror(errno)));
    }
    Watch(listen_fd_, kListenerTag, EPOLLIN, EPOLL_CTL_ADD);
    Watch(wake_fd_, kWakeTag, EPOLLIN, EPOLL_CTL_ADD);
    thread_ = std::thread([this] { Run(); });
    return absl::OkStatus();
  }

  void Stop() {
    if (!thread_.joinable()) return;
    stop_ = true;
    const uint64_t one = 1;
    if (write(wake_fd_, &one, sizeof(one)) < 0) {
      // The counter is already non-zero: the loop wakes anyway.
    }
    thread_.join();
  }

  // The switch is made on the loop thread, after it accepts what waits in
  // the backlog: a connection its worker opened before the call (say, in
  // the round that just ended) is bound to the namespace of then, even if
  // the loop had not accepted it yet.
  absl::Status SetNamespace(absl::string_view name_space) {
    if (absl::Status s = tcpstore::CheckNamespace(name_space); !s.ok()) {
      return s;
    }
    absl::MutexLock lock(&mu_);
    if (!thread_.joinable() || stop_) {
      name_space_ = std::string(name_space);
      return absl::OkStatus();
    }
    next_namespace_ = std::string(name_space);
    const uint64_t one = 1;
    if (write(wake_fd_, &one, sizeof(one)) < 0) {
      // The counter is already non-zero: the loop wakes anyway.
    }
    const uint64_t want = ++namespace_requests_;
    auto applied = [this, want]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return namespace_applied_ >= want;
    };
    mu_.Await(absl::Condition(&applied));
    return absl::OkStatus();
  }

  TcpStoreProxyStats Stats() const {
    TcpStoreProxyStats s;
    s.open = open_.load();
    s.accepted = accepted_.load();
    s.refused = refused_.load();
    s.bytes_up = bytes_up_.load();
    s.bytes_down = bytes_down_.load();
    return s;
  }

 private:
  enum Which { kDown = 0, kUp = 1 };  // The worker's side, cohortd's side.

  struct Side {
    int fd = -1;
    uint32_t events = 0;  // What epoll watches for, once registered.
    bool registered = false;
    // Bytes for this side that it could not take yet.
    std::string pending;
  };

  // One worker connection and its connection to cohortd.
  struct Pair {
    uint64_t id = 0;
    Side side[2];
    bool connected = false;  // Upstream accepted; bytes flow.
    // One side ended: the other gets what is pending for it, then closes.
    bool draining = false;
    size_t address = 0;  // The upstream address being tried.
    absl::Time give_up;
    absl::Duration backoff = kFirstBackoff;
    std::string error;  // Why the last connect failed.
  };

  void Watch(int fd, uint64_t tag, uint32_t events, int op) {
    epoll_event ev = {};
    ev.events = events;
    ev.data.u64 = tag;
    epoll_ctl(epoll_fd_, op, fd, &ev);
  }

  // The loop thread. After bytes move it polls without sleeping for up to
  // spin_after_activity, yielding the CPU between polls, so that the reply
  // to what it just passed on is passed back without the wake-up of a
  // sleeping thread.
  void Run() {
    std::vector<epoll_event> events(256);
    base::PollThenSleep policy(options_.spin_after_activity);
    while (!stop_) {
      const bool spin = policy.Polling(absl::GetCurrentTimeNanos());
      const int n = epoll_wait(epoll_fd_, events.data(), events.size(),
                               spin ? 0 : MillisToNextTimer());
      if (n == 0 && spin) {
        base::PollThenSleep::Yield();
        RunTimers();
        continue;
      }
      if (n < 0 && errno != EINTR) {
        log_.Log(absl::StrCat("TCPStore proxy: epoll_wait failed: ",
                              std::strerror(errno)));
        break;
      }
      for (int i = 0; i < n; ++i) {
        const uint64_t tag = events[i].data.u64;
        if (tag == kListenerTag) {
          AcceptSome();
        } else if (tag == kWakeTag) {
          uint64_t count;
          if (read(wake_fd_, &count, sizeof(count)) < 0) {
            // Nothing to drain.
          }
          ApplyNamespace();
        } else if (auto it = pairs_.find(tag >> 1); it != pairs_.end()) {
          OnEvent(*it->second, static_cast<Which>(tag & 1), events[i].events);
          policy.Active(absl::GetCurrentTimeNanos());
        }
      }
      RunTimers();
    }
    while (!pairs_.empty()) Close(*pairs_.begin()->second);
    // Nobody waits on a switch the loop will never make.
    absl::MutexLock lock(&mu_);
    name_space_ = next_namespace_.value_or(name_space_);
    namespace_applied_ = namespace_requests_;
  }

  // Makes the switch SetNamespace asked for, once the connections waiting
  // in the backlog are accepted under the namespace of before.
  void ApplyNamespace() {
    {
      absl::MutexLock lock(&mu_);
      if (namespace_applied_ == namespace_requests_) return;
    }
    if (accept_paused_until_ == absl::InfiniteFuture()) {
      for (;;) {
        const int fd =
            accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0) {
          Open(fd);
        } else if (errno != EINTR && errno != ECONNABORTED) {
          break;  // Drained (EAGAIN); or out of descriptors: AcceptSome's.
        }
      }
    }
    absl::MutexLock lock(&mu_);
    name_space_ = next_namespace_.value_or(name_space_);
    next_namespace_.reset();
    namespace_applied_ = namespace_requests_;
  }

  // ---- accepting ----

  void AcceptSome() {
    for (int i = 0; i < kAcceptBurst; ++i) {
      const int fd =
          accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd >= 0) {
        Open(fd);
        continue;
      }
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      // Out of descriptors (or memory): the connection waits in the
      // backlog, and the listener is not watched for a moment, so the
      // loop does not spin on it.
      log_.Log(
          absl::StrCat("TCPStore proxy: accept failed: ", std::strerror(errno),
                       "; retrying in ", absl::FormatDuration(kAcceptPause)));
      Watch(listen_fd_, kListenerTag, 0, EPOLL_CTL_MOD);
      accept_paused_until_ = absl::Now() + kAcceptPause;
      return;
    }
  }

  void Open(int fd) {
    NoDelay(fd);
    auto owned = std::make_unique<Pair>();
    Pair& p = *owned;
    p.id = next_id_++;
    p.side[kDown].fd = fd;
    {
      absl::MutexLock lock(&mu_);
      tcpstore::EncodeNamespaceHello(name_space_, &p.side[kUp].pending,
                                     options_.token);
    }
    p.give_up = absl::Now() + options_.connect_timeout;
    pairs_.emplace(p.id, std::move(owned));
    ++accepted_;
    open_ = pairs_.size();
    Update(p);
    Connect(p);
  }

  // ---- connecting to cohortd ----

  // Tries the upstream addresses from p.address on; schedules a retry when
  // none accepts at once or is in progress.
  void Connect(Pair& p) {
    for (; p.address < upstream_.size(); ++p.address) {
      const base::SocketAddress& a = upstream_[p.address];
      const int fd =
          socket(a.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
      if (fd < 0) {
        p.error = std::strerror(errno);
        continue;
      }
      if (connect(fd, a.get(), a.size) == 0 || errno == EINPROGRESS) {
        p.side[kUp].fd = fd;
        Update(p);  // Watches for writability: the connect's outcome.
        return;
      }
      p.error = std::strerror(errno);
      close(fd);
    }
    Retry(p);
  }

  void OnConnected(Pair& p) {
    int error = 0;
    socklen_t len = sizeof(error);
    if (getsockopt(p.side[kUp].fd, SOL_SOCKET, SO_ERROR, &error, &len) != 0) {
      error = errno;
    }
    if (error != 0) {
      p.error = std::strerror(error);
      CloseSide(p, kUp);
      ++p.address;
      Connect(p);
      return;
    }
    NoDelay(p.side[kUp].fd);
    p.connected = true;
    if (Flush(p, kUp)) Update(p);  // The hello.
  }

  void Retry(Pair& p) {
    const absl::Time now = absl::Now();
    if (now >= p.give_up) {
      log_.Log(absl::StrCat(
          "TCPStore proxy: cannot reach cohortd's TCPStore listener at ",
          options_.upstream, " (", p.error, ") after ",
          absl::FormatDuration(options_.connect_timeout),
          "; closing a worker's connection"));
      ++refused_;
      Close(p);
      return;
    }
    p.address = 0;
    timers_.emplace(std::min(now + p.backoff, p.give_up), p.id);
    p.backoff = std::min(2 * p.backoff, kMaxBackoff);
  }

  int MillisToNextTimer() const {
    absl::Time next = absl::InfiniteFuture();
    if (!timers_.empty()) next = timers_.begin()->first;
    return base::PollTimeoutMillis(std::min(next, accept_paused_until_));
  }

  void RunTimers() {
    const absl::Time now = absl::Now();
    if (accept_paused_until_ <= now) {
      accept_paused_until_ = absl::InfiniteFuture();
      Watch(listen_fd_, kListenerTag, EPOLLIN, EPOLL_CTL_MOD);
    }
    while (!timers_.empty() && timers_.begin()->first <= now) {
      const uint64_t id = timers_.begin()->second;
      timers_.erase(timers_.begin());
      if (auto it = pairs_.find(id); it != pairs_.end()) Connect(*it->second);
    }
  }

  // ---- splicing ----

  void OnEvent(Pair& p, Which which, uint32_t events) {
    if (which == kUp && !p.connected) {
      OnConnected(p);
      return;
    }
    if ((events & EPOLLOUT) && !Flush(p, which)) return;
    if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
      if (!Read(p, which, events)) return;
    }
    Update(p);
  }

  // Moves what `from` sent to the other side: straight from the loop's
  // buffer, keeping only what that side cannot take now. Returns false
  // once `p` is gone.
  bool Read(Pair& p, Which from, uint32_t events) {
    const Which to = from == kDown ? kUp : kDown;
    if (!p.connected || p.draining || !p.side[to].pending.empty()) {
      // Not reading it now: only a hang-up or an error gets here.
      if (events & (EPOLLHUP | EPOLLERR)) return End(p, from);
      return true;
    }
    const ssize_t n =
        recv(p.side[from].fd, read_buffer_.data(), read_buffer_.size(), 0);
    if (n == 0) return End(p, from);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
        return true;
      }
      return End(p, from);
    }
    const ssize_t sent = Write(p.side[to], to, read_buffer_.data(), n);
    if (sent < 0) {
      Close(p);  // What was for it cannot be delivered.
      return false;
    }
    if (sent < n)
      p.side[to].pending.assign(read_buffer_.data() + sent, n - sent);
    return true;
  }

  // Writes what is pending for `which`. Returns false once `p` is gone.
  bool Flush(Pair& p, Which which) {
    Side& side = p.side[which];
    const ssize_t sent =
        Write(side, which, side.pending.data(), side.pending.size());
    if (sent < 0) {
      Close(p);
      return false;
    }
    side.pending.erase(0, sent);
    if (!side.pending.empty()) return true;
    if (p.draining) {
      Close(p);
      return false;
    }
    // Nothing is kept for an idle connection.
    std::string().swap(side.pending);
    return true;
  }

  // Sends what `side` takes of `data` now: the byte count, or -1 when the
  // side is broken.
  ssize_t Write(Side& side, Which which, const char* data, size_t n) {
    size_t sent = 0;
    while (sent < n) {
      const ssize_t w = send(side.fd, data + sent, n - sent, MSG_NOSIGNAL);
      if (w < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        return -1;
      }
      sent += w;
    }
    (which == kUp ? bytes_up_ : bytes_down_) += sent;
    return sent;
  }

  // `which` closed or failed: the other side still gets what that side
  // sent before, then closes too. Returns false once `p` is gone.
  bool End(Pair& p, Which which) {
    const Which other = which == kDown ? kUp : kDown;
    CloseSide(p, which);
    if (!p.connected || p.side[other].pending.empty()) {
      Close(p);
      return false;
    }
    p.draining = true;
    return true;
  }

  // What epoll should watch on each side now.
  void Update(Pair& p) {
    for (Which which : {kDown, kUp}) {
      Side& side = p.side[which];
      if (side.fd < 0) continue;
      const Side& other = p.side[which == kDown ? kUp : kDown];
      uint32_t want = 0;
      if (which == kUp && !p.connected) {
        want = EPOLLOUT;
      } else {
        if (p.connected && !p.draining && other.pending.empty()) {
          want |= EPOLLIN;
        }
        if (!side.pending.empty()) want |= EPOLLOUT;
      }
      if (side.registered && want == side.events) continue;
      Watch(side.fd, p.id << 1 | which, want,
            side.registered ? EPOLL_CTL_MOD : EPOLL_CTL_ADD);
      side.registered = true;
      side.events = want;
    }
  }

  void CloseSide(Pair& p, Which which) {
    Side& side = p.side[which];
    if (side.fd >= 0) close(side.fd);  // Also leaves the epoll set.
    side.fd = -1;
    side.registered = false;
    side.events = 0;
    if (which == kDown) side.pending.clear();
  }

  void Close(Pair& p) {
    for (Which which : {kDown, kUp}) {
      if (p.side[which].fd >= 0) close(p.side[which].fd);
    }
    pairs_.erase(p.id);
    open_ = pairs_.size();
  }

  const TcpStoreProxyOptions options_;
  const std::vector<base::SocketAddress> upstream_;
  const int listen_fd_;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::thread thread_;
  std::atomic<bool> stop_{false};

  absl::Mutex mu_;
  std::string name_space_ ABSL_GUARDED_BY(mu_);
  // SetNamespace's switch, made by the loop thread (ApplyNamespace).
  std::optional<std::string> next_namespace_ ABSL_GUARDED_BY(mu_);
  uint64_t namespace_requests_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t namespace_applied_ ABSL_GUARDED_BY(mu_) = 0;

  // Loop thread only.
  std::string read_buffer_;
  uint64_t next_id_ = 1;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Pair>> pairs_;
  std::set<std::pair<absl::Time, uint64_t>> timers_;  // Connect retries.
  absl::Time accept_paused_until_ = absl::InfiniteFuture();
  base::LogLimiter log_{options_.log, absl::Seconds(1)};

  std::atomic<size_t> open_{0};
  std::atomic<uint64_t> accepted_{0};
  std::atomic<uint64_t> refused_{0};
  std::atomic<uint64_t> bytes_up_{0};
  std::atomic<uint64_t> bytes_down_{0};
};

absl::StatusOr<std::unique_ptr<TcpStoreProxy>> TcpStoreProxy::Start(
    TcpStoreProxyOptions options) {
  if (absl::Status s = tcpstore::CheckNamespace(options.name_space); !s.ok()) {
    return s;
  }
  absl::StatusOr<std::vector<base::SocketAddress>> upstream =
      ResolveUpstream(options.upstream);
  if (!upstream.ok()) {
    return absl::Status(
        upstream.status().code(),
        absl::StrCat("TCPStore proxy upstream: ", upstream.status().message()));
  }
  absl::StatusOr<base::ListeningSocket> local =
      base::ListenExclusive(options.listen, {.nonblocking = true});
  if (!local.ok()) {
    return absl::Status(
        local.status().code(),
        absl::StrCat("TCPStore proxy ", local.status().message()));
  }
  std::unique_ptr<TcpStoreProxy> proxy(new TcpStoreProxy);
  proxy->port_ = local->port;
  proxy->loop_ = std::make_unique<Loop>(std::move(options),
                                        *std::move(upstream), local->fd);
  if (absl::Status s = proxy->loop_->Start(); !s.ok()) return s;
  return proxy;
}

TcpStoreProxy::~TcpStoreProxy() { Stop(); }

absl::Status TcpStoreProxy::SetNamespace(absl::string_view name_space) {
  return loop_->SetNamespace(name_space);
}

void TcpStoreProxy::Stop() {
  if (loop_ != nullptr) loop_->Stop();
}

TcpStoreProxyStats TcpStoreProxy::stats() const { return loop_->Stats(); }

}  // namespace cohort
