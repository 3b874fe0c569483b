#include "client/tcpstore_client.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace cohort {
namespace {

using tcpstore::Dialect;
using tcpstore::Op;
using tcpstore::Request;

// A reply string longer than this is a corrupt length prefix, not data.
constexpr uint64_t kMaxReplyBytes = uint64_t{1} << 30;
// At most this many keys are named in a timeout message, and checked one
// by one to tell which are missing.
constexpr size_t kKeysNamed = 16;
constexpr size_t kKeysChecked = 64;
// Fresh connections the server may close in reply to one request before
// the call concludes that the server refuses it.
constexpr int kMaxFreshDrops = 3;

uint32_t RandomU32() {
  thread_local std::mt19937 rng(std::random_device{}());
  return static_cast<uint32_t>(rng());
}

std::string KeyListText(absl::Span<const std::string> keys) {
  std::string out = "[";
  for (size_t i = 0; i < keys.size() && i < kKeysNamed; ++i) {
    absl::StrAppend(&out, i == 0 ? "" : ", ", absl::CHexEscape(keys[i]));
  }
  if (keys.size() > kKeysNamed) {
    absl::StrAppend(&out, ", ... (", keys.size(), " keys)");
  }
  return out + "]";
}

// Splits "host:port", "[v6]:port" and "v6addr:port" (the last colon).
bool SplitAddress(const std::string& address, std::string* host,
                  std::string* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    return false;
  }
  *host = address.substr(0, colon);
  *port = address.substr(colon + 1);
  if (host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  return !host->empty() &&
         port->find_first_not_of("0123456789") == std::string::npos;
}

int MillisUntil(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(
      absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))),
      1 << 30));
}

}  // namespace

