// Listener: cohortd's accepting socket, in front of the gRPC server.
//
// gRPC 1.51's own listener binds with SO_REUSEPORT, so a second cohortd can
// bind a running one's port and take half its clients, and after a single
// accept() failing with EMFILE it never accepts again. This one binds the
// port exclusively, caps the open connections, rides through running out of
// file descriptors, and hands every accepted socket to the gRPC server
// (grpc::AddInsecureChannelFromFd), which serves it as its own.
#ifndef COHORT_SERVER_RPC_LISTENER_H_
#define COHORT_SERVER_RPC_LISTENER_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/connection_budget.h"
#include "base/log_limiter.h"
#include "grpcpp/server.h"
#include "proto/rpc/tcp_keepalive.h"

namespace cohort::server {

using base::ConnectionBudget;

struct ListenerOptions {
  // Connections open at once; one more is answered with an HTTP/2 GOAWAY
  // saying so, and closed.
  size_t max_connections = 16384;
  // Shared with cohortd's other listeners, in place of max_connections.
  // Not owned; must outlive the Listener.
  ConnectionBudget* budget = nullptr;
  // Kernel TCP keepalive set on every accepted connection.
  base::TcpKeepalive keepalive;
  // Where refusals and fd exhaustion are reported (rate-limited).
  std::function<void(absl::string_view)> log;
};

class Listener {
 public:
  // Binds HOST:PORT (port 0: a free one) without SO_REUSEPORT. Fails with
  // UNAVAILABLE naming the address when another process holds it.
  static absl::StatusOr<std::unique_ptr<Listener>> Bind(
      const std::string& address, ListenerOptions options);

  // Stops if Stop was not called.
  ~Listener();

  int port() const { return port_; }

  // Starts accepting on a thread of its own; each connection is served by
  // `server`, which must outlive Stop().
  void Start(grpc::Server* server);

  // Closes the listening socket and joins the thread; connections already
  // handed over stay with the gRPC server. Idempotent.
  void Stop();

  // Connections handed to the gRPC server that are still open (checks each
  // one's descriptor: for a metrics scrape, not per call).
  size_t open_connections() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  Listener(int fd, int port, ListenerOptions options);
  void AcceptLoop();
  // Connections handed over that are still open (gRPC closes them itself;
  // a tracked fd whose inode changed was closed and reused). Gives the
  // closed ones back to the budget.
  size_t CountOpen() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Refuse(int fd, absl::string_view why);

  const int fd_;
  const int port_;
  const ListenerOptions options_;
  // options_.budget, or one of its own.
  std::unique_ptr<ConnectionBudget> own_budget_;
  ConnectionBudget* budget_;
  int wake_[2] = {-1, -1};
  int spare_fd_ = -1;
  std::thread thread_;
  grpc::Server* server_ = nullptr;
  // fd -> inode of the sockets handed to gRPC: the accept thread's, and
  // open_connections()'.
  absl::Mutex mu_;
  absl::flat_hash_map<int, uint64_t> open_ ABSL_GUARDED_BY(mu_);
  base::LogLimiter log_;  // The accept thread's.
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_RPC_LISTENER_H_
