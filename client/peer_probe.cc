#include "client/peer_probe.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "base/net.h"

namespace cohort {
namespace {

constexpr uint8_t kSettingsFrame = 0x4;
constexpr uint8_t kGoawayFrame = 0x7;
constexpr size_t kFrameHeaderBytes = 9;
// A GOAWAY's fixed part: the last stream id and the error code.
constexpr size_t kGoawayFixedBytes = 8;
// The most of a GOAWAY's debug text kept; a peer may announce 16 MiB.
constexpr size_t kMaxGoawayText = 1024;
// How many of an unknown peer's first bytes are kept to show.
constexpr size_t kShownBytes = 32;

uint32_t FrameLength(absl::string_view header) {
  return (static_cast<uint8_t>(header[0]) << 16) |
         (static_cast<uint8_t>(header[1]) << 8) |
         static_cast<uint8_t>(header[2]);
}

bool OnStreamZero(absl::string_view header) {
  return (static_cast<uint8_t>(header[5]) & 0x7f) == 0 && header[6] == 0 &&
         header[7] == 0 && header[8] == 0;
}

PeerAnswer Other(absl::string_view bytes) {
  return {PeerKind::kOther, std::string(bytes.substr(0, kShownBytes))};
}

// The GOAWAY starting at `frame` (a complete header is there), or false
// while its fixed part and text are still arriving.
bool ReadGoaway(absl::string_view frame, bool ended, PeerAnswer* answer) {
  const size_t length = FrameLength(frame);
  if (length < kGoawayFixedBytes) {
    *answer = Other(frame);
    return true;
  }
  const size_t wanted = kFrameHeaderBytes + kGoawayFixedBytes +
                        std::min(length - kGoawayFixedBytes, kMaxGoawayText);
  if (frame.size() < wanted && !ended) return false;
  const size_t text_at = kFrameHeaderBytes + kGoawayFixedBytes;
  absl::string_view text = frame.size() > text_at
                               ? frame.substr(text_at, wanted - text_at)
                               : absl::string_view();
  *answer = {PeerKind::kGoaway, std::string(text)};
  return true;
}

// One probe connection: what it sends, what came back.
struct Leg {
  int fd = -1;
  absl::string_view opening;
  std::string received;
  bool ended = false;
  bool decided = false;
  PeerAnswer answer;
};

// A non-blocking TCP connection to `a`, waiting for it until `deadline`;
// -1 with *why set when there is none.
int Connect(const base::SocketAddress& a, absl::Time deadline,
            PeerAnswer* why) {
  int fd = socket(a.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    *why = {PeerKind::kUnreachable, std::strerror(errno)};
    return -1;
  }
  if (connect(fd, a.get(), a.size) == 0) return fd;
  if (errno != EINPROGRESS) {
    *why = {PeerKind::kUnreachable, std::strerror(errno)};
    close(fd);
    return -1;
  }
  for (;;) {
    pollfd p = {fd, POLLOUT, 0};
    const int64_t ms =
        std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
    const int ready = poll(&p, 1, static_cast<int>(ms));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) {
      *why = {PeerKind::kConnectTimedOut, ""};
      close(fd);
      return -1;
    }
    int error = 0;
    socklen_t len = sizeof(error);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len);
    if (error == 0) return fd;
    *why = {PeerKind::kUnreachable, std::strerror(error)};
    close(fd);
    return -1;
  }
}