// One TCP connection: buffered writes and reads with deadlines. Once
// broken (lost, timed out, or out of step with the protocol) it is never
// used again.
class TcpStoreClient::Conn {
 public:
  // Connects to the first address of `address` that accepts before
  // `deadline`. UNAVAILABLE saying why not.
  static absl::StatusOr<std::unique_ptr<Conn>> Open(
      const std::string& address, absl::Time deadline,
      absl::Duration reply_timeout) {
    // Several servers (cohortd replicas), "HOST:PORT,HOST:PORT": each in
    // turn, until one accepts.
    if (address.find(',') != std::string::npos) {
      std::string errors;
      for (absl::string_view one : absl::StrSplit(address, ',')) {
        absl::StatusOr<std::unique_ptr<Conn>> conn =
            Open(std::string(one), deadline, reply_timeout);
        if (conn.ok()) return conn;
        absl::StrAppend(&errors, errors.empty() ? "" : "; ", one, ": ",
                        conn.status().message());
      }
      return absl::UnavailableError(errors);
    }
    std::string host, port;
    SplitAddress(address, &host, &port);
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
        rc != 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc)));
    }
    std::string error = "no address";
    int fd = -1;
    for (addrinfo* ai = found; ai != nullptr && fd < 0; ai = ai->ai_next) {
      fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                  ai->ai_protocol);
      if (fd < 0) {
        error = std::strerror(errno);
        continue;
      }
      int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        pollfd p{fd, POLLOUT, 0};
        rc = poll(&p, 1, MillisUntil(deadline));
        int so_error = ETIMEDOUT;
        socklen_t len = sizeof(so_error);
        if (rc == 1) getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len);
        errno = so_error;
        rc = so_error == 0 ? 0 : -1;
      }
      if (rc != 0) {
        error = std::strerror(errno);
        close(fd);
        fd = -1;
      }
    }
    freeaddrinfo(found);
    if (fd < 0) return absl::UnavailableError(error);
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return std::unique_ptr<Conn>(new Conn(fd, address, reply_timeout));
  }

  ~Conn() { close(fd_); }

  Dialect dialect = Dialect::kTorch21;
  bool broken() const { return broken_; }

  void Queue(const Request& r) { tcpstore::EncodeRequest(dialect, r, &out_); }
  void Queue(Op op, absl::string_view key = {}) {
    Request r;
    r.op = op;
    r.key = key;
    Queue(r);
  }
  void QueueKeys(Op op, const std::vector<std::string>& keys) {
    Request r;
    r.op = op;
    r.keys.assign(keys.begin(), keys.end());
    Queue(r);
  }

  // Sends what is queued.
  absl::Status Flush() {
    const absl::Time deadline = absl::Now() + reply_timeout_;
    size_t sent = 0;
    while (sent < out_.size()) {
      ssize_t n =
          send(fd_, out_.data() + sent, out_.size() - sent, MSG_NOSIGNAL);
      if (n > 0) {
        sent += n;
      } else if (n < 0 && errno == EAGAIN) {
        pollfd p{fd_, POLLOUT, 0};
        if (poll(&p, 1, MillisUntil(deadline)) == 0) {
          return Lost(absl::StrCat("could not send for ",
                                   absl::FormatDuration(reply_timeout_)));
        }
      } else if (n < 0 && errno != EINTR) {
        return Lost(std::strerror(errno));
      }
    }
    out_.clear();
    return absl::OkStatus();
  }

  // Reads `n` bytes into `out`. DEADLINE_EXCEEDED at `deadline`, leaving
  // the connection usable; UNAVAILABLE (broken) if it closed.
  absl::Status Read(size_t n, absl::Time deadline, std::string* out) {
    out->clear();
    while (out->size() < n) {
      if (in_pos_ == in_.size()) {
        in_.clear();
        in_pos_ = 0;
        pollfd p{fd_, POLLIN, 0};
        const int ready = poll(&p, 1, MillisUntil(deadline));
        if (ready == 0) return absl::DeadlineExceededError("no reply yet");
        if (ready < 0 && errno == EINTR) continue;
        char buf[64 << 10];
        ssize_t got = recv(fd_, buf, sizeof(buf), 0);
        if (got == 0) return Lost("the server closed the connection");
        if (got < 0) {
          if (errno == EAGAIN || errno == EINTR) continue;
          return Lost(std::strerror(errno));
        }
        in_.assign(buf, got);
      }
      const size_t take = std::min(n - out->size(), in_.size() - in_pos_);
      out->append(in_, in_pos_, take);
      in_pos_ += take;
    }
    return absl::OkStatus();
  }

  // Replies to queries that do not block: a reply that takes longer than
  // reply_timeout breaks the connection.
  // A `deadline` given instead is the caller's to handle (a wait's).
  absl::StatusOr<uint64_t> Word(size_t bytes,
                                absl::Time deadline = absl::InfiniteFuture()) {
    const bool is_reply = deadline == absl::InfiniteFuture();
    if (is_reply) deadline = absl::Now() + reply_timeout_;
    std::string raw;
    if (absl::Status s = Read(bytes, deadline, &raw); !s.ok()) {
      if (is_reply && absl::IsDeadlineExceeded(s)) {
        return Lost(absl::StrCat("no reply within ",
                                 absl::FormatDuration(reply_timeout_)));
      }
      return s;
    }
    uint64_t v = 0;
    for (size_t i = bytes; i > 0; --i) {
      v = (v << 8) | static_cast<uint8_t>(raw[i - 1]);
    }
    return v;
  }
  absl::StatusOr<int64_t> I64() {
    absl::StatusOr<uint64_t> v = Word(8);
    if (!v.ok()) return v.status();
    return static_cast<int64_t>(*v);
  }
  absl::StatusOr<std::string> Bytes() {
    absl::StatusOr<uint64_t> length = Word(8);
    if (!length.ok()) return length.status();
    if (*length > kMaxReplyBytes) {
      return Violation(absl::StrCat("a reply string of ", *length, " bytes"));
    }
    std::string value;
    if (absl::Status s = Read(*length, absl::Now() + reply_timeout_, &value);
        !s.ok()) {
      if (absl::IsDeadlineExceeded(s)) return Lost("a reply stopped midway");
      return s;
    }
    return value;
  }

  // Breaks the connection: the server said something the protocol does
  // not allow here. INTERNAL.
  absl::Status Violation(absl::string_view what) {
    broken_ = true;
    return absl::InternalError(
        absl::StrCat("protocol error from the TCPStore server at ", address_,
                     " (", tcpstore::DialectName(dialect), " dialect): ", what,
                     "; the connection was dropped"));
  }
  // Breaks the connection without an error of the server's.
  void Drop() { broken_ = true; }

  // Whether the server closed the connection (or sent something
  // unasked) while it was idle, as a restarted server's old connections
  // are: then a call reconnects first instead of sending into it.
  bool Stale() {
    if (in_pos_ < in_.size()) return true;
    pollfd p{fd_, POLLIN, 0};
    return poll(&p, 1, 0) != 0;
  }

 private:
  Conn(int fd, std::string address, absl::Duration reply_timeout)
      : fd_(fd), address_(std::move(address)), reply_timeout_(reply_timeout) {}

  absl::Status Lost(absl::string_view why) {
    broken_ = true;
    return absl::UnavailableError(absl::StrCat(
        "lost the connection to the TCPStore server at ", address_, ": ", why));
  }

  const int fd_;
  const std::string address_;
  const absl::Duration reply_timeout_;
  bool broken_ = false;
  std::string out_;
  std::string in_;
  size_t in_pos_ = 0;
};

