// TcpStoreClient: cohort::Store over PyTorch's TCPStore wire protocol
// (proto/tcpstore/wire.h), so cohort code can use a plain PyTorch TCPStore
// server, or cohortd's TCPStore listener (--tcpstore_listen), as its store.
//
// One TCP connection per client object, one operation at a time on it (a
// mutex serialises callers, as torch's client does). The protocol has no
// request ids and no error replies: a torch server answers a request it
// cannot serve by closing the connection. So:
//   - Calls that are safe to repeat (Set, Get, Wait, Check, DeleteKey,
//     NumKeys, MultiGet, MultiSet, ListKeys) reconnect and retry when the
//     connection is lost, until connect_timeout has passed since the loss;
//     a cohortd restart (even kill -9) is ridden through. If the server
//     closes three fresh connections in a row in reply to the same request,
//     it refuses that request: the call fails with FAILED_PRECONDITION.
//   - Add, Append and CompareSet are not repeated: a lost connection gives
//     UNAVAILABLE saying the change may or may not have been applied.
//   - SET, MULTI_SET and APPEND have no reply on the wire; a cheap query
//     sent behind them in the same write (PING, or GETNUMKEYS in 1.13) is
//     read before the call returns. Replies are in order, so an OK Set has
//     been processed by the server (on cohortd: it is in the write-ahead
//     log, since cohortd answers only after that).
//   - A reply that breaks the protocol (an unknown reply byte, a PING nonce
//     that does not match) drops the connection and gives INTERNAL.
#ifndef COHORT_CLIENT_TCPSTORE_CLIENT_H_
#define COHORT_CLIENT_TCPSTORE_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "client/store.h"
#include "client/tcpstore_connection.h"
#include "proto/tcpstore/wire.h"

namespace cohort {

// Which release's TCPStore protocol to speak (see proto/tcpstore/wire.h).
enum class TcpStoreDialect {
  // PyTorch 2.1 and later, and cohortd's listener: VALIDATE + PING on
  // connect; native MULTI_GET, MULTI_SET, APPEND, LIST_KEYS, CANCEL_WAIT.
  kTorch21,
  // PyTorch 1.13 and 2.0 (Debian's python3-torch): no handshake. MultiGet,
  // MultiSet and Append are built from single-key queries; ListKeys is
  // UNIMPLEMENTED; a timed-out wait closes the connection (1.13 cannot
  // cancel one) and the next call reconnects.
  kTorch113,
  // Decide on the first connection. A 2.1 VALIDATE would reach a 1.13
  // server as a SET with an absurd key length, so the probe speaks 1.13:
  // it sends GETNUMKEYS (byte 6) and waits probe_timeout. An 8-byte reply
  // means 1.13 (kept for every later reconnection). EOF, a reset or
  // silence means 2.1+ (such servers close, or ignore, a connection whose
  // first query is not VALIDATE): reconnect and handshake as 2.1. cohortd
  // speaks both and answers the probe, so it is spoken to as 1.13; give
  // kTorch21 to use its native multi-key queries and LIST_KEYS.
  kProbe,
};

struct TcpStoreClientOptions {
  // HOST:PORT of the server: an IPv4 address, [IPv6] or a host name; or
  // several, comma-separated (cohortd replicas), tried in turn at each
  // (re)connection.
  std::string address;
  TcpStoreDialect dialect = TcpStoreDialect::kTorch21;
  // How long to keep trying to (re)connect, with exponential backoff and
  // jitter, before a call gives up with UNAVAILABLE. Also bounds how long
  // an idempotent call keeps retrying after it lost its connection.
  absl::Duration connect_timeout = absl::Seconds(60);
  // Prepended to every key sent; stripped from ListKeys' results. torch's
  // client prefixes user keys with "/", so "/" shares their namespace:
  // Set("k", v) here is store.get("k") in Python.
  std::string key_prefix;
  // How long a call that does not block waits for its reply before it
  // counts the connection as lost.
  absl::Duration reply_timeout = absl::Seconds(30);
  // kProbe: how long the probe waits for a 1.13 reply.
  absl::Duration probe_timeout = absl::Seconds(1);
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(2);
};

class TcpStoreClient final : public Store {
 public:
  // Connects (retrying until connect_timeout) and handshakes as
  // options.dialect says. INVALID_ARGUMENT for a malformed address or
  // option; UNAVAILABLE naming the address and the last error when no
  // server answered in time; INTERNAL if one answered the handshake wrong.
  static absl::StatusOr<std::unique_ptr<TcpStoreClient>> Connect(
      const TcpStoreClientOptions& options);
  ~TcpStoreClient() override;

  const TcpStoreClientOptions& options() const { return options_; }
  // The dialect in use (kProbe resolved).
  tcpstore::Dialect dialect() const;

