// TcpStoreServer: cohortd's listener for PyTorch's TCPStore wire protocol,
// so an unmodified torch job (TCPStore(host, port, is_master=False), or
// torchrun --rdzv_backend=c10d) uses cohortd as its store.
//
// It serves the same KvStore as the gRPC services: a key set by a torch
// client is what cohortctl sees, and the reverse. Each connection speaks the
// dialect its first bytes announce (proto/tcpstore/wire.h). Requests are
// applied in order and a reply is sent only after the request's change is
// in the store's write-ahead log; requests without a reply (SET, APPEND,
// MULTI_SET) are applied before anything after them is answered.
//
// What the bytes mean is session.h's (TcpStoreSession, without I/O); this
// is the event loop that moves them. One libuv event loop thread serves
// every connection. A blocked WAIT, BARRIER or queue pop holds no thread:
// it is an entry in the store's wait index, completed by whichever write
// (by either protocol) satisfies it.
// Bad input (an unknown query type, a length over the limits, an HTTP
// request from a port scanner) closes that connection alone, with a
// rate-limited log line naming the peer and the reason; so does a write to
// cohortd's reserved namespace (keys under "/cohort/", c10d::CheckClientWrite),
// which the protocol has no error reply for.
//
// Replies wait in memory until the client reads them. A client that does
// not read stops being read from once max_unsent_bytes are queued for it;
// and once all connections together hold max_unsent_bytes_total, only
// connections with nothing queued are served (one request at a time), and
// those that hold replies the kernel would not take are closed, the
// largest first, until the total is back under the bound. So clients that
// never read cost at most that bound, and clients that read their replies
// are served as before.
//
// Quotas (server/auth/quota.h): each connection is charged to an owner (its
// token's tenant, or the connection itself without a token): one
// connection, a parked WAIT or BARRIER and its keys, the bytes it pushes to
// queues (given back when popped through this listener; items kept over a
// restart, or pushed through another replica, are charged to nobody). A
// request over a quota closes its connection, with a log line naming the
// quota and its flag.
//
// A connection may open with cohort's namespace hello (proto/tcpstore/
// wire.h), as cohortrun's node proxy does for its workers. Every key of
// that connection is then the namespace followed by the key it sent, in
// every query (queues and barriers included); LIST_KEYS returns only the
// namespace's keys, without the namespace, and GETNUMKEYS counts only
// them. So jobs that share cohortd, all of whose torch clients name keys
// alike ("/worker/attempt_0/..."), never see each other's. The namespace
// counts towards the store's key limit. A bad hello closes the connection
// like other bad input.
//
// Queues (QUEUE_PUSH/POP/LEN, PyTorch 2.4+) are the KvStore's
// (KvStore::QueuePush): each item is an entry under "/cohort/queues/"
// (store/queue_keys.h), so queues are as durable as other keys in every
// engine, and readable through gRPC there. A push is committed like a SET,
// before anything after it is answered; a pop like any write, before its
// reply. As on torch's own server: QUEUE_LEN of a queue that never held
// items is 0; CHECK and WAIT count a key whose queue holds items as
// present, and a push ends one WAIT only (torch's blocking queue_pop is a
// WAIT, then a QUEUE_POP), the oldest; GETNUMKEYS and LIST_KEYS leave
// queues out. A client woken by a push that does not go on to pop (its
// connection closes, or it cancels the wait as the push arrives) passes
// the wake-up on to the next waiter, so the item does not sit unclaimed
// while others wait; a QUEUE_POP is not applied at all if its connection
// closes before the commit.
#ifndef COHORT_SERVER_TCPSTORE_TCPSTORE_SERVER_H_
#define COHORT_SERVER_TCPSTORE_TCPSTORE_SERVER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/connection_budget.h"
#include "proto/tcpstore/wire.h"
#include "server/tcpstore/session.h"
#include "store/kv_store.h"

