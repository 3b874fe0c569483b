#include "base/net.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace cohort::base {
namespace {

// The host and port SplitHostPort gives, as "host|port", or its error.
std::string Split(absl::string_view address, const HostPortRules& rules = {}) {
  absl::StatusOr<HostPort> split = SplitHostPort(address, rules);
  if (!split.ok()) {
    EXPECT_EQ(split.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(split.status().message(),
              absl::StrCat("\"", address, "\" is not HOST:PORT: ",
                           HostPortProblem(address, rules)));
    return std::string(split.status().message());
  }
  EXPECT_EQ(HostPortProblem(address, rules), "");
  return absl::StrCat(split->host, "|", split->port);
}

TEST(SplitHostPortTest, SplitsAtTheLastColon) {
  EXPECT_EQ(Split("localhost:29500"), "localhost|29500");
  EXPECT_EQ(Split("10.0.0.1:65535"), "10.0.0.1|65535");
  EXPECT_EQ(Split("[::1]:80"), "::1|80");
  EXPECT_EQ(Split("fd00::1:29400"), "fd00::1|29400");
  EXPECT_EQ(Split("host:00080"), "host|80");
}

TEST(SplitHostPortTest, SaysWhyAnAddressIsRefused) {
  EXPECT_EQ(Split("localhost"),
            "\"localhost\" is not HOST:PORT: it has no port");
  EXPECT_EQ(Split("[::1]"), "\"[::1]\" is not HOST:PORT: it has no port");
  for (const char* bad : {"host:0", "host:65536", "host:+80", "host: 80",
                          "host:http", "host:", "host:000080"}) {
    EXPECT_EQ(Split(bad), absl::StrCat("\"", bad,
                                       "\" is not HOST:PORT: the port must be "
                                       "a number from 1 to 65535"));
  }
  EXPECT_EQ(Split(":29500"), "\":29500\" is not HOST:PORT: it has no host");
  EXPECT_EQ(Split("[]:29500"), "\"[]:29500\" is not HOST:PORT: it has no host");
}

TEST(SplitHostPortTest, EscapesTheAddress) {
  EXPECT_EQ(SplitHostPort("a\"b\n").status().message(),
            "\"a\\\"b\\n\" is not HOST:PORT: it has no port");
}

TEST(SplitHostPortTest, ListenAddressRules) {
  const HostPortRules listen = {.allow_empty_host = true,
                                .allow_port_zero = true};
  EXPECT_EQ(Split(":29500", listen), "|29500");
  EXPECT_EQ(Split("[]:0", listen), "|0");
  EXPECT_EQ(Split("127.0.0.1:0", listen), "127.0.0.1|0");
  EXPECT_EQ(Split("127.0.0.1:65536", listen),
            "\"127.0.0.1:65536\" is not HOST:PORT: the port must be a number "
            "from 0 to 65535");
}

TEST(SplitHostPortTest, BareIpv6CanBeRefused) {
  const HostPortRules brackets = {.allow_bare_ipv6 = false};
  EXPECT_EQ(Split("fd00::1:29400", brackets),
            "\"fd00::1:29400\" is not HOST:PORT: write an IPv6 address in "
            "brackets, as [fd00::1]:29400");
  EXPECT_EQ(Split("[fd00::1]:29400", brackets), "fd00::1|29400");
  EXPECT_EQ(Split("cohortd:29400", brackets), "cohortd|29400");
}

TEST(JoinHostPortTest, BracketsIpv6) {
  EXPECT_EQ(JoinHostPort("cohortd", 29400), "cohortd:29400");
  EXPECT_EQ(JoinHostPort("::1", 80), "[::1]:80");
  EXPECT_EQ(JoinHostPort("", 80), ":80");
  const absl::StatusOr<HostPort> split = SplitHostPort("[fd00::1]:1");
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(JoinHostPort(split->host, split->port), "[fd00::1]:1");
}

TEST(IsWildcardHostTest, EveryInterface) {
  for (const char* host : {"", "0.0.0.0", "::", "[::]"}) {
    EXPECT_TRUE(IsWildcardHost(host)) << host;
  }
  for (const char* host : {"127.0.0.1", "::1", "localhost"}) {
    EXPECT_FALSE(IsWildcardHost(host)) << host;
  }
}

TEST(ResolveTest, NumericAddresses) {
  absl::StatusOr<std::vector<SocketAddress>> v4 = Resolve({"127.0.0.1", 80});
  ASSERT_TRUE(v4.ok()) << v4.status();
  ASSERT_EQ(v4->size(), 1u);
  EXPECT_EQ((*v4)[0].family(), AF_INET);
  EXPECT_EQ((*v4)[0].port(), 80);
  absl::StatusOr<std::vector<SocketAddress>> v6 = Resolve({"::1", 65535});
  ASSERT_TRUE(v6.ok()) << v6.status();
  ASSERT_EQ(v6->size(), 1u);
  EXPECT_EQ((*v6)[0].family(), AF_INET6);
  EXPECT_EQ((*v6)[0].port(), 65535);
}

TEST(ResolveTest, PassiveEmptyHostIsEveryInterfaceIpv4First) {
  absl::StatusOr<std::vector<SocketAddress>> any =
      Resolve({"", 0}, {.passive = true, .ipv4_first = true});
  ASSERT_TRUE(any.ok()) << any.status();
  ASSERT_FALSE(any->empty());
  bool seen_v6 = false;
  for (const SocketAddress& a : *any) {
    if (a.family() == AF_INET6) seen_v6 = true;
    if (a.family() == AF_INET) {
      EXPECT_FALSE(seen_v6) << "an IPv4 address after an IPv6 one";
      EXPECT_EQ(reinterpret_cast<const sockaddr_in*>(a.get())->sin_addr.s_addr,
                htonl(INADDR_ANY));
    }
  }
}

TEST(ResolveTest, AnUnknownHostIsUnavailableWithTheReasonAlone) {
  absl::StatusOr<std::vector<SocketAddress>> none =
      Resolve({"no-such-host.invalid", 80});
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(none.status().message().empty());
  EXPECT_EQ(none.status().message().find("no-such-host"),
            absl::string_view::npos)
      << none.status();
}

TEST(ListenExclusiveTest, BindsAFreePortExclusively) {
  absl::StatusOr<ListeningSocket> first = ListenExclusive("127.0.0.1:0");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_GT(first->port, 0);
  int reuse_port = -1;
  socklen_t len = sizeof(reuse_port);
  ASSERT_EQ(getsockopt(first->fd, SOL_SOCKET, SO_REUSEPORT, &reuse_port, &len),
            0);
  EXPECT_EQ(reuse_port, 0);
  EXPECT_NE(fcntl(first->fd, F_GETFD) & FD_CLOEXEC, 0);
  EXPECT_EQ(fcntl(first->fd, F_GETFL) & O_NONBLOCK, 0);

  const std::string taken = absl::StrCat("127.0.0.1:", first->port);
  absl::StatusOr<ListeningSocket> second = ListenExclusive(taken);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(
      second.status().message(),
      absl::StrCat("cannot listen on ", taken, ": Address already in use"));
  second = ListenExclusive(taken, {.when_in_use = "another process serves it"});
  EXPECT_EQ(second.status().message(),
            absl::StrCat("cannot listen on ", taken,
                         ": Address already in use (another process serves "
                         "it)"));
  close(first->fd);
}

TEST(ListenExclusiveTest, Nonblocking) {
  absl::StatusOr<ListeningSocket> s =
      ListenExclusive("127.0.0.1:0", {.nonblocking = true});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_NE(fcntl(s->fd, F_GETFL) & O_NONBLOCK, 0);
  close(s->fd);
}

TEST(ListenExclusiveTest, RefusesWhatIsNotAListenAddress) {
  absl::StatusOr<ListeningSocket> s = ListenExclusive("nope");
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.status().message(),
            "listen address 'nope' is not HOST:PORT: it has no port");
  s = ListenExclusive("127.0.0.1:70000");
  EXPECT_EQ(s.status().message(),
            "listen address '127.0.0.1:70000' is not HOST:PORT: the port must "
            "be a number from 0 to 65535");
  s = ListenExclusive("no-such-host.invalid:0");
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(
      s.status().message(),
      "cannot resolve listen address 'no-such-host.invalid:0': "))
      << s.status();
}

