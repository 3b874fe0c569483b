#include "proto/rpc/tcp_keepalive.h"

#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "gtest/gtest.h"

namespace cohort::base {
namespace {

struct Settings {
  int keepalive = -1, idle = -1, interval = -1, probes = -1, user_timeout = -1;
};

Settings Read(int fd) {
  Settings s;
  auto get = [fd](int level, int name, int* out) {
    socklen_t len = sizeof(*out);
    EXPECT_EQ(getsockopt(fd, level, name, out, &len), 0);
  };
  get(SOL_SOCKET, SO_KEEPALIVE, &s.keepalive);
  get(IPPROTO_TCP, TCP_KEEPIDLE, &s.idle);
  get(IPPROTO_TCP, TCP_KEEPINTVL, &s.interval);
  get(IPPROTO_TCP, TCP_KEEPCNT, &s.probes);
  get(IPPROTO_TCP, TCP_USER_TIMEOUT, &s.user_timeout);
  return s;
}

// idle 60 s, timeout 20 s: probes every 5 s, 4 of them, and unacknowledged
// data given 80 s: a dead peer is dropped 80 s after its last sign of life.
void ExpectDefaults(const Settings& s) {
  EXPECT_EQ(s.keepalive, 1);
  EXPECT_EQ(s.idle, 60);
  EXPECT_EQ(s.interval, 5);
  EXPECT_EQ(s.probes, 4);
  EXPECT_EQ(s.user_timeout, 80000);
}

TEST(TcpKeepaliveTest, SetsTheKernelOptions) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(SetTcpKeepalive(fd, TcpKeepalive()).ok());
  ExpectDefaults(Read(fd));
  ASSERT_TRUE(
      SetTcpKeepalive(fd, {.idle = absl::ZeroDuration()}).ok());  // Off.
  EXPECT_EQ(Read(fd).keepalive, 0);
  close(fd);
}

// The port of the address `fd` is bound to (local) or connected to; -1 if
// none. (gRPC binds 127.0.0.1 as ::ffff:127.0.0.1 on a dual-stack socket.)
int Port(int fd, bool local) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  auto* sa = reinterpret_cast<sockaddr*>(&addr);
  if ((local ? getsockname(fd, sa, &len) : getpeername(fd, sa, &len)) != 0) {
    return -1;
  }
  if (addr.ss_family == AF_INET) {
    return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  }
  if (addr.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  }
  return -1;
}

// Both ends of a gRPC connection, a channel's and a server's own port's,
// carry the options: gRPC applies them through its socket mutator.
TEST(TcpKeepaliveTest, GrpcChannelsAndServersUseIt) {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                           &port);
  UseTcpKeepalive(TcpKeepalive(), &builder);
  grpc::CallbackGenericService nothing;  // A server needs some service.
  builder.RegisterCallbackGenericService(&nothing);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  grpc::ChannelArguments args;
  UseTcpKeepalive(TcpKeepalive(), &args);
  auto channel =
      grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                grpc::InsecureChannelCredentials(), args);
  ASSERT_TRUE(channel->WaitForConnected(
      absl::ToChronoTime(absl::Now() + absl::Seconds(30))));

  // The server accepts on its own threads: look until it has.
  int accepted = -1, dialed = -1;
  for (int attempt = 0; attempt < 3000 && (accepted < 0 || dialed < 0);
       ++attempt) {
    DIR* dir = opendir("/proc/self/fd");
    ASSERT_NE(dir, nullptr);
    while (dirent* e = readdir(dir)) {
      const int fd = std::atoi(e->d_name);
      if (fd <= 2) continue;
      if (Port(fd, true) == port && Port(fd, false) > 0) accepted = fd;
      if (Port(fd, false) == port) dialed = fd;
    }
    closedir(dir);
    if (accepted < 0 || dialed < 0) usleep(10000);
  }
  ASSERT_GE(accepted, 0);
  ASSERT_GE(dialed, 0);
  {
    SCOPED_TRACE("accepted by the server");
    ExpectDefaults(Read(accepted));
  }
  {
    SCOPED_TRACE("dialed by the channel");
    ExpectDefaults(Read(dialed));
  }
  server->Shutdown();
}

}  // namespace
}  // namespace cohort::base