namespace {

// Makes the server confirm everything sent before: SET, MULTI_SET and
// APPEND have no reply, and replies come in order.
template <typename Conn>
absl::Status Sync(Conn& c) {
  if (c.dialect == Dialect::kTorch113) {
    c.Queue(Op::kNumKeys);
    if (absl::Status s = c.Flush(); !s.ok()) return s;
    return c.I64().status();
  }
  Request ping;
  ping.op = Op::kPing;
  ping.word = RandomU32();
  c.Queue(ping);
  if (absl::Status s = c.Flush(); !s.ok()) return s;
  absl::StatusOr<uint64_t> echo = c.Word(4);
  if (!echo.ok()) return echo.status();
  if (*echo != ping.word) {
    return c.Violation(
        absl::StrCat("PING nonce ", ping.word, " came back as ", *echo));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpStoreClient>> TcpStoreClient::Connect(
    const TcpStoreClientOptions& options) {
  for (absl::string_view one : absl::StrSplit(options.address, ',')) {
    std::string host, port;
    if (!SplitAddress(std::string(one), &host, &port)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "TCPStore address must be HOST:PORT (or several, comma-separated), "
          "got '",
          options.address, "'"));
    }
  }
  if (options.connect_timeout <= absl::ZeroDuration() ||
      options.reply_timeout <= absl::ZeroDuration() ||
      options.probe_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "connect_timeout, reply_timeout and probe_timeout must be > 0");
  }
  std::unique_ptr<TcpStoreClient> client(new TcpStoreClient(options));
  absl::MutexLock lock(&client->mu_);
  if (absl::Status s = client->Dial(absl::Now() + options.connect_timeout);
      !s.ok()) {
    return s;
  }
  return client;
}

TcpStoreClient::TcpStoreClient(const TcpStoreClientOptions& options)
    : options_(options) {
  if (options.dialect != TcpStoreDialect::kProbe) {
    resolved_ = true;
    dialect_ = options.dialect == TcpStoreDialect::kTorch113
                   ? Dialect::kTorch113
                   : Dialect::kTorch21;
  }
}

TcpStoreClient::~TcpStoreClient() = default;

tcpstore::Dialect TcpStoreClient::dialect() const {
  absl::MutexLock lock(&mu_);
  return dialect_;
}

