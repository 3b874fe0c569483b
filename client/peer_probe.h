// ProbePeer: what answers at HOST:PORT when a gRPC channel cannot connect
// there, told from the first bytes the peer sends back on two fresh TCP
// connections: one that opens HTTP/2 in plaintext (as an insecure gRPC
// client does) and one that opens a TLS handshake. A plaintext gRPC server
// answers the first with SETTINGS; a TLS server closes the first without a
// byte and answers the second with a TLS record; cohortd over
// --max_connections answers both with an HTTP/2 GOAWAY saying so; cohortd
// out of file descriptors closes both unanswered, or (gRPC's own listener)
// leaves them in the kernel's backlog, never accepted, so they stay silent.
#ifndef COHORT_CLIENT_PEER_PROBE_H_
#define COHORT_CLIENT_PEER_PROBE_H_

#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace cohort {

enum class PeerKind {
  // No TCP connection: refused, unroutable, or the name does not resolve.
  kUnreachable,
  // The TCP connect itself got no answer within the wait: a firewall that
  // drops it, a host that is down, or a listener whose backlog is full
  // because it stopped accepting.
  kConnectTimedOut,
  // Answers an HTTP/2 preface with SETTINGS: a plaintext HTTP/2 server.
  kHttp2,
  // Answers with an HTTP/2 GOAWAY before anything else: it turns the
  // connection away, and its debug text says why.
  kGoaway,
  // Answers a TLS ClientHello (or the HTTP/2 preface) with a TLS record.
  kTls,
  // Accepts the TCP connection but sends nothing within the wait.
  kSilent,
  // Accepts the TCP connection and closes it (FIN or reset) before
  // sending a byte, on both probes.
  kClosed,
  // Answers with bytes that are neither HTTP/2 nor TLS.
  kOther,
};

struct PeerAnswer {
  PeerKind kind = PeerKind::kUnreachable;
  // kGoaway: the GOAWAY's debug text. kOther: the first bytes received.
  // kUnreachable: why the connection failed (strerror). Peer-controlled for the
  // first two: escape before printing.
  std::string detail;
};

// Decides what a peer is from the bytes it sent so far on one probe
// connection, `ended` when it has closed or reset that connection. Returns
// true and sets *answer (never to kUnreachable, kConnectTimedOut or
// kSilent, which only the socket can tell) once the bytes decide, which they
// always do when `ended`; false while they cannot yet (nothing received, or
// an incomplete frame or record). Free of I/O, so each rule is tested from
// byte strings.
bool ClassifyReply(absl::string_view bytes, bool ended, PeerAnswer* answer);

// The HTTP/2 client connection preface followed by an empty SETTINGS frame,
// what an insecure gRPC client sends first.
absl::string_view Http2ClientPreface();

// A TLS 1.2/1.3 ClientHello any TLS server answers, if only with an alert.
const std::string& TlsClientHello();

// Probes `address` (HOST:PORT, IPv6 hosts in brackets; each resolved
// address in turn until one accepts TCP): opens both probe connections,
// sends each its opening, and waits up to `wait` for the peer's answers
// (returning as soon as they decide). Blocks for at most about twice
// `wait` (the TCP connects are bounded by it too).
PeerAnswer ProbePeer(const std::string& address, absl::Duration wait);

}  // namespace cohort

#endif  // COHORT_CLIENT_PEER_PROBE_H_
