#include "client/tcpstore_connection.h"

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

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "base/net.h"

namespace cohort {
namespace {

using tcpstore::Dialect;
using tcpstore::Op;
using tcpstore::Request;

// A reply string longer than this is a corrupt length prefix, not data.
constexpr uint64_t kMaxReplyBytes = uint64_t{1} << 30;

uint32_t RandomU32() {
  thread_local std::mt19937 rng(std::random_device{}());
  return static_cast<uint32_t>(rng());
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpStoreConnection>> TcpStoreConnection::Open(
    const std::string& address, absl::Time deadline,
    absl::Duration reply_timeout) {
  // Several servers (cohortd replicas), "HOST:PORT,HOST:PORT": each in
  // turn, until one accepts.
  if (address.find(',') != std::string::npos) {
    std::string errors;
    for (absl::string_view one : absl::StrSplit(address, ',')) {
      absl::StatusOr<std::unique_ptr<TcpStoreConnection>> conn =
          Open(std::string(one), deadline, reply_timeout);
      if (conn.ok()) return conn;
      absl::StrAppend(&errors, errors.empty() ? "" : "; ", one, ": ",
                      conn.status().message());
    }
    return absl::UnavailableError(errors);
  }
  absl::StatusOr<base::HostPort> where = base::SplitHostPort(address);
  if (!where.ok()) return where.status();
  absl::StatusOr<std::vector<base::SocketAddress>> found =
      base::Resolve(*where);
  if (!found.ok()) {
    return absl::UnavailableError(absl::StrCat(
        "cannot resolve '", where->host, "': ", found.status().message()));
  }
  std::string error = "no address";
  int fd = -1;
  for (const base::SocketAddress& a : *found) {
    fd = socket(a.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      error = std::strerror(errno);
      continue;
    }
    int rc = connect(fd, a.get(), a.size);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      rc = poll(&p, 1, base::PollTimeoutMillis(deadline));
      int so_error = ETIMEDOUT;
      socklen_t len = sizeof(so_error);
      if (rc == 1) getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len);
      errno = so_error;
      rc = so_error == 0 ? 0 : -1;
    }
    if (rc == 0) break;
    error = std::strerror(errno);
    close(fd);
    fd = -1;
  }
  if (fd < 0) return absl::UnavailableError(error);
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return std::unique_ptr<TcpStoreConnection>(
      new TcpStoreConnection(fd, address, reply_timeout));
}

TcpStoreConnection::TcpStoreConnection(int fd, std::string address,
                                       absl::Duration reply_timeout)
    : fd_(fd), address_(std::move(address)), reply_timeout_(reply_timeout) {}

TcpStoreConnection::~TcpStoreConnection() { close(fd_); }

void TcpStoreConnection::Queue(const Request& r) {
  tcpstore::EncodeRequest(dialect_, r, &out_);
}

void TcpStoreConnection::Queue(Op op, absl::string_view key) {
  Request r;
  r.op = op;
  r.key = key;
  Queue(r);
}

void TcpStoreConnection::QueueKeys(Op op,
                                   const std::vector<std::string>& keys) {
  Request r;
  r.op = op;
  r.keys.assign(keys.begin(), keys.end());
  Queue(r);
}

absl::Status TcpStoreConnection::Flush() {
  const absl::Time deadline = absl::Now() + reply_timeout_;
  size_t sent = 0;
  while (sent < out_.size()) {
    ssize_t n = send(fd_, out_.data() + sent, out_.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += n;
    } else if (n < 0 && errno == EAGAIN) {
      pollfd p{fd_, POLLOUT, 0};
      if (poll(&p, 1, base::PollTimeoutMillis(deadline)) == 0) {
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

absl::Status TcpStoreConnection::Read(size_t n, absl::Time deadline,
                                      std::string* out) {
  out->clear();
  while (out->size() < n) {
    if (in_pos_ == in_.size()) {
      in_.clear();
      in_pos_ = 0;
      pollfd p{fd_, POLLIN, 0};
      const int ready = poll(&p, 1, base::PollTimeoutMillis(deadline));
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

absl::StatusOr<uint64_t> TcpStoreConnection::Word(size_t bytes,
                                                  absl::Time deadline) {
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

absl::StatusOr<int64_t> TcpStoreConnection::I64() {
  absl::StatusOr<uint64_t> v = Word(8);
  if (!v.ok()) return v.status();
  return static_cast<int64_t>(*v);
}

absl::StatusOr<std::string> TcpStoreConnection::Bytes() {
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

absl::Status TcpStoreConnection::Sync() {
  if (dialect_ == Dialect::kTorch113) {
    Queue(Op::kNumKeys);
    if (absl::Status s = Flush(); !s.ok()) return s;
    return I64().status();
  }
  Request ping;
  ping.op = Op::kPing;
  ping.word = RandomU32();
  Queue(ping);
  if (absl::Status s = Flush(); !s.ok()) return s;
  absl::StatusOr<uint64_t> echo = Word(4);
  if (!echo.ok()) return echo.status();
  if (*echo != ping.word) {
    return Violation(
        absl::StrCat("PING nonce ", ping.word, " came back as ", *echo));
  }
  return absl::OkStatus();
}

absl::Status TcpStoreConnection::Violation(absl::string_view what) {
  broken_ = true;
  return absl::InternalError(
      absl::StrCat("protocol error from the TCPStore server at ", address_,
                   " (", tcpstore::DialectName(dialect_), " dialect): ", what,
                   "; the connection was dropped"));
}

bool TcpStoreConnection::Stale() {
  if (in_pos_ < in_.size()) return true;
  pollfd p{fd_, POLLIN, 0};
  return poll(&p, 1, 0) != 0;
}

absl::Status TcpStoreConnection::Lost(absl::string_view why) {
  broken_ = true;
  return absl::UnavailableError(absl::StrCat(
      "lost the connection to the TCPStore server at ", address_, ": ", why));
}

}  // namespace cohort
