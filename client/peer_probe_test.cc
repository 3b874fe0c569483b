#include "client/peer_probe.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace cohort {
namespace {

// An HTTP/2 frame on stream 0.
std::string Frame(uint8_t type, const std::string& payload) {
  std::string out;
  out.push_back(static_cast<char>((payload.size() >> 16) & 0xff));
  out.push_back(static_cast<char>((payload.size() >> 8) & 0xff));
  out.push_back(static_cast<char>(payload.size() & 0xff));
  out.push_back(static_cast<char>(type));
  out.push_back('\0');
  out.append(4, '\0');
  return out + payload;
}

// What cohortd's listener sends a connection over --max_connections.
std::string Goaway(const std::string& text) {
  std::string payload(4, '\0');             // Last stream id.
  payload += std::string("\0\0\0\x07", 4);  // REFUSED_STREAM.
  return Frame(0x7, payload + text);
}

// A server preface as gRPC sends it: SETTINGS with four settings.
std::string Settings() { return Frame(0x4, std::string(24, '\x01')); }

constexpr char kRefusal[] =
    "cohortd: too many connections (1 open, --max_connections); retry later";

PeerAnswer Classified(absl::string_view bytes, bool ended) {
  PeerAnswer answer;
  answer.detail = "untouched";
  EXPECT_TRUE(ClassifyReply(bytes, ended, &answer))
      << "undecided: " << absl::CHexEscape(bytes);
  return answer;
}

TEST(ClassifyReplyTest, NothingYetIsUndecidedAndNothingEverIsAClose) {
  PeerAnswer answer;
  EXPECT_FALSE(ClassifyReply("", /*ended=*/false, &answer));
  EXPECT_EQ(Classified("", /*ended=*/true).kind, PeerKind::kClosed);
}

TEST(ClassifyReplyTest, ServerSettingsIsPlaintextHttp2) {
  const std::string settings = Settings();
  EXPECT_EQ(Classified(settings, false).kind, PeerKind::kHttp2);
  // The header alone decides; the settings may still be arriving.
  EXPECT_EQ(Classified(settings.substr(0, 9), false).kind, PeerKind::kHttp2);
  PeerAnswer answer;
  EXPECT_FALSE(ClassifyReply(settings.substr(0, 8), false, &answer));
}

TEST(ClassifyReplyTest, GoawayIsDecidedOnlyWithItsWholeText) {
  const std::string goaway = Goaway(kRefusal);
  for (size_t n = 1; n < goaway.size(); ++n) {
    PeerAnswer answer;
    EXPECT_FALSE(ClassifyReply(goaway.substr(0, n), false, &answer)) << n;
  }
  const PeerAnswer answer = Classified(goaway, false);
  EXPECT_EQ(answer.kind, PeerKind::kGoaway);
  EXPECT_EQ(answer.detail, kRefusal);
}

TEST(ClassifyReplyTest, GoawayCutShortByACloseKeepsWhatArrived) {
  const std::string goaway = Goaway(kRefusal);
  const PeerAnswer answer = Classified(goaway.substr(0, 9 + 8 + 7), true);
  EXPECT_EQ(answer.kind, PeerKind::kGoaway);
  EXPECT_EQ(answer.detail, "cohortd");
}

TEST(ClassifyReplyTest, GoawayBehindTheServerPrefaceIsTheAnswer) {
  const PeerAnswer answer =
      Classified(Settings() + Frame(0x4, "") + Goaway("draining"), false);
  EXPECT_EQ(answer.kind, PeerKind::kGoaway);
  EXPECT_EQ(answer.detail, "draining");
}

TEST(ClassifyReplyTest, GoawayTextIsCappedWhateverItsLengthClaims) {
  std::string goaway = Goaway(std::string(5000, 'x'));
  // The header claims 16 MiB - 1; only the first KiB of text is awaited.
  goaway[0] = goaway[1] = goaway[2] = '\xff';
  const PeerAnswer answer = Classified(goaway, false);
  EXPECT_EQ(answer.kind, PeerKind::kGoaway);
  EXPECT_EQ(answer.detail, std::string(1024, 'x'));
}

TEST(ClassifyReplyTest, GoawayWithoutItsFixedPartIsNotOne) {
  EXPECT_EQ(Classified(Frame(0x7, "abc"), false).kind, PeerKind::kOther);
}

TEST(ClassifyReplyTest, TlsRecordsAreTls) {
  // A ServerHello's record header, and a handshake_failure alert.
  EXPECT_EQ(Classified(std::string("\x16\x03\x03\x00\x54\x02", 6), false).kind,
            PeerKind::kTls);
  EXPECT_EQ(
      Classified(std::string("\x15\x03\x01\x00\x02\x02\x28", 7), true).kind,
      PeerKind::kTls);
  PeerAnswer answer;
  EXPECT_FALSE(ClassifyReply("\x16", false, &answer));
}

TEST(ClassifyReplyTest, AnythingElseIsOtherWithItsFirstBytes) {
  const PeerAnswer ssh = Classified("SSH-2.0-OpenSSH_9.2p1 Debian\r\n", false);
  EXPECT_EQ(ssh.kind, PeerKind::kOther);
  EXPECT_EQ(ssh.detail, "SSH-2.0-OpenSSH_9.2p1 Debian\r\n");
  const std::string http1 =
      "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n";
  const PeerAnswer answer = Classified(http1, false);
  EXPECT_EQ(answer.kind, PeerKind::kOther);
  EXPECT_EQ(answer.detail, http1.substr(0, 32));
  // Too short to be a frame header, then closed.
  EXPECT_EQ(Classified("no", true).kind, PeerKind::kOther);
  // A frame on a stream other than 0 is no server's first frame.
  std::string on_stream_1 = Settings();
  on_stream_1[8] = '\x01';
  EXPECT_EQ(Classified(on_stream_1, false).kind, PeerKind::kOther);
  EXPECT_EQ(Classified(std::string("\x16\x01", 2), false).kind,
            PeerKind::kOther);
}

TEST(OpeningsTest, AreWellFormed) {
  const absl::string_view preface = Http2ClientPreface();
  EXPECT_EQ(preface.substr(0, 24), "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
  EXPECT_EQ(preface.substr(24), Frame(0x4, ""));
  const std::string& hello = TlsClientHello();
  ASSERT_GT(hello.size(), 9u);
  EXPECT_EQ(hello.substr(0, 3), std::string("\x16\x03\x01", 3));
  const size_t record =
      (static_cast<uint8_t>(hello[3]) << 8) | static_cast<uint8_t>(hello[4]);
  EXPECT_EQ(record, hello.size() - 5);
  EXPECT_EQ(hello[5], '\x01');  // ClientHello
  const size_t body = (static_cast<uint8_t>(hello[6]) << 16) |
                      (static_cast<uint8_t>(hello[7]) << 8) |
                      static_cast<uint8_t>(hello[8]);
  EXPECT_EQ(body, hello.size() - 9);
}

// A TCP socket on a free loopback port: listening, or only bound (so the
// port stays ours and connections to it are refused).
int Socket(bool listening, int* port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  if (listening) {
    EXPECT_EQ(listen(fd, 16), 0);
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return fd;
}

// Accepts every connection and passes it to `serve` on its own thread;
// connections `serve` keeps open are closed when the server is destroyed.
class Server {
 public:
  // Returns whether the connection is to be held open.
  using Serve = std::function<bool(int fd)>;

  explicit Server(Serve serve) : serve_(std::move(serve)) {
    fd_ = Socket(/*listening=*/true, &port_);
    EXPECT_EQ(pipe(stop_), 0);
    thread_ = std::thread([this] { Run(); });
  }
  ~Server() {
    (void)!write(stop_[1], "x", 1);
    thread_.join();
    for (int fd : held_) close(fd);
    close(stop_[0]);
    close(stop_[1]);
    close(fd_);
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  void Run() {
    for (;;) {
      pollfd fds[2] = {{fd_, POLLIN, 0}, {stop_[0], POLLIN, 0}};
      if (poll(fds, 2, -1) < 0) continue;
      if (fds[1].revents != 0) return;
      int conn = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn < 0) continue;
      if (serve_(conn)) {
        held_.push_back(conn);
      } else {
        close(conn);
      }
    }
  }

  Serve serve_;
  int fd_ = -1;
  int port_ = 0;
  int stop_[2] = {-1, -1};
  std::vector<int> held_;  // The thread's, then the destructor's.
  std::thread thread_;
};

void Send(int fd, const std::string& bytes) {
  (void)!send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
}

// Waits long enough that only a peer that never answers reaches it: every
// other case is decided by the peer's bytes or close, however loaded the
// machine.
constexpr absl::Duration kAnswered = absl::Seconds(60);

TEST(ProbePeerTest, NothingListeningIsUnreachable) {
  int port = 0;
  const int fd = Socket(/*listening=*/false, &port);
  const PeerAnswer answer =
      ProbePeer(absl::StrCat("127.0.0.1:", port), kAnswered);
  EXPECT_EQ(answer.kind, PeerKind::kUnreachable);
  EXPECT_EQ(answer.detail, "Connection refused");
  close(fd);
}

TEST(ProbePeerTest, ABadAddressIsUnreachable) {
  EXPECT_EQ(ProbePeer("no-port", kAnswered).kind, PeerKind::kUnreachable);
}

// What a cohortd out of file descriptors looks like from outside when its
// accept() fails: the kernel completes the TCP handshake into the backlog
// and nothing ever reads or answers.
TEST(ProbePeerTest, AListenerThatNeverAcceptsIsSilent) {
  int port = 0;
  const int fd = Socket(/*listening=*/true, &port);
  const PeerAnswer answer =
      ProbePeer(absl::StrCat("127.0.0.1:", port), absl::Milliseconds(300));
  EXPECT_EQ(answer.kind, PeerKind::kSilent);
  close(fd);
}

TEST(ProbePeerTest, APeerThatAcceptsAndNeverAnswersIsSilent) {
  Server server([](int) { return true; });
  EXPECT_EQ(ProbePeer(server.address(), absl::Milliseconds(300)).kind,
            PeerKind::kSilent);
}

// cohortd's listener out of descriptors: accept with a spare, then close.
TEST(ProbePeerTest, APeerThatClosesAtOnceIsClosedNotTls) {
  Server server([](int) { return false; });
  EXPECT_EQ(ProbePeer(server.address(), kAnswered).kind, PeerKind::kClosed);
}

TEST(ProbePeerTest, GoawayTextComesBack) {
  Server server([](int fd) {
    Send(fd, Goaway(kRefusal));
    return false;
  });
  const PeerAnswer answer = ProbePeer(server.address(), kAnswered);
  EXPECT_EQ(answer.kind, PeerKind::kGoaway);
  EXPECT_EQ(answer.detail, kRefusal);
}

TEST(ProbePeerTest, ServerSettingsIsHttp2) {
  Server server([](int fd) {
    Send(fd, Settings());
    return true;
  });
  EXPECT_EQ(ProbePeer(server.address(), kAnswered).kind, PeerKind::kHttp2);
}

// As a TLS server does: the HTTP/2 preface is closed on without a byte,
// the ClientHello answered.
TEST(ProbePeerTest, APeerThatAnswersOnlyTheClientHelloIsTls) {
  Server server([](int fd) {
    char first = 0;
    if (recv(fd, &first, 1, 0) == 1 && first == '\x16') {
      Send(fd, std::string("\x15\x03\x03\x00\x02\x02\x28", 7));
    }
    return false;
  });
  EXPECT_EQ(ProbePeer(server.address(), kAnswered).kind, PeerKind::kTls);
}

TEST(ProbePeerTest, SomethingElseIsOther) {
  Server server([](int fd) {
    Send(fd, "SSH-2.0-test\r\n");
    return false;
  });
  const PeerAnswer answer = ProbePeer(server.address(), kAnswered);
  EXPECT_EQ(answer.kind, PeerKind::kOther);
  EXPECT_EQ(answer.detail, "SSH-2.0-test\r\n");
}

}  // namespace
}  // namespace cohort
