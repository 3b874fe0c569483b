// TcpStoreConnection against a server played by the test on a loopback
// socket: what it sends, how it reads replies and deadlines, and when it
// breaks. TcpStoreClient over it, against real servers, is
// tcpstore_client_test.cc.
#include "client/tcpstore_connection.h"

#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/net.h"
#include "gtest/gtest.h"
#include "proto/tcpstore/wire.h"

namespace cohort {
namespace {

using tcpstore::Dialect;
using tcpstore::Op;
using tcpstore::Request;

// A port nothing listens on.
int ClosedPort() {
  absl::StatusOr<base::ListeningSocket> s =
      base::ListenExclusive("127.0.0.1:0");
  EXPECT_TRUE(s.ok()) << s.status();
  close(s->fd);
  return s->port;
}

class TcpStoreConnectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<base::ListeningSocket> s =
        base::ListenExclusive("127.0.0.1:0");
    ASSERT_TRUE(s.ok()) << s.status();
    listener_ = *s;
    address_ = absl::StrCat("127.0.0.1:", listener_.port);
  }
  void TearDown() override {
    if (server_ >= 0) close(server_);
    close(listener_.fd);
  }

  // Opens a connection and accepts its server side.
  std::unique_ptr<TcpStoreConnection> Open(
      absl::Duration reply_timeout = absl::Seconds(30)) {
    absl::StatusOr<std::unique_ptr<TcpStoreConnection>> conn =
        TcpStoreConnection::Open(address_, absl::Now() + absl::Seconds(30),
                                 reply_timeout);
    EXPECT_TRUE(conn.ok()) << conn.status();
    server_ = accept(listener_.fd, nullptr, nullptr);
    EXPECT_GE(server_, 0);
    return conn.ok() ? *std::move(conn) : nullptr;
  }

  // Exactly `n` bytes the client sent.
  std::string Received(size_t n) {
    std::string out(n, '\0');
    size_t got = 0;
    while (got < n) {
      const ssize_t r = recv(server_, out.data() + got, n - got, 0);
      if (r <= 0) break;
      got += r;
    }
    out.resize(got);
    return out;
  }

  void Reply(const std::string& bytes) {
    ASSERT_EQ(send(server_, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
  }

  base::ListeningSocket listener_;
  std::string address_;
  int server_ = -1;
};

TEST_F(TcpStoreConnectionTest, SendsWhatIsQueuedAndReadsReplies) {
  auto conn = Open();
  ASSERT_NE(conn, nullptr);
  Request set;
  set.op = Op::kSet;
  set.key = "k";
  set.value = "v";
  conn->Queue(set);
  conn->Queue(Op::kGet, "k");
  conn->QueueKeys(Op::kCheck, {"a", "b"});
  std::string want;
  tcpstore::EncodeRequest(Dialect::kTorch21, set, &want);
  Request get;
  get.op = Op::kGet;
  get.key = "k";
  tcpstore::EncodeRequest(Dialect::kTorch21, get, &want);
  Request check;
  check.op = Op::kCheck;
  check.keys = {"a", "b"};
  tcpstore::EncodeRequest(Dialect::kTorch21, check, &want);
  ASSERT_TRUE(conn->Flush().ok());
  EXPECT_EQ(Received(want.size()), want);

  std::string reply;
  tcpstore::Encoder(&reply).Bytes("value");
  tcpstore::Encoder(&reply).I64(-7);
  tcpstore::Encoder(&reply).U8(1);
  Reply(reply);
  EXPECT_EQ(*conn->Bytes(), "value");
  EXPECT_EQ(*conn->I64(), -7);
  EXPECT_EQ(*conn->Word(1), 1u);
  EXPECT_FALSE(conn->broken());
}

TEST_F(TcpStoreConnectionTest, SyncChecksThePingNonce) {
  auto conn = Open();
  ASSERT_NE(conn, nullptr);
  for (bool echo_right : {true, false}) {
    std::thread server([&] {
      std::string ping = Received(5);
      Request r;
      ASSERT_EQ(tcpstore::ParseRequest(Dialect::kTorch21, ping, {}, &r).status,
                tcpstore::ParseStatus::kComplete);
      ASSERT_EQ(r.op, Op::kPing);
      std::string reply;
      tcpstore::Encoder(&reply).U32(echo_right ? r.word : r.word + 1);
      Reply(reply);
    });
    absl::Status s = conn->Sync();
    server.join();
    if (echo_right) {
      EXPECT_TRUE(s.ok()) << s;
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), "PING nonce")) << s;
      EXPECT_TRUE(conn->broken());
    }
  }
}

