#include "client/tcpstore_check.h"

#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/net.h"
#include "client/peer_probe.h"
#include "proto/tcpstore/wire.h"

namespace cohort {
namespace {

using tcpstore::Dialect;
using tcpstore::Op;

uint64_t Random64() {
  thread_local std::mt19937_64 rng(std::random_device{}());
  return rng();
}

std::string NumericHost(const base::SocketAddress& a) {
  char host[NI_MAXHOST] = "";
  getnameinfo(a.get(), a.size, host, sizeof(host), nullptr, 0, NI_NUMERICHOST);
  return host;
}

// A TCP connection to `a` within `timeout`, or -1 and *why.
int Connect(const base::SocketAddress& a, absl::Duration timeout,
            absl::Status* why) {
  const int fd =
      socket(a.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *why = absl::UnavailableError(
        absl::StrCat("cannot open a socket: ", std::strerror(errno)));
    return -1;
  }
  int error = 0;
  if (connect(fd, a.get(), a.size) != 0) {
    error = errno;
    if (error == EINPROGRESS) {
      const absl::Time deadline = absl::Now() + timeout;
      pollfd p = {fd, POLLOUT, 0};
      int ready;
      while ((ready = poll(&p, 1, base::PollTimeoutMillis(deadline))) < 0 &&
             errno == EINTR) {
      }
      error = ETIMEDOUT;
      socklen_t len = sizeof(error);
      if (ready == 1) getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len);
    }
  }
  if (error == 0) return fd;
  close(fd);
  if (error == ECONNREFUSED) {
    *why = absl::UnavailableError(
        "the connection was refused: nothing listens on that port");
  } else if (error == ETIMEDOUT) {
    *why = absl::DeadlineExceededError(absl::StrCat(
        "the TCP connect got no answer within ", absl::FormatDuration(timeout),
        ": a firewall dropping it, or a host that is down"));
  } else {
    *why = absl::UnavailableError(
        absl::StrCat("cannot connect: ", std::strerror(error)));
  }
  return -1;
}

// Connects to the first address of `address` that accepts; why not.
absl::StatusOr<int> Dial(const std::string& address, absl::Duration timeout) {
  absl::StatusOr<base::HostPort> where = base::SplitHostPort(address);
  if (!where.ok()) return where.status();
  absl::StatusOr<std::vector<base::SocketAddress>> found =
      base::Resolve(*where);
  if (!found.ok()) {
    return absl::UnavailableError(
        absl::StrCat("the host does not resolve: ", found.status().message()));
  }
  std::vector<absl::Status> failures;
  std::vector<std::string> tried;
  int fd = -1;
  for (const base::SocketAddress& a : *found) {
    absl::Status why;
    fd = Connect(a, timeout, &why);
    if (fd >= 0) break;
    failures.push_back(why);
    tried.push_back(NumericHost(a));
  }
  if (fd >= 0) return fd;
  if (failures.size() == 1) return failures[0];
  // Say what each address did; time-outs are the news if any.
  absl::StatusCode code = absl::StatusCode::kUnavailable;
  std::vector<std::string> each;
  for (size_t i = 0; i < failures.size(); ++i) {
    if (absl::IsDeadlineExceeded(failures[i])) {
      code = absl::StatusCode::kDeadlineExceeded;
    }
    each.push_back(absl::StrCat(tried[i], ": ", failures[i].message()));
  }
  return absl::Status(code, absl::StrJoin(each, "; "));
}

std::string PingReply(uint32_t nonce) {
  std::string reply;
  tcpstore::Encoder(&reply).U32(nonce);
  return reply;
}

}  // namespace

std::string CheckOpening(const TcpStoreCheckOptions& options,
                         absl::string_view key, uint32_t nonce) {
  std::string out;
  tcpstore::EncodeNamespaceHello(options.name_space, &out, options.token);
  tcpstore::Request request;
  request.op = Op::kValidate;
  request.word = tcpstore::kValidateMagic;
  tcpstore::EncodeRequest(Dialect::kTorch21, request, &out);
  request.op = Op::kPing;
  request.word = nonce;
  tcpstore::EncodeRequest(Dialect::kTorch21, request, &out);
  if (!key.empty()) {
    request = tcpstore::Request();
    request.op = Op::kWait;
    request.keys = {key};
    tcpstore::EncodeRequest(Dialect::kTorch21, request, &out);
  }
  return out;
}

CheckReply ClassifyCheckReply(absl::string_view bytes, bool ended,
                              uint32_t nonce, bool asked_key) {
  const std::string ping = PingReply(nonce);
  if (bytes.empty()) {
    return ended ? CheckReply::kClosedEarly : CheckReply::kIncomplete;
  }
  const size_t head = std::min(bytes.size(), ping.size());
  if (bytes.substr(0, head) != absl::string_view(ping).substr(0, head)) {
    return CheckReply::kWrongBytes;
  }
  if (bytes.size() < ping.size()) {
    return ended ? CheckReply::kWrongBytes : CheckReply::kIncomplete;
  }
  const absl::string_view rest = bytes.substr(ping.size());
  if (!asked_key) {
    return rest.empty() ? CheckReply::kAnswered : CheckReply::kWrongBytes;
  }
  if (rest.empty()) {
    return ended ? CheckReply::kClosedLater : CheckReply::kPingOnly;
  }
  const char stop = static_cast<char>(tcpstore::WaitReply::kStopWaiting);
  return rest.size() == 1 && rest[0] == stop ? CheckReply::kAnswered
                                             : CheckReply::kWrongBytes;
}