// Sends each leg its opening and reads until every leg is decided or
// `deadline` passes; a leg still undecided then heard nothing (kSilent) or
// an incomplete beginning (kOther).
void Exchange(std::array<Leg, 2>& legs, absl::Time deadline) {
  for (Leg& leg : legs) {
    if (leg.fd < 0) continue;
    // A few hundred bytes into a fresh socket's buffer: never short. A
    // failure here means the peer has already reset the connection.
    if (send(leg.fd, leg.opening.data(), leg.opening.size(), MSG_NOSIGNAL) <
        0) {
      leg.ended = true;
      leg.decided = ClassifyReply("", true, &leg.answer);
    }
  }
  for (;;) {
    pollfd fds[2];
    Leg* polled[2];
    nfds_t count = 0;
    for (Leg& leg : legs) {
      if (leg.fd >= 0 && !leg.decided) {
        fds[count] = {leg.fd, POLLIN, 0};
        polled[count++] = &leg;
      }
    }
    if (count == 0) break;
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) break;
    const int ready = poll(fds, count, static_cast<int>(ms));
    if (ready < 0 && errno != EINTR) break;
    for (nfds_t i = 0; ready > 0 && i < count; ++i) {
      if (fds[i].revents == 0) continue;
      Leg& leg = *polled[i];
      char buf[4096];
      const ssize_t got = recv(leg.fd, buf, sizeof(buf), 0);
      if (got > 0) {
        leg.received.append(buf, got);
      } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
        leg.ended = true;  // FIN, or a reset (ECONNRESET).
      }
      leg.decided = ClassifyReply(leg.received, leg.ended, &leg.answer);
    }
  }
  for (Leg& leg : legs) {
    if (leg.fd < 0 || leg.decided) continue;
    leg.answer = leg.received.empty() ? PeerAnswer{PeerKind::kSilent, ""}
                                      : Other(leg.received);
  }
}

// One verdict from what the peer did with the HTTP/2 preface and with the
// ClientHello. A GOAWAY is cohortd (or another HTTP/2 server) refusing
// whatever was sent; a TLS record on either proves TLS; what an insecure
// client would see decides the rest.
PeerAnswer Combine(const Leg& http2, const Leg& tls) {
  const PeerAnswer& h = http2.answer;
  const bool tls_connected = tls.fd >= 0;
  if (h.kind == PeerKind::kGoaway) return h;
  if (tls_connected && tls.answer.kind == PeerKind::kGoaway) return tls.answer;
  if (h.kind == PeerKind::kHttp2 || h.kind == PeerKind::kTls) return h;
  if (tls_connected && (tls.answer.kind == PeerKind::kTls ||
                        tls.answer.kind == PeerKind::kHttp2)) {
    return tls.answer;
  }
  if (h.kind == PeerKind::kOther) return h;
  if (tls_connected && tls.answer.kind == PeerKind::kOther) return tls.answer;
  // Closed or silent: a single silent leg means connections can hang.
  if (tls_connected && tls.answer.kind == PeerKind::kSilent) return tls.answer;
  return h;
}

}  // namespace

bool ClassifyReply(absl::string_view bytes, bool ended, PeerAnswer* answer) {
  if (bytes.empty()) {
    if (!ended) return false;
    *answer = {PeerKind::kClosed, ""};
    return true;
  }
  // A TLS record: content type alert (21) or handshake (22), version 3.x.
  // As an HTTP/2 frame header either would announce a frame over 1 MiB,
  // far beyond the 16 KiB a server's first SETTINGS may be.
  const uint8_t first = static_cast<uint8_t>(bytes[0]);
  if (first == 0x15 || first == 0x16) {
    if (bytes.size() < 2) {
      if (!ended) return false;
      *answer = Other(bytes);
      return true;
    }
    *answer = bytes[1] == 0x03 ? PeerAnswer{PeerKind::kTls, ""} : Other(bytes);
    return true;
  }
  if (bytes.size() < kFrameHeaderBytes) {
    if (!ended) return false;
    *answer = Other(bytes);
    return true;
  }
  if (!OnStreamZero(bytes)) {
    *answer = Other(bytes);
    return true;
  }
  const uint8_t type = static_cast<uint8_t>(bytes[3]);
  if (type == kGoawayFrame) return ReadGoaway(bytes, ended, answer);
  if (type != kSettingsFrame || FrameLength(bytes) % 6 != 0) {
    *answer = Other(bytes);
    return true;
  }
  // A server preface. A GOAWAY right behind it, already here, is the
  // server's real answer.
  size_t at = kFrameHeaderBytes + FrameLength(bytes);
  while (at + kFrameHeaderBytes <= bytes.size()) {
    absl::string_view frame = bytes.substr(at);
    if (static_cast<uint8_t>(frame[3]) == kGoawayFrame && OnStreamZero(frame) &&
        ReadGoaway(frame, /*ended=*/true, answer)) {
      return true;
    }
    at += kFrameHeaderBytes + FrameLength(frame);
  }
  *answer = {PeerKind::kHttp2, ""};
  return true;
}

