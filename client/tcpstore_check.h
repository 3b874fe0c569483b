// CheckTcpStoreListener: whether HOST:PORT is a TCPStore listener serving
// the same keys as the cohortd a gRPC Store reaches. cohortrun runs it
// before it points its workers' torch stores there, so that a wrong
// address fails at start-up, saying why, rather than as torch's
// "Connection reset by peer" in every worker.
//
// The check writes a random key through the gRPC store, opens a TCPStore
// connection as cohortrun's node proxy does (namespace hello, with the
// token when there is one), handshakes as PyTorch 2.1+ does (VALIDATE,
// PING) and WAITs for the key under the namespace; then it deletes the
// key. A listener of the same cohortd (or of a replica over the same etcd)
// answers the WAIT; another cohortd's answers the PING and never the WAIT.
// Each TCP connect attempt, and then the answers together, are bounded by
// one timeout: the check ends within seconds whatever is at the address.
//
//   auto same = CheckTcpStoreListener(remote_store,
//       {.address = "cohortd:29400", .name_space = "/cohortrun/job/"});
//   if (!same.ok()) ... same.status().message() says why, not where.
#ifndef COHORT_CLIENT_TCPSTORE_CHECK_H_
#define COHORT_CLIENT_TCPSTORE_CHECK_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/store.h"

namespace cohort {

struct TcpStoreCheckOptions {
  // HOST:PORT of the listener (IPv6 in brackets); each address the host
  // resolves to is tried in turn until one accepts.
  std::string address;
  // The hello's namespace (tcpstore::CheckNamespace) and token ("": none).
  std::string name_space;
  std::string token;
  // The listener's --tcpstore_prefix (ServerInfo.tcpstore.prefix): in the
  // store its keys live under prefix + namespace.
  std::string listener_prefix;
  // Bounds each TCP connect attempt, and then the answers together.
  absl::Duration timeout = absl::Seconds(5);
};

struct TcpStoreCheckResult {
  // Whether the listener was seen serving the key written through the gRPC
  // store. False when that key could not be written (a token that may not
  // write under the listener's prefix): only that the listener answers
  // the protocol was checked then, and `unverified` says why.
  bool same_store = false;
  std::string unverified;
};

// Runs the check. Errors say why in words for a person (the caller names
// the address and where it came from):
//   INVALID_ARGUMENT     a malformed address or namespace;
//   UNAVAILABLE          the host does not resolve, or the connection is
//                        refused or unreachable;
//   DEADLINE_EXCEEDED    no answer to the TCP connect, or to the PING;
//   FAILED_PRECONDITION  the peer closed the connection at the hello, or
//                        answered with something other than TCPStore;
//   NOT_FOUND            it answers TCPStore but does not serve the key:
//                        another cohortd's listener (or another store);
//   otherwise            writing the key through `store` failed.
absl::StatusOr<TcpStoreCheckResult> CheckTcpStoreListener(
    Store& store, const TcpStoreCheckOptions& options);

// The socket part: connects and asks for `key` (within the namespace) as
// above; an empty `key` asks for none, so only the handshake is checked.
// Errors as CheckTcpStoreListener's.
absl::Status ProbeTcpStoreListener(const TcpStoreCheckOptions& options,
                                   absl::string_view key);

// What the probe sends, all at once: the namespace hello, VALIDATE,
// PING(`nonce`) and, unless `key` is empty, WAIT([key]).
std::string CheckOpening(const TcpStoreCheckOptions& options,
                         absl::string_view key, uint32_t nonce);

// What the bytes a listener sent back in reply to CheckOpening say.
enum class CheckReply {
  kIncomplete,   // Not decided yet: wait for more (or for the deadline).
  kAnswered,     // The PING reply, and the WAIT's when a key was asked for.
  kPingOnly,     // The PING reply alone, the connection still open.
  kClosedEarly,  // Closed (or reset) before a byte arrived.
  kClosedLater,  // Closed after the PING reply, before the WAIT's.
  kWrongBytes,   // Something other than the replies CheckOpening asks for.
};
// `ended` when the peer has closed the connection. Free of I/O, so every
// rule is tested from byte strings.
CheckReply ClassifyCheckReply(absl::string_view bytes, bool ended,
                              uint32_t nonce, bool asked_key);

}  // namespace cohort

#endif  // COHORT_CLIENT_TCPSTORE_CHECK_H_
