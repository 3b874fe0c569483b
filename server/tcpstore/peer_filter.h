// PeerFilter: the networks a TCPStore listener serves
// (TcpStoreServerOptions::allow, cohortd's --tcpstore_allow). The protocol
// carries no credentials, so this and the listener's prefix are its access
// control for plain torch clients.
#ifndef COHORT_SERVER_TCPSTORE_PEER_FILTER_H_
#define COHORT_SERVER_TCPSTORE_PEER_FILTER_H_

#include <sys/socket.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace cohort::server {

class PeerFilter {
 public:
  // Every peer.
  PeerFilter() = default;

  // The peers in any of `allow`'s networks: "A.B.C.D[/N]" or "X:Y::Z[/N]",
  // a bare address being one host ("10.0.0.0/8", "127.0.0.1", "fd00::/8").
  // Empty: every peer. INVALID_ARGUMENT naming the first entry that is not
  // a network.
  static absl::StatusOr<PeerFilter> Parse(absl::Span<const std::string> allow);

  // Whether every peer is allowed (no networks were given).
  bool allows_all() const { return networks_.empty(); }

  // Whether the peer at `address` (as getpeername gives it) may connect.
  // An IPv4-mapped IPv6 address (a dual-stack listener's IPv4 peer) counts
  // as its IPv4 address; other families are refused unless allows_all().
  bool Allows(const sockaddr_storage& address) const;

 private:
  // An address family, its address bytes and a prefix length.
  struct Network {
    int family = AF_INET;
    unsigned char bytes[16] = {};
    int bits = 0;

    bool Contains(int peer_family, const unsigned char* peer) const;
  };

  static absl::StatusOr<Network> ParseNetwork(absl::string_view text);

  std::vector<Network> networks_;
};

}  // namespace cohort::server

#endif  // COHORT_SERVER_TCPSTORE_PEER_FILTER_H_