namespace {

// Sends the check's opening and reads until the replies say what answers
// (or the deadline): the classified reply, and the bytes received.
CheckReply Exchange(int fd, const std::string& opening, uint32_t nonce,
                    bool with_key, absl::Time deadline, std::string& received) {
  // The opening is a few hundred bytes: the socket buffer takes it whole.
  size_t sent = 0;
  while (sent < opening.size()) {
    const ssize_t n =
        send(fd, opening.data() + sent, opening.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += n;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) {
      pollfd p = {fd, POLLOUT, 0};
      if (poll(&p, 1, base::PollTimeoutMillis(deadline)) > 0) continue;
    }
    break;  // Closed or stuck: the replies (none) tell.
  }
  bool ended = false;
  CheckReply reply = CheckReply::kIncomplete;
  for (;;) {
    reply = ClassifyCheckReply(received, ended, nonce, with_key);
    if (reply != CheckReply::kIncomplete && reply != CheckReply::kPingOnly) {
      break;
    }
    if (ended) break;
    pollfd p = {fd, POLLIN, 0};
    const int ready = poll(&p, 1, base::PollTimeoutMillis(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) break;  // The deadline.
    char buf[256];
    const ssize_t got = recv(fd, buf, sizeof(buf), 0);
    if (got > 0) {
      received.append(buf, got);
    } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
      ended = true;
    }
  }
  return reply;
}

// What the peer's answer (`reply`, the bytes `received`) says is there.
absl::Status Verdict(CheckReply reply, const std::string& received,
                     absl::Duration timeout) {
  const std::string waited = absl::FormatDuration(timeout);
  switch (reply) {
    case CheckReply::kAnswered:
      return absl::OkStatus();
    case CheckReply::kIncomplete:
      return absl::DeadlineExceededError(absl::StrCat(
          "it accepted the connection but did not answer a TCPStore PING "
          "within ",
          waited, ": not a TCPStore listener, or a stuck one"));
    case CheckReply::kPingOnly:
      return absl::NotFoundError(absl::StrCat(
          "it answers the TCPStore protocol, but the check key written "
          "through cohortd did not appear there within ",
          waited,
          ": it serves other keys, so it belongs to a different cohortd (or "
          "to one with another --tcpstore_prefix)"));
    case CheckReply::kClosedEarly:
      return absl::FailedPreconditionError(
          "it accepted the connection and closed it without answering: not "
          "a cohortd TCPStore listener (a plain PyTorch TCPStore closes a "
          "connection that opens with cohort's namespace hello), or a "
          "cohortd that refused this one (a token it does not accept, "
          "--tcpstore_allow; its log says which)");
    case CheckReply::kClosedLater:
      return absl::FailedPreconditionError(
          "it answered the handshake, then closed the connection instead of "
          "answering the WAIT for the check key (cohortd's log may say why)");
    case CheckReply::kWrongBytes:
      break;
  }
  PeerAnswer peer;
  ClassifyReply(received, /*ended=*/true, &peer);
  if (peer.kind == PeerKind::kHttp2 || peer.kind == PeerKind::kGoaway ||
      peer.kind == PeerKind::kTls) {
    return absl::FailedPreconditionError(absl::StrCat(
        "it answered in ", peer.kind == PeerKind::kTls ? "TLS" : "HTTP/2",
        ": a gRPC port (cohortd's --listen?), not a TCPStore listener"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "it answered with bytes that are not TCPStore replies (\"",
      absl::CHexEscape(absl::string_view(received).substr(0, 16)),
      "\"): not a TCPStore listener (cohortd's gRPC port, or another "
      "service?)"));
}

}  // namespace

absl::Status ProbeTcpStoreListener(const TcpStoreCheckOptions& options,
                                   absl::string_view key) {
  if (absl::Status s = tcpstore::CheckNamespace(options.name_space); !s.ok()) {
    return s;
  }
  absl::StatusOr<int> dialed = Dial(options.address, options.timeout);
  if (!dialed.ok()) return dialed.status();
  const int fd = *dialed;
  const uint32_t nonce = static_cast<uint32_t>(Random64());
  std::string received;
  const CheckReply reply =
      Exchange(fd, CheckOpening(options, key, nonce), nonce, !key.empty(),
               absl::Now() + options.timeout, received);
  close(fd);
  return Verdict(reply, received, options.timeout);
}

absl::StatusOr<TcpStoreCheckResult> CheckTcpStoreListener(
    Store& store, const TcpStoreCheckOptions& options) {
  if (absl::Status s = tcpstore::CheckNamespace(options.name_space); !s.ok()) {
    return s;
  }
  const std::string key =
      absl::StrFormat("check-%016x%016x", Random64(), Random64());
  const std::string stored =
      absl::StrCat(options.listener_prefix, options.name_space, key);
  TcpStoreCheckResult result;
  if (absl::Status written = store.Set(stored, "1"); !written.ok()) {
    if (!absl::IsPermissionDenied(written)) {
      return absl::Status(
          written.code(),
          absl::StrCat("writing the check key \"", absl::CHexEscape(stored),
                       "\" through cohortd: ", written.message()));
    }
    result.unverified = absl::StrCat(
        "the check key \"", absl::CHexEscape(stored),
        "\" may not be written with this token (", written.message(),
        "), so only that the listener answers was checked");
    if (absl::Status s = ProbeTcpStoreListener(options, ""); !s.ok()) return s;
    return result;
  }
  absl::Status probed = ProbeTcpStoreListener(options, key);
  // A key left behind (cohortd unreachable now) is one small key.
  store.DeleteKey(stored).IgnoreError();
  if (!probed.ok()) return probed;
  result.same_store = true;
  return result;
}

}  // namespace cohort
