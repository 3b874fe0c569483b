// PeerFilter from the --tcpstore_allow texts to the addresses getpeername
// gives: which networks parse, and which peers each lets in.
#include "server/tcpstore/peer_filter.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/un.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace cohort::server {
namespace {

sockaddr_storage V4(const char* address) {
  sockaddr_storage s = {};
  auto* a = reinterpret_cast<sockaddr_in*>(&s);
  a->sin_family = AF_INET;
  a->sin_port = htons(29400);
  EXPECT_EQ(inet_pton(AF_INET, address, &a->sin_addr), 1) << address;
  return s;
}

sockaddr_storage V6(const char* address) {
  sockaddr_storage s = {};
  auto* a = reinterpret_cast<sockaddr_in6*>(&s);
  a->sin6_family = AF_INET6;
  a->sin6_port = htons(29400);
  EXPECT_EQ(inet_pton(AF_INET6, address, &a->sin6_addr), 1) << address;
  return s;
}

PeerFilter Filter(std::vector<std::string> allow) {
  absl::StatusOr<PeerFilter> f = PeerFilter::Parse(allow);
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? *f : PeerFilter();
}

TEST(PeerFilterTest, NoNetworksAllowsEveryPeer) {
  PeerFilter all = Filter({});
  EXPECT_TRUE(all.allows_all());
  EXPECT_TRUE(all.Allows(V4("203.0.113.9")));
  EXPECT_TRUE(all.Allows(V6("2001:db8::1")));
  EXPECT_TRUE(PeerFilter().allows_all());
}

TEST(PeerFilterTest, IPv4NetworksMatchTheirPrefixBits) {
  PeerFilter f = Filter({"10.0.0.0/8", "192.168.1.7", "172.16.0.0/12"});
  EXPECT_FALSE(f.allows_all());
  EXPECT_TRUE(f.Allows(V4("10.255.1.2")));
  EXPECT_FALSE(f.Allows(V4("11.0.0.1")));
  EXPECT_TRUE(f.Allows(V4("192.168.1.7")));  // A bare address: one host.
  EXPECT_FALSE(f.Allows(V4("192.168.1.8")));
  // /12 cuts a byte: 172.16.0.0 to 172.31.255.255.
  EXPECT_TRUE(f.Allows(V4("172.16.0.1")));
  EXPECT_TRUE(f.Allows(V4("172.31.255.255")));
  EXPECT_FALSE(f.Allows(V4("172.32.0.0")));
  EXPECT_FALSE(f.Allows(V4("172.15.255.255")));
  EXPECT_FALSE(f.Allows(V6("2001:db8::1")));
}

TEST(PeerFilterTest, IPv6NetworksAndIPv4MappedPeers) {
  PeerFilter f = Filter({"fd00::/8", "127.0.0.0/8"});
  EXPECT_TRUE(f.Allows(V6("fd12:3456::1")));
  EXPECT_FALSE(f.Allows(V6("fe80::1")));
  // A dual-stack listener's IPv4 peer is IPv4 to the filter.
  EXPECT_TRUE(f.Allows(V6("::ffff:127.0.0.1")));
  EXPECT_FALSE(f.Allows(V6("::ffff:10.0.0.1")));
  EXPECT_TRUE(Filter({"::/0"}).Allows(V6("2001:db8::1")));
  EXPECT_TRUE(Filter({"0.0.0.0/0"}).Allows(V4("203.0.113.9")));
  EXPECT_FALSE(Filter({"::/0"}).Allows(V4("203.0.113.9")));
}

TEST(PeerFilterTest, OtherAddressFamiliesAreRefused) {
  sockaddr_storage unix_peer = {};
  unix_peer.ss_family = AF_UNIX;
  EXPECT_FALSE(Filter({"0.0.0.0/0", "::/0"}).Allows(unix_peer));
}

TEST(PeerFilterTest, WhatIsNotANetworkIsRefusedByName) {
  for (const char* bad : {"10.0.0.0/33", "nonsense", "10.0.0/8", "::1/129",
                          "10.0.0.0/", "10.0.0.0/-1", "10.0.0.0/8x", ""}) {
    absl::StatusOr<PeerFilter> f = PeerFilter::Parse({std::string("::1"), bad});
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(
        absl::StrContains(f.status().message(), std::string("'") + bad + "'"))
        << f.status();
  }
}

}  // namespace
}  // namespace cohort::server