absl::Status TcpStoreClient::Dial(absl::Time deadline) {
  conn_.reset();
  const absl::Time start = absl::Now();
  absl::Duration backoff = options_.initial_backoff;
  absl::Status last;
  int attempts = 0;
  // A 2.1 handshake: VALIDATE, then a PING whose nonce must come back.
  auto handshake = [&](Conn& c) {
    Request validate;
    validate.op = Op::kValidate;
    validate.word = tcpstore::kValidateMagic;
    c.Queue(validate);
    return Sync(c);
  };
  // The kProbe probe: true if the server answered a 1.13 GETNUMKEYS.
  auto probe = [&](Conn& c) {
    c.dialect = Dialect::kTorch113;
    c.Queue(Op::kNumKeys);
    if (!c.Flush().ok()) return false;
    return c.Word(8, std::min(deadline, absl::Now() + options_.probe_timeout))
        .ok();
  };
  for (;;) {
    ++attempts;
    absl::StatusOr<std::unique_ptr<Conn>> conn =
        Conn::Open(options_.address, deadline, options_.reply_timeout);
    if (conn.ok() && !resolved_ && probe(**conn)) {
      dialect_ = Dialect::kTorch113;
      resolved_ = true;
      conn_ = std::move(*conn);
      return absl::OkStatus();
    }
    if (conn.ok() && !resolved_) {
      // Not 1.13: a 2.1+ server closed or ignored the probe's connection.
      conn = Conn::Open(options_.address, deadline, options_.reply_timeout);
    }
    if (conn.ok()) {
      (*conn)->dialect = resolved_ ? dialect_ : Dialect::kTorch21;
      absl::Status s = (*conn)->dialect == Dialect::kTorch21 ? handshake(**conn)
                                                             : absl::OkStatus();
      if (s.ok()) {
        dialect_ = (*conn)->dialect;
        resolved_ = true;
        conn_ = std::move(*conn);
        return absl::OkStatus();
      }
      if (absl::IsInternal(s)) return s;
      last = s;
      if (options_.dialect == TcpStoreDialect::kTorch21) {
        last = absl::Status(
            s.code(), absl::StrCat(s.message(),
                                   " (after VALIDATE + PING; a PyTorch "
                                   "1.13/2.0 server needs dialect 1.13)"));
      }
    } else {
      last = conn.status();
    }
    if (absl::Now() >= deadline) break;
    thread_local std::mt19937 rng(std::random_device{}());
    absl::SleepFor(std::min(
        backoff * std::uniform_real_distribution<double>(0.5, 1.0)(rng),
        deadline - absl::Now()));
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
  return absl::UnavailableError(absl::StrCat(
      "cannot connect to the TCPStore server at ", options_.address, " within ",
      absl::FormatDuration(std::max(deadline - start, absl::ZeroDuration())),
      " (", attempts, attempts == 1 ? " attempt" : " attempts",
      "; last: ", last.message(), "): is it running there?"));
}

template <typename T>
absl::StatusOr<T> TcpStoreClient::Run(absl::string_view what, bool idempotent,
                                      Attempt<T> attempt) {
  absl::MutexLock lock(&mu_);
  auto explain = [&](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
  };
  absl::Time lost_at = absl::InfiniteFuture();
  absl::Duration backoff = options_.initial_backoff;
  int fresh_drops = 0;
  for (;;) {
    if (conn_ != nullptr && conn_->Stale()) conn_.reset();
    const bool fresh = conn_ == nullptr;
    if (fresh) {
      const absl::Time since = std::min(lost_at, absl::Now());
      if (absl::Status s = Dial(since + options_.connect_timeout); !s.ok()) {
        return explain(s);
      }
    }
    absl::StatusOr<T> result = attempt(*conn_);
    if (!conn_->broken()) {
      if (result.ok() || absl::IsDeadlineExceeded(result.status())) {
        return result;
      }
      return explain(result.status());
    }
    conn_.reset();
    const absl::Status& s = result.status();
    if (result.ok() || absl::IsDeadlineExceeded(s)) return result;
    if (!absl::IsUnavailable(s)) return explain(s);
    if (!idempotent) {
      return explain(absl::UnavailableError(
          absl::StrCat(s.message(),
                       "; the change may or may not have been applied "
                       "(not retried: repeating it is not safe)")));
    }
    if (fresh && ++fresh_drops >= kMaxFreshDrops) {
      return explain(absl::FailedPreconditionError(absl::StrCat(
          "the TCPStore server at ", options_.address, " closed ",
          kMaxFreshDrops,
          " fresh connections in reply to this request, so it refuses it "
          "(torch servers close the connection on a request they cannot "
          "serve: a key over their limits, an unknown query for their "
          "release); last: ",
          s.message())));
    }
    if (lost_at == absl::InfiniteFuture()) lost_at = absl::Now();
    if (fresh) {
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, options_.max_backoff);
    }
  }
}

