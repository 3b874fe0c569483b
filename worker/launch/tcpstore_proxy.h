// TcpStoreProxy: a node-local splice between PyTorch's TCPStore clients and
// cohortd's TCPStore listener that binds every connection to a namespace.
//
// cohortrun runs one per node and points its workers at it
// (MASTER_ADDR=127.0.0.1, MASTER_PORT=port()). For each connection it
// accepts, the proxy opens one connection to cohortd, sends the namespace
// hello (proto/tcpstore/wire.h) and then copies bytes both ways without
// looking at them; cohortd puts the namespace in front of every key. So
// the jobs sharing a cohortd never see each other's keys although torch
// names them alike, no worker hosts a store, and the proxy holds no
// protocol logic. When either side closes, the proxy passes on what the
// closing side had sent and closes the other.
//
// One thread runs an epoll loop for every connection; nothing blocks it.
// Bytes wait in the proxy only while the receiving side cannot take them,
// and the proxy then stops reading the sending side, so a connection holds
// at most one read (64 KiB) per direction and an idle one holds none.
//
//   auto proxy = TcpStoreProxy::Start({.upstream = "cohortd:29400",
//                                      .name_space = "/cohortrun/job/0/"});
//   setenv("MASTER_PORT", absl::StrCat((*proxy)->port()).c_str(), 1);
#ifndef COHORT_WORKER_LAUNCH_TCPSTORE_PROXY_H_
#define COHORT_WORKER_LAUNCH_TCPSTORE_PROXY_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace cohort {

struct TcpStoreProxyOptions {
  // HOST:PORT to accept workers' connections on; port 0 picks a free one
  // (see port()). Loopback by default: the workers are on this node.
  std::string listen = "127.0.0.1:0";
  // HOST:PORT of cohortd's TCPStore listener (its --tcpstore_listen),
  // resolved once when the proxy starts; each of its addresses is tried
  // in turn.
  std::string upstream;
  // Sent in the hello of every connection until SetNamespace changes it.
  // Must pass tcpstore::CheckNamespace.
  std::string name_space;
  // Sent in every hello when not empty: the token cohortd checks against
  // the namespace when it runs with auth (wire.h's token hello).
  std::string token;
  // How long a connection waits for cohortd to accept it, retrying with
  // backoff (cohortd restarting, say), before the proxy gives up and
  // closes the worker's connection. Bytes the worker sends meanwhile wait
  // in its socket.
  absl::Duration connect_timeout = absl::Seconds(30);
  // How long the loop thread keeps polling, instead of sleeping, after it
  // moved bytes (yielding the CPU between polls): a worker's request and
  // cohortd's reply then each cross the proxy without a thread wake-up.
  // 0: always sleep.
  absl::Duration spin_after_activity = absl::Microseconds(50);
  // Where failures to reach cohortd are reported, at most one line a
  // second. Null: nowhere.
  std::function<void(absl::string_view)> log;
};

struct TcpStoreProxyStats {
  size_t open = 0;          // Connections now open (or connecting).
  uint64_t accepted = 0;    // Since start.
  uint64_t refused = 0;     // Closed because cohortd could not be reached.
  uint64_t bytes_up = 0;    // Copied to cohortd, hellos included.
  uint64_t bytes_down = 0;  // Copied to the workers.
};

class TcpStoreProxy {
 public:
  // Listens on options.listen (base::ListenExclusive) and starts the loop
  // thread. INVALID_ARGUMENT for a bad namespace or address, or a listen
  // host that does not resolve; UNAVAILABLE when the upstream host does
  // not resolve or the listen address cannot be bound.
  static absl::StatusOr<std::unique_ptr<TcpStoreProxy>> Start(
      TcpStoreProxyOptions options);

  // Stops if Stop was not called.
  ~TcpStoreProxy();
  TcpStoreProxy(const TcpStoreProxy&) = delete;
  TcpStoreProxy& operator=(const TcpStoreProxy&) = delete;

  int port() const { return port_; }

  // Connections accepted from now on are bound to `name_space`; open ones
  // keep theirs. INVALID_ARGUMENT (and no change) if CheckNamespace refuses
  // it. Thread-safe.
  absl::Status SetNamespace(absl::string_view name_space);

  // Closes the listening socket and every connection, then joins the loop
  // thread. Idempotent.
  void Stop();

  TcpStoreProxyStats stats() const;

 private:
  class Loop;
  TcpStoreProxy() = default;

  std::unique_ptr<Loop> loop_;
  int port_ = 0;
};

}  // namespace cohort

#endif  // COHORT_WORKER_LAUNCH_TCPSTORE_PROXY_H_
