// Listener: cohortd's accepting socket, in front of the gRPC server.
//
// gRPC 1.51's own listener binds with SO_REUSEPORT, so a second cohortd can
// bind a running one's port and take half its clients, and after a single
// accept() failing with EMFILE it never accepts again. This one binds the
// port exclusively, caps the open connections, rides through running out of
// file descriptors, and hands every accepted socket to the gRPC server
// (grpc::AddInsecureChannelFromFd), which serves it as its own.
#ifndef COHORT_SERVER_LISTENER_H_
#define COHORT_SERVER_LISTENER_H_

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
#include "base/log_limiter.h"
#include "base/tcp_keepalive.h"
#include "grpcpp/server.h"

namespace cohort::server {

// Binds HOST:PORT (port 0: a free one; IPv4 first) with SO_REUSEADDR but
// never SO_REUSEPORT, and listens with the kernel's largest backlog
// (net.core.somaxconn). Returns the socket and sets *port to the port
// bound. UNAVAILABLE naming the address when another process holds it,
// INVALID_ARGUMENT when the address does not parse.
absl::StatusOr<int> ListenExclusive(const std::string& address, int* port);

// The kernel's cap on a listen backlog (net.core.somaxconn), at least 128.
int MaxBacklog();

// The connections all of cohortd's listeners (gRPC and TCPStore) may hold
// open together (--max_connections), so that together they stay within the
// process's file descriptors. Thread-safe.
class ConnectionBudget {
 public:
  explicit ConnectionBudget(size_t max) : max_(max) {}
  ConnectionBudget(const ConnectionBudget&) = delete;
  ConnectionBudget& operator=(const ConnectionBudget&) = delete;

  size_t max() const { return max_; }
  size_t in_use() const { return used_.load(std::memory_order_relaxed); }

  // Claims one connection. When all max() are in use it first has the
  // reclaimer count the connections closed since it last looked (at most
  // once per kReclaimEvery, since that checks every descriptor); false if
  // none is free then.
  bool TryTake();
  // Gives back `n` connections taken.
  void Give(size_t n = 1) { used_.fetch_sub(n, std::memory_order_relaxed); }

  // `reclaim` gives back the connections whose peers closed them behind the
  // listener's back (gRPC closes the sockets the Listener hands it). Null
  // clears it; it is never running once this returns.
  void SetReclaimer(std::function<void()> reclaim);

  static constexpr absl::Duration kReclaimEvery = absl::Milliseconds(20);

 private:
  bool TakeIfFree();

  const size_t max_;
  std::atomic<size_t> used_{0};
  absl::Mutex reclaim_mu_;
  std::function<void()> reclaim_ ABSL_GUARDED_BY(reclaim_mu_);
  absl::Time last_reclaim_ ABSL_GUARDED_BY(reclaim_mu_) = absl::InfinitePast();
};

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

#endif  // COHORT_SERVER_LISTENER_H_