namespace cohort::server {

using base::ConnectionBudget;

// TcpStoreOutcome and TcpStoreGrant are session.h's: the protocol's.

struct TcpStoreServerOptions {
  // HOST:PORT; port 0 picks a free one (see port()). 29400 is what
  // torchrun's c10d rendezvous dials by default.
  std::string listen = "0.0.0.0:29400";
  // Connections open at once; one more is closed as soon as it is accepted.
  size_t max_connections = 16384;
  // Shared with cohortd's other listeners, in place of max_connections.
  // Not owned; must outlive the server.
  ConnectionBudget* budget = nullptr;
  // The most bytes one request may take (a big MULTI_SET, say); keys,
  // values and keys per request are bounded by the store's own limits.
  size_t max_request_bytes = 64 << 20;
  // Replies queued for a connection past which cohortd stops reading its
  // requests until it reads its replies.
  size_t max_unsent_bytes = 4 << 20;
  // Replies queued for all connections together past which the slow
  // readers are paused and closed (see above).
  size_t max_unsent_bytes_total = 256 << 20;
  // Bytes in all queues together (QUEUE_PUSH) past which a push closes its
  // connection, as the store counts them (items kept over a restart, or
  // pushed through another replica, included); each owner's share is
  // bounded by its quota.
  size_t max_queue_bytes_total = 1 << 30;
  // Per-owner quotas. Not owned; null: none.
  Quotas* quotas = nullptr;
  // How long the loop thread keeps polling, instead of sleeping, after a
  // request arrives (yielding the CPU between polls). 0: always sleep.
  absl::Duration spin_after_activity = absl::Microseconds(50);
  // Peer networks allowed to connect ("10.0.0.0/8", "127.0.0.1",
  // "fd00::/8"): a connection from anywhere else is closed as soon as it is
  // accepted, and counted and logged. Empty: every peer. The protocol
  // carries no credentials, so this and `prefix` are its access control.
  std::vector<std::string> allow;
  // Every connection's keys live under this prefix (a namespace hello's
  // namespace comes after it): such a listener can reach nothing else of
  // the store. Empty: the whole store. Must not be in cohortd's reserved
  // namespace.
  std::string prefix;
  // Checks the token of a token hello (proto/tcpstore/wire.h) against the
  // namespace it binds (after `prefix`): what it grants, or why the
  // connection is closed. Null: token hellos are refused.
  std::function<absl::StatusOr<TcpStoreGrant>(absl::string_view token,
                                              absl::string_view name_space)>
      authorize;
  // Serve only connections that open with a token hello that `authorize`
  // accepts (cohortd sets it when auth is on). Plain torch clients are
  // then closed at their first byte: they reach such a listener only
  // through cohortrun's node proxy, which sends its workers' token.
  bool require_token = false;
  // Where refused connections and bad input are reported: at most one
  // line per log_every, with a count of the lines left out.
  std::function<void(absl::string_view)> log;
  absl::Duration log_every = absl::Seconds(1);
  // Called once per request (metrics): when it is answered, applied,
  // refused or given up, with its query, outcome and the time since it was
  // read. Runs on the loop thread that serves every connection, so it must
  // be quick and must not block. Null: not called.
  std::function<void(tcpstore::Op, TcpStoreOutcome, absl::Duration)> on_query;
};

struct TcpStoreServerStats {
  size_t connections = 0;  // Open now.
  size_t blocked = 0;      // Connections waiting in WAIT or BARRIER.
  uint64_t accepted = 0;   // Since start.
  uint64_t closed_bad_input = 0;
  uint64_t refused_not_allowed = 0;      // Peers outside `allow`.
  uint64_t refused_unauthenticated = 0;  // No token, or one refused.
  uint64_t requests = 0;
  size_t unsent_bytes = 0;           // Replies queued for all connections now.
  size_t peak_unsent_bytes = 0;      // The most unsent_bytes has been.
  size_t queue_bytes = 0;            // In the store's queues now.
  uint64_t closed_slow_readers = 0;  // Closed to keep unsent_bytes bounded.
  uint64_t refused_quota = 0;        // Connections closed over a quota.
  uint64_t refused_no_budget = 0;    // Closed at accept: max_connections.
};

class TcpStoreServer {
 public:
  // Binds `options.listen` exclusively and starts the loop thread. `store`
  // must outlive the server. UNAVAILABLE naming the address if it is taken;
  // INVALID_ARGUMENT naming a bad `allow` entry or `prefix`.
  static absl::StatusOr<std::unique_ptr<TcpStoreServer>> Start(
      store::KvStore* store, TcpStoreServerOptions options);

  // Stops if Stop was not called.
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const { return port_; }

  // Closes the listening socket and every connection, then joins the loop
  // thread. Idempotent.
  void Stop();

  // A snapshot taken on the loop thread.
  TcpStoreServerStats stats();

 private:
  class Loop;
  TcpStoreServer() = default;

  std::unique_ptr<Loop> loop_;
  int port_ = 0;
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_TCPSTORE_TCPSTORE_SERVER_H_