absl::string_view Http2ClientPreface() {
  static constexpr char kPreface[] =
      "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
      "\0\0\0\x04\0\0\0\0\0";  // An empty SETTINGS frame.
  return absl::string_view(kPreface, sizeof(kPreface) - 1);
}

const std::string& TlsClientHello() {
  static const std::string* hello = [] {
    auto u16 = [](std::string& out, size_t v) {
      out.push_back(static_cast<char>((v >> 8) & 0xff));
      out.push_back(static_cast<char>(v & 0xff));
    };
    auto vec16 = [&u16](std::string& out, const std::string& body) {
      u16(out, body.size());
      out += body;
    };
    std::string ciphers;
    // TLS 1.3's suites, then ECDHE with AES-GCM or ChaCha20 for TLS 1.2.
    for (int suite : {0x1301, 0x1302, 0x1303, 0xc02b, 0xc02f, 0xc02c, 0xc030,
                      0xcca9, 0xcca8}) {
      u16(ciphers, suite);
    }
    std::string groups;  // x25519, P-256.
    u16(groups, 0x001d);
    u16(groups, 0x0017);
    std::string algorithms;  // ECDSA and RSA(-PSS) over SHA-256 and -384.
    for (int a : {0x0403, 0x0804, 0x0401, 0x0503, 0x0805, 0x0501}) {
      u16(algorithms, a);
    }
    std::string extensions;
    u16(extensions, 0x000a);  // supported_groups
    std::string list;
    vec16(list, groups);
    vec16(extensions, list);
    u16(extensions, 0x000b);  // ec_point_formats: uncompressed
    vec16(extensions, std::string("\x01\x00", 2));
    u16(extensions, 0x000d);  // signature_algorithms
    list.clear();
    vec16(list, algorithms);
    vec16(extensions, list);

    std::string body("\x03\x03", 2);  // TLS 1.2, as 1.3 hellos say too.
    body.append(32, '\0');            // Random: nothing to keep secret.
    body.push_back('\0');             // No session id.
    vec16(body, ciphers);
    body.append("\x01\x00", 2);  // Compression: none.
    vec16(body, extensions);

    std::string handshake(1, '\x01');  // ClientHello
    handshake.push_back(static_cast<char>((body.size() >> 16) & 0xff));
    u16(handshake, body.size());
    handshake += body;
    auto* record = new std::string("\x16\x03\x01", 3);
    vec16(*record, handshake);
    return record;
  }();
  return *hello;
}

PeerAnswer ProbePeer(const std::string& address, absl::Duration wait) {
  absl::StatusOr<base::HostPort> where = base::SplitHostPort(address);
  if (!where.ok()) return {PeerKind::kUnreachable, "not HOST:PORT"};
  absl::StatusOr<std::vector<base::SocketAddress>> found =
      base::Resolve(*where);
  if (!found.ok()) {
    return {PeerKind::kUnreachable, std::string(found.status().message())};
  }
  PeerAnswer answer = {PeerKind::kUnreachable, "the name has no address"};
  for (const base::SocketAddress& a : *found) {
    std::array<Leg, 2> legs;
    legs[0].opening = Http2ClientPreface();
    legs[1].opening = TlsClientHello();
    const absl::Time deadline = absl::Now() + wait;
    legs[0].fd = Connect(a, deadline, &answer);
    if (legs[0].fd < 0) continue;
    // Without the second connection the first alone decides.
    PeerAnswer ignored;
    legs[1].fd = Connect(a, deadline, &ignored);
    Exchange(legs, absl::Now() + wait);
    answer = Combine(legs[0], legs[1]);
    for (Leg& leg : legs) {
      if (leg.fd >= 0) close(leg.fd);
    }
    break;
  }
  return answer;
}

}  // namespace cohort