absl::Status TcpStoreClient::WaitOn(Conn& c,
                                    const std::vector<std::string>& keys,
                                    absl::Span<const std::string> user_keys,
                                    absl::Duration timeout, absl::Time deadline,
                                    absl::string_view what) const {
  if (keys.empty()) return absl::OkStatus();
  c.QueueKeys(Op::kWait, keys);
  if (absl::Status s = c.Flush(); !s.ok()) return s;
  absl::StatusOr<uint64_t> reply = c.Word(1, deadline);
  if (reply.ok()) {
    if (*reply == static_cast<uint8_t>(tcpstore::WaitReply::kStopWaiting)) {
      return absl::OkStatus();
    }
    return c.Violation(absl::StrCat("WAIT answered ", *reply));
  }
  if (!absl::IsDeadlineExceeded(reply.status())) return reply.status();
  const std::string head =
      absl::StrCat(what, " for keys ", KeyListText(user_keys),
                   " timed out after ", absl::FormatDuration(timeout));
  if (c.dialect == Dialect::kTorch113) {
    c.Drop();
    return absl::DeadlineExceededError(absl::StrCat(
        head,
        " (the PyTorch 1.13 protocol cannot cancel a wait: the connection "
        "was closed and the next call reconnects)"));
  }
  c.Queue(Op::kCancelWait);
  if (absl::Status s = c.Flush(); !s.ok()) return s;
  absl::StatusOr<uint64_t> cancel = c.Word(1);
  if (!cancel.ok()) return cancel.status();
  if (*cancel == static_cast<uint8_t>(tcpstore::WaitReply::kStopWaiting)) {
    // The keys arrived while the cancel was on its way: the wait is met.
    cancel = c.Word(1);
    if (!cancel.ok()) return cancel.status();
    if (*cancel == static_cast<uint8_t>(tcpstore::WaitReply::kWaitCanceled)) {
      return absl::OkStatus();
    }
  }
  if (*cancel != static_cast<uint8_t>(tcpstore::WaitReply::kWaitCanceled)) {
    return c.Violation(absl::StrCat("CANCEL_WAIT answered ", *cancel));
  }
  if (keys.size() > kKeysChecked) return absl::DeadlineExceededError(head);
  for (const std::string& k : keys) c.QueueKeys(Op::kCheck, {k});
  if (absl::Status s = c.Flush(); !s.ok()) return s;
  std::vector<std::string> missing;
  for (size_t i = 0; i < keys.size(); ++i) {
    absl::StatusOr<uint64_t> ready = c.Word(1);
    if (!ready.ok()) return ready.status();
    if (*ready == static_cast<uint8_t>(tcpstore::CheckReply::kNotReady)) {
      missing.push_back(user_keys[i]);
    } else if (*ready != static_cast<uint8_t>(tcpstore::CheckReply::kReady)) {
      return c.Violation(absl::StrCat("CHECK answered ", *ready));
    }
  }
  std::string list = KeyListText(missing);
  return absl::DeadlineExceededError(
      absl::StrCat(head, "; missing: ", list.substr(1, list.size() - 2)));
}

std::vector<std::string> TcpStoreClient::Keys(
    absl::Span<const std::string> keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const std::string& k : keys) out.push_back(Key(k));
  return out;
}

absl::Status TcpStoreClient::RunStatus(
    absl::string_view what, bool idempotent,
    absl::FunctionRef<absl::Status(Conn&)> attempt) {
  return Run<bool>(what, idempotent,
                   [&](Conn& c) -> absl::StatusOr<bool> {
                     absl::Status s = attempt(c);
                     if (!s.ok()) return s;
                     return true;
                   })
      .status();
}

absl::Status TcpStoreClient::Set(absl::string_view key,
                                 absl::string_view value) {
  const std::string k = Key(key);
  return RunStatus("set", true, [&](Conn& c) {
    Request r;
    r.op = Op::kSet;
    r.key = k;
    r.value = value;
    c.Queue(r);
    return Sync(c);
  });
}

absl::StatusOr<std::string> TcpStoreClient::Get(absl::string_view key,
                                                absl::Duration timeout) {
  const std::vector<std::string> user_keys = {std::string(key)};
  const std::vector<std::string> keys = Keys(user_keys);
  const absl::Time deadline = absl::Now() + timeout;
  return Run<std::string>(
      "get", true, [&](Conn& c) -> absl::StatusOr<std::string> {
        if (absl::Status s =
                WaitOn(c, keys, user_keys, timeout, deadline, "get: wait");
            !s.ok()) {
          return s;
        }
        c.Queue(Op::kGet, keys[0]);
        if (absl::Status s = c.Flush(); !s.ok()) return s;
        return c.Bytes();
      });
}