TEST_F(TcpStoreConnectionTest, SyncIn113IsAGetNumKeys) {
  auto conn = Open();
  ASSERT_NE(conn, nullptr);
  conn->set_dialect(Dialect::kTorch113);
  std::string reply;
  tcpstore::Encoder(&reply).I64(3);
  Reply(reply);  // Waits in the socket for the query.
  ASSERT_TRUE(conn->Sync().ok());
  std::string want;
  Request num_keys;
  num_keys.op = Op::kNumKeys;
  tcpstore::EncodeRequest(Dialect::kTorch113, num_keys, &want);
  EXPECT_EQ(Received(want.size()), want);
}

TEST_F(TcpStoreConnectionTest, ACallersDeadlineLeavesItUsable) {
  auto conn = Open();
  ASSERT_NE(conn, nullptr);
  absl::StatusOr<uint64_t> early =
      conn->Word(1, absl::Now() + absl::Milliseconds(1));
  EXPECT_EQ(early.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(conn->broken());
  Reply(std::string(1, '\x01'));
  EXPECT_EQ(*conn->Word(1), 1u);
}

TEST_F(TcpStoreConnectionTest, NoReplyWithinReplyTimeoutBreaksIt) {
  auto conn = Open(absl::Milliseconds(1));
  ASSERT_NE(conn, nullptr);
  absl::StatusOr<int64_t> n = conn->I64();
  EXPECT_EQ(n.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(n.status().message(),
            absl::StrCat("lost the connection to the TCPStore server at ",
                         address_, ": no reply within 1ms"));
  EXPECT_TRUE(conn->broken());
}

TEST_F(TcpStoreConnectionTest, AServerThatClosesIsLostAndStale) {
  auto conn = Open();
  ASSERT_NE(conn, nullptr);
  EXPECT_FALSE(conn->Stale());
  close(server_);
  server_ = -1;
  // The close reaches the client's socket on the kernel's time: wait for
  // it (giving up after 30 s only so that a connection that never sees it
  // fails here).
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (!conn->Stale() && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_TRUE(conn->Stale());
  absl::StatusOr<int64_t> n = conn->I64();
  EXPECT_EQ(n.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(n.status().message(),
            absl::StrCat("lost the connection to the TCPStore server at ",
                         address_, ": the server closed the connection"));
  EXPECT_TRUE(conn->broken());
}

TEST_F(TcpStoreConnectionTest, AnAbsurdReplyLengthIsAViolation) {
  auto conn = Open();
  ASSERT_NE(conn, nullptr);
  std::string reply;
  tcpstore::Encoder(&reply).U64(uint64_t{1} << 31);
  Reply(reply);
  absl::StatusOr<std::string> value = conn->Bytes();
  EXPECT_EQ(value.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(
      value.status().message(),
      absl::StrCat("protocol error from the TCPStore server at ", address_,
                   " (PyTorch 2.1+ dialect): a reply string of "
                   "2147483648 bytes; the connection was dropped"));
  EXPECT_TRUE(conn->broken());
}

TEST_F(TcpStoreConnectionTest, OpenTriesEachAddressInTurn) {
  const std::string closed = absl::StrCat("127.0.0.1:", ClosedPort());
  absl::StatusOr<std::unique_ptr<TcpStoreConnection>> conn =
      TcpStoreConnection::Open(absl::StrCat(closed, ",", address_),
                               absl::Now() + absl::Seconds(30),
                               absl::Seconds(30));
  ASSERT_TRUE(conn.ok()) << conn.status();
  conn = TcpStoreConnection::Open(absl::StrCat(closed, ",", closed),
                                  absl::Now() + absl::Seconds(30),
                                  absl::Seconds(30));
  EXPECT_EQ(conn.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(conn.status().message(),
            absl::StrCat(closed, ": Connection refused; ", closed,
                         ": Connection refused"));
}

TEST(TcpStoreConnectionOpenTest, NamesAHostThatDoesNotResolve) {
  absl::StatusOr<std::unique_ptr<TcpStoreConnection>> conn =
      TcpStoreConnection::Open("no-such-host.invalid:29500",
                               absl::Now() + absl::Seconds(30),
                               absl::Seconds(30));
  EXPECT_EQ(conn.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StartsWith(conn.status().message(),
                               "cannot resolve 'no-such-host.invalid': "))
      << conn.status();
}

TEST(TcpStoreCallOptionsTest, NamedForWhatTheyRetry) {
  EXPECT_TRUE(TcpStoreCallOptions::Retryable().retry_lost_connection);
  EXPECT_FALSE(TcpStoreCallOptions::Once().retry_lost_connection);
}

}  // namespace
}  // namespace cohort