TEST(MaxBacklogTest, AtLeast128) { EXPECT_GE(MaxBacklog(), 128); }

TEST(PollTimeoutMillisTest, RoundsUpAndCaps) {
  EXPECT_EQ(PollTimeoutMillis(absl::InfinitePast()), 0);
  EXPECT_EQ(PollTimeoutMillis(absl::Now() - absl::Seconds(1)), 0);
  EXPECT_EQ(PollTimeoutMillis(absl::InfiniteFuture()), -1);
  EXPECT_EQ(PollTimeoutMillis(absl::Now() + absl::Hours(1000)), 1 << 30);
  const int hour = PollTimeoutMillis(absl::Now() + absl::Hours(1));
  EXPECT_GT(hour, 3599000);
  EXPECT_LE(hour, 3600000);
}

TEST(PollThenSleepTest, PollsForAWhileAfterActivity) {
  PollThenSleep policy(absl::Microseconds(50));
  EXPECT_TRUE(policy.enabled());
  const int64_t t = 1000000000;
  EXPECT_FALSE(policy.Polling(t)) << "no activity yet";
  policy.Active(t);
  EXPECT_TRUE(policy.Polling(t));
  EXPECT_TRUE(policy.Polling(t + 49999));
  EXPECT_FALSE(policy.Polling(t + 50000));
  policy.Active(t + 50000);
  EXPECT_TRUE(policy.Polling(t + 50000));
}

TEST(PollThenSleepTest, ZeroAlwaysSleeps) {
  PollThenSleep policy(absl::ZeroDuration());
  EXPECT_FALSE(policy.enabled());
  policy.Active(5);
  EXPECT_FALSE(policy.Polling(5));
}

}  // namespace
}  // namespace cohort::base
