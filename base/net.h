// Addresses and sockets, written once for every layer: HOST:PORT parsing,
// name resolution, an exclusive listening socket, poll timeouts, and an
// event loop's "poll briefly, then sleep".
//
// HOST:PORT is split at the last colon, so "[fd00::1]:29400" and (where the
// rules allow it) the bare "fd00::1:29400" both name host fd00::1. The host
// keeps no brackets; JoinHostPort puts them back.
#ifndef COHORT_BASE_NET_H_
#define COHORT_BASE_NET_H_

#include <sched.h>
#include <sys/socket.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace cohort::base {

struct HostPort {
  // A name or an address, without brackets ("fd00::1"). Empty: every
  // interface (a listen address's ":PORT").
  std::string host;
  int port = 0;
};

// What an address may leave out or spell loosely. The defaults are those of
// an address to dial.
struct HostPortRules {
  // ":PORT", for an address to listen on: every interface.
  bool allow_empty_host = false;
  // Port 0, for an address to listen on: the kernel picks a free port.
  bool allow_port_zero = false;
  // "fd00::1:29400", an IPv6 address without brackets (split at the last
  // colon). Off, such an address is refused, asking for the brackets.
  bool allow_bare_ipv6 = true;
};

// Splits HOST:PORT, "[IPv6]:PORT" or (allow_bare_ipv6) "IPv6:PORT" at the
// last colon. The port is 1 to 5 decimal digits, at most 65535, and not 0
// unless allowed. INVALID_ARGUMENT otherwise, as
//   "host" is not HOST:PORT: the port must be a number from 1 to 65535
// with the address escaped and the reason HostPortProblem gives.
absl::StatusOr<HostPort> SplitHostPort(absl::string_view address,
                                       const HostPortRules& rules = {});

// Why SplitHostPort refuses `address`, for a caller that words the rest of
// its message itself; empty when it accepts it. One of: "it has no port",
// "the port must be a number from 1 to 65535" (0 to 65535 when port 0 is
// allowed), "it has no host", "write an IPv6 address in brackets, as
// [fd00::1]:29400".
absl::string_view HostPortProblem(absl::string_view address,
                                  const HostPortRules& rules = {});

// "host:port", or "[host]:port" when the host holds a colon (IPv6).
std::string JoinHostPort(absl::string_view host, int port);

// Whether a listen address's host (bracketed or not) means every interface:
// "", "0.0.0.0", "::" or "[::]".
bool IsWildcardHost(absl::string_view host);

// One address getaddrinfo gave, as the socket calls take it.
struct SocketAddress {
  sockaddr_storage storage = {};
  socklen_t size = 0;

  int family() const { return storage.ss_family; }
  const sockaddr* get() const {
    return reinterpret_cast<const sockaddr*>(&storage);
  }
  // The port, in host order.
  int port() const;
};

struct ResolveOptions {
  // Addresses to bind (AI_PASSIVE): an empty host is every interface. Not
  // passive, an empty host is the loopback.
  bool passive = false;
  // IPv4 addresses before IPv6 ones (each in getaddrinfo's order): a
  // listener on "localhost" then binds 127.0.0.1, which every client
  // reaches (one that tries ::1 first falls back to it).
  bool ipv4_first = false;
};

// The TCP addresses of `where`, in getaddrinfo's order unless ipv4_first.
// Blocks on DNS. UNAVAILABLE when the host does not resolve; its message is
// getaddrinfo's reason alone ("Name or service not known"), which the
// caller puts in context ("cannot resolve 'cohortd': ...").
absl::StatusOr<std::vector<SocketAddress>> Resolve(
    const HostPort& where, const ResolveOptions& options = {});

// The kernel's cap on a listen backlog (net.core.somaxconn), at least 128.
int MaxBacklog();

struct ListenOptions {
  // SOCK_NONBLOCK, for an event loop that accepts until EAGAIN.
  bool nonblocking = false;
  // Appended to the UNAVAILABLE message, in parentheses, when the port is
  // taken ("another process, perhaps another cohortd, serves this port").
  std::string when_in_use;
};

struct ListeningSocket {
  int fd = -1;
  int port = 0;  // The port bound: the one asked for, or the one picked.
};

// Binds `address` (HOST:PORT, ":PORT" for every interface, port 0 for a
// free one; IPv4 first) with SO_REUSEADDR, so that a restarted server binds
// over its predecessor's TIME_WAIT connections, but never SO_REUSEPORT,
// which would let two processes listen on one port; and listens with
// MaxBacklog(). The socket is close-on-exec and the caller's to close.
// INVALID_ARGUMENT when the address does not parse ("listen address 'X' is
// not HOST:PORT: ...") or resolve ("cannot resolve listen address 'X':
// ..."); UNAVAILABLE naming the address and each bind's error when none
// binds ("cannot listen on X: Address already in use").
absl::StatusOr<ListeningSocket> ListenExclusive(
    absl::string_view address, const ListenOptions& options = {});

// A poll(2) or epoll_wait timeout in milliseconds that ends at `deadline`
// (rounded up): 0 once it has passed, -1 (no timeout) for InfiniteFuture,
// at most 2^30.
int PollTimeoutMillis(absl::Time deadline);

// An event loop's "poll briefly, then sleep". After activity the loop
// polls without blocking for up to `poll_for`, yielding the CPU between
// polls (Yield): what comes next (the reply to what it just passed on, a
// client's next request) is then served without the wake-up of a sleeping
// thread, tens of microseconds on a VM, while runnable threads still get
// the core. Past `poll_for` it sleeps in its poller until woken. A zero
// `poll_for` always sleeps. For the loop's own thread: not thread-safe.
//
//   PollThenSleep policy(options.spin_after_activity);
//   for (;;) {
//     const bool poll = policy.Polling(absl::GetCurrentTimeNanos());
//     int n = epoll_wait(epfd, events, max, poll ? 0 : timeout_ms);
//     if (n == 0 && poll) { PollThenSleep::Yield(); continue; }
//     ... on traffic: policy.Active(absl::GetCurrentTimeNanos());
//   }
class PollThenSleep {
 public:
  explicit PollThenSleep(absl::Duration poll_for)
      : poll_for_ns_(absl::ToInt64Nanoseconds(poll_for)) {}

  // Something happened at `now_ns` (absl::GetCurrentTimeNanos()).
  void Active(int64_t now_ns) { last_activity_ns_ = now_ns; }
  // Whether the loop is to poll without sleeping at `now_ns`.
  bool Polling(int64_t now_ns) const {
    return poll_for_ns_ > 0 && now_ns - last_activity_ns_ < poll_for_ns_;
  }
  // Whether it ever polls (a non-zero poll_for).
  bool enabled() const { return poll_for_ns_ > 0; }

  // Between two polls: lets runnable threads have the core.
  static void Yield() { sched_yield(); }

 private:
  const int64_t poll_for_ns_;
  int64_t last_activity_ns_ = 0;
};

}  // namespace cohort::base

#endif  // COHORT_BASE_NET_H_