absl::StatusOr<int64_t> TcpStoreClient::Add(absl::string_view key,
                                            int64_t delta) {
  const std::string k = Key(key);
  return Run<int64_t>("add", false, [&](Conn& c) -> absl::StatusOr<int64_t> {
    Request r;
    r.op = Op::kAdd;
    r.key = k;
    r.number = delta;
    c.Queue(r);
    if (absl::Status s = c.Flush(); !s.ok()) return s;
    return c.I64();
  });
}

absl::StatusOr<std::string> TcpStoreClient::CompareSet(
    absl::string_view key, absl::string_view expected,
    absl::string_view desired) {
  const std::string k = Key(key);
  return Run<std::string>("compare_set", false,
                          [&](Conn& c) -> absl::StatusOr<std::string> {
                            Request r;
                            r.op = Op::kCompareSet;
                            r.key = k;
                            r.expected = expected;
                            r.value = desired;
                            c.Queue(r);
                            if (absl::Status s = c.Flush(); !s.ok()) return s;
                            return c.Bytes();
                          });
}

absl::Status TcpStoreClient::Wait(absl::Span<const std::string> keys,
                                  absl::Duration timeout) {
  const std::vector<std::string> wire_keys = Keys(keys);
  const absl::Time deadline = absl::Now() + timeout;
  return RunStatus("wait", true, [&](Conn& c) {
    return WaitOn(c, wire_keys, keys, timeout, deadline, "wait");
  });
}

absl::StatusOr<bool> TcpStoreClient::Check(absl::Span<const std::string> keys) {
  const std::vector<std::string> wire_keys = Keys(keys);
  return Run<bool>("check", true, [&](Conn& c) -> absl::StatusOr<bool> {
    c.QueueKeys(Op::kCheck, wire_keys);
    if (absl::Status s = c.Flush(); !s.ok()) return s;
    absl::StatusOr<uint64_t> reply = c.Word(1);
    if (!reply.ok()) return reply.status();
    if (*reply > 1) return c.Violation(absl::StrCat("CHECK answered ", *reply));
    return *reply == static_cast<uint8_t>(tcpstore::CheckReply::kReady);
  });
}

absl::StatusOr<bool> TcpStoreClient::DeleteKey(absl::string_view key) {
  const std::string k = Key(key);
  return Run<bool>("delete", true, [&](Conn& c) -> absl::StatusOr<bool> {
    c.Queue(Op::kDeleteKey, k);
    if (absl::Status s = c.Flush(); !s.ok()) return s;
    absl::StatusOr<int64_t> deleted = c.I64();
    if (!deleted.ok()) return deleted.status();
    return *deleted > 0;
  });
}

absl::StatusOr<int64_t> TcpStoreClient::NumKeys() {
  return Run<int64_t>("num_keys", true, [&](Conn& c) {
    c.Queue(Op::kNumKeys);
    if (absl::Status s = c.Flush(); !s.ok()) return absl::StatusOr<int64_t>(s);
    return c.I64();
  });
}

absl::StatusOr<std::vector<std::string>> TcpStoreClient::MultiGet(
    absl::Span<const std::string> keys, absl::Duration timeout) {
  const std::vector<std::string> wire_keys = Keys(keys);
  const absl::Time deadline = absl::Now() + timeout;
  using Values = std::vector<std::string>;
  return Run<Values>("multi_get", true, [&](Conn& c) -> absl::StatusOr<Values> {
    if (absl::Status s =
            WaitOn(c, wire_keys, keys, timeout, deadline, "multi_get: wait");
        !s.ok()) {
      return s;
    }
    Values values;
    if (keys.empty()) return values;
    if (c.dialect == Dialect::kTorch113) {
      for (const std::string& k : wire_keys) c.Queue(Op::kGet, k);
    } else {
      c.QueueKeys(Op::kMultiGet, wire_keys);
    }
    if (absl::Status s = c.Flush(); !s.ok()) return s;
    values.reserve(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      absl::StatusOr<std::string> v = c.Bytes();
      if (!v.ok()) return v.status();
      values.push_back(std::move(*v));
    }
    return values;
  });
}

