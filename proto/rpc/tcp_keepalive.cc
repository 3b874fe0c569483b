#include "proto/rpc/tcp_keepalive.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "grpc/grpc.h"
#include "grpc/support/sync.h"

// gRPC's socket mutator (src/core/lib/iomgr/socket_mutator.h), which its
// installed headers declare but do not define. These mirror gRPC 1.51's
// (Debian's libgrpc29): a mutator starts with its vtable and refcount, and
// gRPC calls mutate_fd_2 for every socket it makes or accepts (mutate_fd
// is never called for accepted connections).
enum grpc_fd_usage {
  GRPC_FD_CLIENT_CONNECTION_USAGE,
  GRPC_FD_SERVER_LISTENER_USAGE,
  GRPC_FD_SERVER_CONNECTION_USAGE,
};
struct grpc_mutate_socket_info {
  int fd;
  grpc_fd_usage usage;
};
struct grpc_socket_mutator_vtable {
  bool (*mutate_fd)(int fd, grpc_socket_mutator* mutator);
  int (*compare)(grpc_socket_mutator* a, grpc_socket_mutator* b);
  void (*destroy)(grpc_socket_mutator* mutator);
  bool (*mutate_fd_2)(const grpc_mutate_socket_info* info,
                      grpc_socket_mutator* mutator);
};
struct grpc_socket_mutator {
  const grpc_socket_mutator_vtable* vtable;
  gpr_refcount refcount;
};
void grpc_socket_mutator_init(grpc_socket_mutator* mutator,
                              const grpc_socket_mutator_vtable* vtable);

namespace cohort::base {
namespace {

int Seconds(absl::Duration d) {
  return static_cast<int>(
      std::clamp<int64_t>(absl::ToInt64Seconds(d), 1, INT_MAX / 1000));
}

struct KeepaliveMutator {
  grpc_socket_mutator base;  // First: gRPC sees a pointer to it.
  TcpKeepalive keepalive;
};

KeepaliveMutator* Cast(grpc_socket_mutator* mutator) {
  return reinterpret_cast<KeepaliveMutator*>(mutator);
}

bool MutateFd(int fd, grpc_socket_mutator* mutator) {
  // Not every socket gRPC makes is TCP (unix: addresses): leave those be.
  int type = 0;
  socklen_t len = sizeof(type);
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 ||
      type != SOCK_STREAM) {
    return true;
  }
  sockaddr_storage addr;
  len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0 ||
      (addr.ss_family != AF_INET && addr.ss_family != AF_INET6)) {
    return true;
  }
  return SetTcpKeepalive(fd, Cast(mutator)->keepalive).ok();
}

const grpc_socket_mutator_vtable kVtable = {
    .mutate_fd = MutateFd,
    .compare =
        [](grpc_socket_mutator* a, grpc_socket_mutator* b) {
          const TcpKeepalive &x = Cast(a)->keepalive, &y = Cast(b)->keepalive;
          if (x.idle != y.idle) return x.idle < y.idle ? -1 : 1;
          if (x.timeout != y.timeout) return x.timeout < y.timeout ? -1 : 1;
          return 0;
        },
    .destroy = [](grpc_socket_mutator* m) { delete Cast(m); },
    .mutate_fd_2 = [](const grpc_mutate_socket_info* info,
                      grpc_socket_mutator* m) { return MutateFd(info->fd, m); },
};

grpc_socket_mutator* NewMutator(const TcpKeepalive& keepalive) {
  auto* mutator = new KeepaliveMutator{{}, keepalive};
  grpc_socket_mutator_init(&mutator->base, &kVtable);
  return &mutator->base;
}

class KeepaliveOption final : public grpc::ServerBuilderOption {
 public:
  explicit KeepaliveOption(const TcpKeepalive& keepalive)
      : keepalive_(keepalive) {}
  void UpdateArguments(grpc::ChannelArguments* args) override {
    UseTcpKeepalive(keepalive_, args);
  }
  void UpdatePlugins(
      std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>*) override {}

 private:
  const TcpKeepalive keepalive_;
};

}  // namespace

absl::Status SetTcpKeepalive(int fd, const TcpKeepalive& keepalive) {
  const bool on = keepalive.idle > absl::ZeroDuration();
  const int interval = Seconds(keepalive.timeout / 4);
  const int probes = std::max(1, Seconds(keepalive.timeout) / interval);
  // Past idle + timeout without an ACK, a connection is dropped whether it
  // was probed (idle) or had data in flight (retransmitting).
  const int64_t user_timeout_ms = std::min<int64_t>(
      INT_MAX, absl::ToInt64Milliseconds(keepalive.idle + keepalive.timeout));
  struct Option {
    int level, name, value;
    const char* what;
  };
  const Option options[] = {
      {SOL_SOCKET, SO_KEEPALIVE, on ? 1 : 0, "SO_KEEPALIVE"},
      {IPPROTO_TCP, TCP_KEEPIDLE, Seconds(keepalive.idle), "TCP_KEEPIDLE"},
      {IPPROTO_TCP, TCP_KEEPINTVL, interval, "TCP_KEEPINTVL"},
      {IPPROTO_TCP, TCP_KEEPCNT, probes, "TCP_KEEPCNT"},
      {IPPROTO_TCP, TCP_USER_TIMEOUT, static_cast<int>(user_timeout_ms),
       "TCP_USER_TIMEOUT"},
  };
  for (const Option& o : options) {
    if (!on && o.name != SO_KEEPALIVE) break;
    if (setsockopt(fd, o.level, o.name, &o.value, sizeof(o.value)) != 0) {
      return absl::InternalError(absl::StrCat(
          "setsockopt(", o.what, ", ", o.value, "): ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

void UseTcpKeepalive(const TcpKeepalive& keepalive,
                     grpc::ChannelArguments* args) {
  args->SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, INT_MAX);
  if (keepalive.idle > absl::ZeroDuration()) {
    args->SetSocketMutator(NewMutator(keepalive));
  }
}

void UseTcpKeepalive(const TcpKeepalive& keepalive,
                     grpc::ServerBuilder* builder) {
  builder->SetOption(std::make_unique<KeepaliveOption>(keepalive));
}

}  // namespace cohort::base
