// Kernel TCP keepalive for gRPC connections: how cohortd and its clients
// tell a dead peer from a busy one.
//
// gRPC's own keepalive (GRPC_ARG_KEEPALIVE_TIME_MS) sends HTTP/2 PINGs that
// the peer's gRPC threads must answer: a process too busy to run them (one
// driving 100,000 calls, a cohortd whose cores are taken, a process stopped
// in a debugger) misses the deadline and every call on the connection is
// cut, although nothing is wrong with it. Kernel keepalive probes and the
// ACKs of sent data are answered by the peer's kernel, however starved its
// process: they fail only when the peer's host is gone, its network is cut
// or its packets are dropped. A process that died is seen sooner still: its
// kernel closes the connection.
#ifndef COHORT_PROTO_RPC_TCP_KEEPALIVE_H_
#define COHORT_PROTO_RPC_TCP_KEEPALIVE_H_

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"

namespace cohort::base {

struct TcpKeepalive {
  // A connection that received nothing for `idle` is probed; a peer that
  // then answers nothing for `timeout` (probes every timeout / 4), or that
  // leaves sent data unacknowledged for idle + timeout (TCP_USER_TIMEOUT),
  // is dropped. So a dead peer is detected within idle + timeout of its
  // last sign of life. The one live peer dropped is one whose receive
  // window stays shut that long with data waiting for it (it read nothing
  // while megabytes were sent to it); parked calls, whose replies are
  // small, never reach that. Zero idle: no keepalive.
  absl::Duration idle = absl::Minutes(1);
  absl::Duration timeout = absl::Seconds(20);
};

// Sets SO_KEEPALIVE, TCP_KEEPIDLE, TCP_KEEPINTVL, TCP_KEEPCNT and
// TCP_USER_TIMEOUT on the TCP socket `fd` for `keepalive`; an error names
// the option the kernel refused.
absl::Status SetTcpKeepalive(int fd, const TcpKeepalive& keepalive);

// Makes every TCP connection of a channel built with `args` use
// `keepalive` (gRPC's socket mutator), and turns gRPC's HTTP/2 keepalive
// pings off on it.
void UseTcpKeepalive(const TcpKeepalive& keepalive,
                     grpc::ChannelArguments* args);

// The same for every connection a server accepts on the ports `builder`
// listens on itself (AddListeningPort).
void UseTcpKeepalive(const TcpKeepalive& keepalive,
                     grpc::ServerBuilder* builder);

}  // namespace cohort::base

#endif  // COHORT_PROTO_RPC_TCP_KEEPALIVE_H_