absl::Status TcpStoreClient::MultiSet(absl::Span<const std::string> keys,
                                      absl::Span<const std::string> values) {
  if (keys.size() != values.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "multi_set: ", keys.size(), " keys but ", values.size(), " values"));
  }
  const std::vector<std::string> wire_keys = Keys(keys);
  return RunStatus("multi_set", true, [&](Conn& c) {
    Request r;
    if (c.dialect == Dialect::kTorch113) {
      r.op = Op::kSet;
      for (size_t i = 0; i < keys.size(); ++i) {
        r.key = wire_keys[i];
        r.value = values[i];
        c.Queue(r);
      }
    } else if (!keys.empty()) {
      r.op = Op::kMultiSet;
      r.keys.assign(wire_keys.begin(), wire_keys.end());
      r.values.assign(values.begin(), values.end());
      c.Queue(r);
    }
    return Sync(c);
  });
}

absl::Status TcpStoreClient::Append(absl::string_view key,
                                    absl::string_view value) {
  const std::string k = Key(key);
  auto compare_set = [&](Conn& c, absl::string_view expected,
                         absl::string_view desired) {
    Request r;
    r.op = Op::kCompareSet;
    r.key = k;
    r.expected = expected;
    r.value = desired;
    c.Queue(r);
    absl::Status s = c.Flush();
    return s.ok() ? c.Bytes() : absl::StatusOr<std::string>(s);
  };
  return RunStatus("append", false, [&](Conn& c) {
    if (c.dialect == Dialect::kTorch21) {
      Request r;
      r.op = Op::kAppend;
      r.key = k;
      r.value = value;
      c.Queue(r);
      return Sync(c);
    }
    // Read without writing: a random token as both expected and desired
    // comes back as it is if the key is missing, else the current value.
    const std::string token = absl::StrCat(
        "\x01"
        "cohort-append/",
        RandomU32(), "/", RandomU32());
    absl::StatusOr<std::string> current = compare_set(c, token, token);
    if (!current.ok()) return current.status();
    std::string expected = *current == token ? "" : *current;
    for (int i = 0; i < 10000; ++i) {
      const std::string desired = absl::StrCat(expected, value);
      current = compare_set(c, expected, desired);
      if (!current.ok()) return current.status();
      if (*current == desired) return absl::OkStatus();
      // Equal to `expected` only when the key was deleted.
      expected = *current == expected ? "" : *current;
    }
    return absl::AbortedError(
        "gave up after 10000 compare_set rounds lost to other writers");
  });
}

absl::StatusOr<KeyList> TcpStoreClient::ListKeys(absl::string_view prefix) {
  if (dialect() == Dialect::kTorch113) {
    return absl::UnimplementedError(
        "list_keys: the PyTorch 1.13 TCPStore protocol has no LIST_KEYS "
        "(connect with the 2.1 dialect to a server that has it: cohortd)");
  }
  const std::string want = Key(prefix);
  return Run<KeyList>(
      "list_keys", true, [&](Conn& c) -> absl::StatusOr<KeyList> {
        c.Queue(Op::kListKeys);
        if (absl::Status s = c.Flush(); !s.ok()) return s;
        absl::StatusOr<int64_t> count = c.I64();
        if (!count.ok()) return count.status();
        if (*count < 0 || *count > (int64_t{1} << 32)) {
          return c.Violation(absl::StrCat("LIST_KEYS count ", *count));
        }
        KeyList list;
        for (int64_t i = 0; i < *count; ++i) {
          absl::StatusOr<std::string> key = c.Bytes();
          if (!key.ok()) return key.status();
          if (absl::StartsWith(*key, want)) {
            list.keys.push_back(key->substr(options_.key_prefix.size()));
          }
        }
        std::sort(list.keys.begin(), list.keys.end());
        return list;
      });
}

absl::StatusOr<std::unique_ptr<WatchHandle>> TcpStoreClient::Watch(
    absl::string_view, int64_t, WatchCallback) {
  return absl::UnimplementedError(
      "watch: the TCPStore protocol has no watch; use RemoteStore "
      "(cohort://)");
}

}  // namespace cohort
