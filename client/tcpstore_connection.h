// TcpStoreConnection: one TCP connection to a TCPStore server, as
// TcpStoreClient (tcpstore_client.h) uses it: requests are queued and sent
// in one write, replies are read with deadlines. Once broken (lost, timed
// out, or out of step with the protocol) it is never used again: the
// client opens another. Not thread-safe: the client's lock serialises it.
#ifndef COHORT_CLIENT_TCPSTORE_CONNECTION_H_
#define COHORT_CLIENT_TCPSTORE_CONNECTION_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "proto/tcpstore/wire.h"

namespace cohort {

// How TcpStoreClient runs a call on its connection (as RemoteStore's
// CallOptions, connection.h).
struct TcpStoreCallOptions {
  // Whether the call is repeated on a fresh connection after it lost the
  // one it ran on: only for calls safe to repeat, whose second run cannot
  // change what the first did. Otherwise a lost connection fails the call
  // with UNAVAILABLE saying the change may or may not have been applied.
  bool retry_lost_connection = false;

  static TcpStoreCallOptions Retryable() { return {true}; }
  static TcpStoreCallOptions Once() { return {false}; }
};

class TcpStoreConnection {
 public:
  // Connects to `address` (HOST:PORT, or several comma-separated, each in
  // turn) before `deadline`, with TCP_NODELAY. UNAVAILABLE saying why no
  // address accepted. `reply_timeout` bounds every Flush and reply read
  // below.
  static absl::StatusOr<std::unique_ptr<TcpStoreConnection>> Open(
      const std::string& address, absl::Time deadline,
      absl::Duration reply_timeout);

  ~TcpStoreConnection();
  TcpStoreConnection(const TcpStoreConnection&) = delete;
  TcpStoreConnection& operator=(const TcpStoreConnection&) = delete;

  // The dialect requests are encoded in; kTorch21 until set.
  tcpstore::Dialect dialect() const { return dialect_; }
  void set_dialect(tcpstore::Dialect dialect) { dialect_ = dialect; }
  bool broken() const { return broken_; }

  // Encode a request into the unsent bytes.
  void Queue(const tcpstore::Request& request);
  void Queue(tcpstore::Op op, absl::string_view key = {});
  void QueueKeys(tcpstore::Op op, const std::vector<std::string>& keys);

  // Sends what is queued, within reply_timeout; UNAVAILABLE (broken) if it
  // cannot.
  absl::Status Flush();

  // Reads `n` bytes into `out`. DEADLINE_EXCEEDED at `deadline`, leaving
  // the connection usable; UNAVAILABLE (broken) if it closed.
  absl::Status Read(size_t n, absl::Time deadline, std::string* out);

  // A little-endian word of `bytes` bytes. Without a `deadline` it is the
  // reply to a query that does not block, and one that takes longer than
  // reply_timeout breaks the connection (UNAVAILABLE). A `deadline` given
  // instead is the caller's to handle (a wait's): DEADLINE_EXCEEDED.
  absl::StatusOr<uint64_t> Word(size_t bytes,
                                absl::Time deadline = absl::InfiniteFuture());
  // A reply's signed 8-byte number.
  absl::StatusOr<int64_t> I64();
  // A reply's length-prefixed string; a length over 1 GiB is a protocol
  // violation (INTERNAL).
  absl::StatusOr<std::string> Bytes();

  // Makes the server confirm everything sent before: queues a cheap query
  // (PING with a random nonce, GETNUMKEYS in 1.13), flushes, and reads its
  // reply. SET, MULTI_SET and APPEND have no reply, and replies come in
  // order, so OK means the server processed them.
  absl::Status Sync();

  // Breaks the connection: the server said something the protocol does
  // not allow here. INTERNAL naming the server, the dialect and `what`.
  absl::Status Violation(absl::string_view what);
  // Breaks the connection without an error of the server's.
  void Drop() { broken_ = true; }

  // Whether the server closed the connection (or sent something unasked)
  // while it was idle, as a restarted server's old connections are: then
  // a call reconnects first instead of sending into it.
  bool Stale();

 private:
  TcpStoreConnection(int fd, std::string address, absl::Duration reply_timeout);

  // Breaks the connection: UNAVAILABLE naming the server and `why`.
  absl::Status Lost(absl::string_view why);

  const int fd_;
  const std::string address_;
  const absl::Duration reply_timeout_;
  tcpstore::Dialect dialect_ = tcpstore::Dialect::kTorch21;
  bool broken_ = false;
  std::string out_;  // Queued, not yet sent.
  std::string in_;   // Received, read up to in_pos_.
  size_t in_pos_ = 0;
};

}  // namespace cohort

#endif  // COHORT_CLIENT_TCPSTORE_CONNECTION_H_
