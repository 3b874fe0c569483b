#include "server/tcpstore/peer_filter.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace cohort::server {

bool PeerFilter::Network::Contains(int peer_family,
                                   const unsigned char* peer) const {
  if (peer_family != family) return false;
  const int whole = bits / 8;
  if (std::memcmp(bytes, peer, whole) != 0) return false;
  const int rest = bits % 8;
  if (rest == 0) return true;
  const unsigned char mask = static_cast<unsigned char>(0xff << (8 - rest));
  return (bytes[whole] & mask) == (peer[whole] & mask);
}

absl::StatusOr<PeerFilter::Network> PeerFilter::ParseNetwork(
    absl::string_view text) {
  Network n;
  const size_t slash = text.find('/');
  const std::string address(text.substr(0, slash));
  const int max_bits = address.find(':') == std::string::npos ? 32 : 128;
  n.family = max_bits == 32 ? AF_INET : AF_INET6;
  n.bits = max_bits;
  if (inet_pton(n.family, address.c_str(), n.bytes) != 1 ||
      (slash != absl::string_view::npos &&
       (!absl::SimpleAtoi(text.substr(slash + 1), &n.bits) || n.bits < 0 ||
        n.bits > max_bits))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TCPStore allow list: '", text,
        "' is not a network: use ADDRESS or ADDRESS/BITS, as 10.0.0.0/8, "
        "127.0.0.1 or fd00::/8"));
  }
  return n;
}

absl::StatusOr<PeerFilter> PeerFilter::Parse(
    absl::Span<const std::string> allow) {
  PeerFilter filter;
  for (const std::string& text : allow) {
    absl::StatusOr<Network> n = ParseNetwork(text);
    if (!n.ok()) return n.status();
    filter.networks_.push_back(*n);
  }
  return filter;
}

bool PeerFilter::Allows(const sockaddr_storage& address) const {
  if (networks_.empty()) return true;
  int family = AF_INET;
  const unsigned char* bytes = nullptr;
  if (address.ss_family == AF_INET) {
    bytes = reinterpret_cast<const unsigned char*>(
        &reinterpret_cast<const sockaddr_in*>(&address)->sin_addr);
  } else if (address.ss_family == AF_INET6) {
    const auto* a6 = reinterpret_cast<const sockaddr_in6*>(&address);
    if (IN6_IS_ADDR_V4MAPPED(&a6->sin6_addr)) {
      bytes = a6->sin6_addr.s6_addr + 12;
    } else {
      family = AF_INET6;
      bytes = a6->sin6_addr.s6_addr;
    }
  } else {
    return false;
  }
  for (const Network& n : networks_) {
    if (n.Contains(family, bytes)) return true;
  }
  return false;
}

}  // namespace cohort::server