  // Returns once the server has processed the write (see above).
  absl::Status Set(absl::string_view key, absl::string_view value) override;
  // WAIT then GET, as torch's client: blocks until the key exists or
  // `timeout` passes (DEADLINE_EXCEEDED naming the key).
  using Store::Get;
  absl::StatusOr<std::string> Get(absl::string_view key,
                                  absl::Duration timeout) override;
  // The new value. Not retried (UNAVAILABLE if the connection is lost).
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;
  // c10d's compare_set rules (store.h). Not retried.
  absl::StatusOr<std::string> CompareSet(absl::string_view key,
                                         absl::string_view expected,
                                         absl::string_view desired) override;
  // Blocks until every key exists, or DEADLINE_EXCEEDED: "wait for keys
  // [a, b] timed out after 2s; missing: b" (2.1 cancels the wait with
  // CANCEL_WAIT and checks each key; 1.13 closes the connection instead and
  // cannot tell which keys were missing).
  using Store::Wait;
  absl::Status Wait(absl::Span<const std::string> keys,
                    absl::Duration timeout) override;
  absl::StatusOr<bool> Check(absl::Span<const std::string> keys) override;
  // Whether the key existed. Retried after a lost connection, so a delete
  // whose first attempt was applied may report false.
  absl::StatusOr<bool> DeleteKey(absl::string_view key) override;
  // Every key on the server, whatever its prefix (torch's internal "init/"
  // included, when the server is torch's).
  absl::StatusOr<int64_t> NumKeys() override;
  // Waits for all keys, then reads them (MULTI_GET in 2.1, pipelined GETs
  // in 1.13, so not at one revision there).
  using Store::MultiGet;
  absl::StatusOr<std::vector<std::string>> MultiGet(
      absl::Span<const std::string> keys, absl::Duration timeout) override;
  // MULTI_SET in 2.1; pipelined SETs in 1.13 (not atomic there).
  absl::Status MultiSet(absl::Span<const std::string> keys,
                        absl::Span<const std::string> values) override;
  // APPEND in 2.1. In 1.13 a loop of COMPARE_SETs (as c10d's default
  // append), which cannot tell its own write from a concurrent writer's
  // that left exactly the same bytes. Not retried.
  absl::Status Append(absl::string_view key, absl::string_view value) override;
  // 2.1: LIST_KEYS (every key on the server), keeping those under
  // key_prefix + prefix, key_prefix stripped, sorted; revision is 0 (the
  // protocol has none). 1.13: UNIMPLEMENTED.
  absl::StatusOr<KeyList> ListKeys(absl::string_view prefix) override;
  // UNIMPLEMENTED: the TCPStore protocol has no watch.
  absl::StatusOr<std::unique_ptr<WatchHandle>> Watch(
      absl::string_view prefix, int64_t from_revision,
      WatchCallback callback) override;

 private:
  using Conn = TcpStoreConnection;
  template <typename T>
  using Attempt = absl::FunctionRef<absl::StatusOr<T>(Conn&)>;

  explicit TcpStoreClient(const TcpStoreClientOptions& options);

  // Connects and handshakes, retrying with backoff until `deadline`.
  absl::Status Dial(absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs `attempt` on a connection, (re)connecting first if needed, and
  // retries it after a lost connection when call.retry_lost_connection
  // (see above).
  template <typename T>
  absl::StatusOr<T> Run(absl::string_view what, const TcpStoreCallOptions& call,
                        Attempt<T> attempt) ABSL_LOCKS_EXCLUDED(mu_);
  // Run for calls that return only a status.
  absl::Status RunStatus(absl::string_view what,
                         const TcpStoreCallOptions& call,
                         absl::FunctionRef<absl::Status(Conn&)> attempt)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The blocking part of Wait/Get/MultiGet on `conn`: OK once every key
  // exists, DEADLINE_EXCEEDED at `deadline`.
  // `what` starts the timeout's message ("wait", "get: wait").
  absl::Status WaitOn(Conn& conn, const std::vector<std::string>& keys,
                      absl::Span<const std::string> user_keys,
                      absl::Duration timeout, absl::Time deadline,
                      absl::string_view what) const;
  std::string Key(absl::string_view key) const {
    return options_.key_prefix + std::string(key);
  }
  std::vector<std::string> Keys(absl::Span<const std::string> keys) const;

  const TcpStoreClientOptions options_;
  mutable absl::Mutex mu_;
  tcpstore::Dialect dialect_ ABSL_GUARDED_BY(mu_) = tcpstore::Dialect::kTorch21;
  bool resolved_ ABSL_GUARDED_BY(mu_) = false;       // dialect_ is decided.
  std::unique_ptr<Conn> conn_ ABSL_GUARDED_BY(mu_);  // Null: reconnect.
};

}  // namespace cohort

#endif  // COHORT_CLIENT_TCPSTORE_CLIENT_H_
