#include "base/net.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace cohort::base {
namespace {

constexpr absl::string_view kNoPort = "it has no port";
constexpr absl::string_view kBadPort =
    "the port must be a number from 1 to 65535";
constexpr absl::string_view kBadPortOrZero =
    "the port must be a number from 0 to 65535";
constexpr absl::string_view kNoHost = "it has no host";
constexpr absl::string_view kBareIpv6 =
    "write an IPv6 address in brackets, as [fd00::1]:29400";

// SplitHostPort's rules: the reason `address` breaks them, or empty and
// *out filled.
absl::string_view Parse(absl::string_view address, const HostPortRules& rules,
                        HostPort* out) {
  const size_t colon = address.rfind(':');
  const size_t bracket = address.rfind(']');
  // "[fd00::1]" has colons, but none after its host.
  if (colon == absl::string_view::npos ||
      (bracket != absl::string_view::npos && colon < bracket)) {
    return kNoPort;
  }
  absl::string_view host = address.substr(0, colon);
  const absl::string_view port = address.substr(colon + 1);
  const bool digits =
      !port.empty() && port.size() <= 5 &&
      port.find_first_not_of("0123456789") == absl::string_view::npos;
  int number = 0;
  for (char c : port) number = digits ? number * 10 + (c - '0') : 0;
  if (!digits || number > 65535 || (number == 0 && !rules.allow_port_zero)) {
    return rules.allow_port_zero ? kBadPortOrZero : kBadPort;
  }
  const bool bracketed =
      host.size() >= 2 && host.front() == '[' && host.back() == ']';
  if (bracketed) host = host.substr(1, host.size() - 2);
  if (host.empty() && !rules.allow_empty_host) return kNoHost;
  if (!bracketed && !rules.allow_bare_ipv6 && absl::StrContains(host, ':')) {
    return kBareIpv6;
  }
  out->host = std::string(host);
  out->port = number;
  return {};
}

}  // namespace

absl::StatusOr<HostPort> SplitHostPort(absl::string_view address,
                                       const HostPortRules& rules) {
  HostPort out;
  if (absl::string_view why = Parse(address, rules, &out); !why.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "\"", absl::CHexEscape(address), "\" is not HOST:PORT: ", why));
  }
  return out;
}

absl::string_view HostPortProblem(absl::string_view address,
                                  const HostPortRules& rules) {
  HostPort ignored;
  return Parse(address, rules, &ignored);
}

std::string JoinHostPort(absl::string_view host, int port) {
  if (absl::StrContains(host, ':')) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

bool IsWildcardHost(absl::string_view host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]";
}

int SocketAddress::port() const {
  if (storage.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_port);
  }
  return ntohs(reinterpret_cast<const sockaddr_in*>(&storage)->sin_port);
}

absl::StatusOr<std::vector<SocketAddress>> Resolve(
    const HostPort& where, const ResolveOptions& options) {
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (options.passive ? AI_PASSIVE : 0);
  addrinfo* found = nullptr;
  const std::string service = absl::StrCat(where.port);
  if (int rc = getaddrinfo(where.host.empty() ? nullptr : where.host.c_str(),
                           service.c_str(), &hints, &found);
      rc != 0) {
    return absl::UnavailableError(gai_strerror(rc));
  }
  std::vector<SocketAddress> out;
  for (const addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    SocketAddress a;
    std::memcpy(&a.storage, ai->ai_addr, ai->ai_addrlen);
    a.size = ai->ai_addrlen;
    out.push_back(a);
  }
  freeaddrinfo(found);
  if (options.ipv4_first) {
    std::stable_partition(out.begin(), out.end(), [](const SocketAddress& a) {
      return a.family() == AF_INET;
    });
  }
  return out;
}

int MaxBacklog() {
  int backlog = 0;
  if (FILE* f = std::fopen("/proc/sys/net/core/somaxconn", "r")) {
    if (std::fscanf(f, "%d", &backlog) != 1) backlog = 0;
    std::fclose(f);
  }
  return std::max(backlog, 128);
}

absl::StatusOr<ListeningSocket> ListenExclusive(absl::string_view address,
                                                const ListenOptions& options) {
  const HostPortRules rules = {.allow_empty_host = true,
                               .allow_port_zero = true};
  HostPort where;
  if (absl::string_view why = Parse(address, rules, &where); !why.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen address '", absl::CHexEscape(address),
                     "' is not HOST:PORT: ", why));
  }
  absl::StatusOr<std::vector<SocketAddress>> candidates =
      Resolve(where, {.passive = true, .ipv4_first = true});
  if (!candidates.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot resolve listen address '", absl::CHexEscape(address),
        "': ", candidates.status().message()));
  }
  std::string errors;
  bool in_use = false;
  ListeningSocket out;
  for (const SocketAddress& a : *candidates) {
    const int s = socket(
        a.family(),
        SOCK_STREAM | SOCK_CLOEXEC | (options.nonblocking ? SOCK_NONBLOCK : 0),
        0);
    if (s < 0) {
      absl::StrAppend(&errors, errors.empty() ? "" : "; ", strerror(errno));
      continue;
    }
    const int one = 1;
    setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(s, a.get(), a.size) == 0 && listen(s, MaxBacklog()) == 0) {
      out.fd = s;
      break;
    }
    in_use |= errno == EADDRINUSE;
    absl::StrAppend(&errors, errors.empty() ? "" : "; ", strerror(errno));
    close(s);
  }
  if (out.fd < 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", absl::CHexEscape(address), ": ", errors,
        in_use && !options.when_in_use.empty()
            ? absl::StrCat(" (", options.when_in_use, ")")
            : ""));
  }
  SocketAddress bound;
  bound.size = sizeof(bound.storage);
  getsockname(out.fd, reinterpret_cast<sockaddr*>(&bound.storage), &bound.size);
  out.port = bound.port();
  return out;
}

int PollTimeoutMillis(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return -1;
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(
      absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))),
      1 << 30));
}

}  // namespace cohort::base
