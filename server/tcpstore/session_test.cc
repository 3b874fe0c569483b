// TcpStoreSession from byte strings, without sockets: every query of both
// dialects, the hellos, c10d's write rules, bad input, queues, waits and
// barriers, the batch, and requests split across reads at every byte.
// FakeHost stands in for the event loop.
#include "server/tcpstore/session.h"

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/tcpstore/wire.h"
#include "server/auth/quota.h"
#include "server/tcpstore/fake_host.h"
#include "store/kv_engine.h"
#include "store/kv_store.h"

namespace cohort::server {
namespace {

using tcpstore::Dialect;
using tcpstore::Encoder;
using tcpstore::Op;
using tcpstore::Request;
using Progress = TcpStoreSession::Progress;

constexpr Dialect k21 = Dialect::kTorch21;
constexpr Dialect k113 = Dialect::kTorch113;

// ---- bytes ----

std::string Req(Dialect d, Op op, absl::string_view key = "",
                absl::string_view value = "") {
  Request r;
  r.op = op;
  r.key = key;
  r.value = value;
  std::string out;
  tcpstore::EncodeRequest(d, r, &out);
  return out;
}

std::string Req(Dialect d, const Request& r) {
  std::string out;
  tcpstore::EncodeRequest(d, r, &out);
  return out;
}

std::string Number(Dialect d, Op op, absl::string_view key, int64_t n) {
  Request r;
  r.op = op;
  r.key = key;
  r.number = n;
  return Req(d, r);
}

std::string KeysReq(Dialect d, Op op, std::vector<absl::string_view> keys) {
  Request r;
  r.op = op;
  r.keys = std::move(keys);
  return Req(d, r);
}

std::string Word(Dialect d, Op op, uint32_t word) {
  Request r;
  r.op = op;
  r.word = word;
  return Req(d, r);
}

std::string Validate() {
  return Word(k21, Op::kValidate, tcpstore::kValidateMagic);
}

std::string Hello(absl::string_view name_space, absl::string_view token = "") {
  std::string out;
  tcpstore::EncodeNamespaceHello(name_space, &out, token);
  return out;
}

std::string U8(uint8_t v) { return std::string(1, static_cast<char>(v)); }
std::string U32(uint32_t v) {
  std::string out;
  Encoder(&out).U32(v);
  return out;
}
std::string I64(int64_t v) {
  std::string out;
  Encoder(&out).I64(v);
  return out;
}
std::string Bytes(absl::string_view v) {
  std::string out;
  Encoder(&out).Bytes(v);
  return out;
}

const std::string kStopWaiting = U8(0);
const std::string kWaitCanceled = U8(1);
const std::string kReady = U8(0);
const std::string kNotReady = U8(1);

// A connection as the loop serves it: bytes in, what is not yet taken kept
// for the next read.
struct Client {
  Client(TcpStoreProtocol& protocol, uint64_t id)
      : session(protocol, id, absl::StrCat("10.0.0.", id, ":5000")) {}

  // The replies so far, taken.
  std::string Take() { return std::exchange(session.output(), ""); }

  TcpStoreSession session;
  std::string in;
};

class SessionTest : public ::testing::Test {
 protected:
  void SetUp() override { Restart({}); }

  // A fresh store and protocol with `options`.
  void Restart(TcpStoreSessionOptions options) {
    clients_.clear();
    host_.RunPosted();  // What ending them posted, while its protocol lives.
    protocol_.reset();
    store::StoreLimits limits;
    limits.max_key_bytes = 1024;
    limits.max_value_bytes = 1 << 16;
    store_ = std::make_unique<store::KvStore>(store::NewMemoryEngine(), limits);
    options.max_request_bytes = 1 << 20;
    protocol_ = std::make_unique<TcpStoreProtocol>(store_.get(),
                                                   std::move(options), &host_);
  }

  Client& Connect() {
    const uint64_t id = next_id_++;
    return *clients_.emplace(id, std::make_unique<Client>(*protocol_, id))
                .first->second;
  }

  // Delivers `bytes` on `c` as one read, feeds every session that has
  // requests to serve, commits the batch and runs what the store posted;
  // again while that readies sessions. Returns `c`'s replies.
  std::string Send(Client& c, absl::string_view bytes) {
    c.in.append(bytes.data(), bytes.size());
    Serve(c);
    return c.Take();
  }

  // Delivers `bytes` without committing (the loop would wait for more).
  void SendUncommitted(Client& c, absl::string_view bytes) {
    c.in.append(bytes.data(), bytes.size());
    c.in.erase(0, c.session.Feed(c.in));
  }

  void Serve(Client& c) {
    c.in.erase(0, c.session.Feed(c.in));
    Pump();
  }

  // Commits, runs the posted callbacks and feeds the sessions they readied.
  void Pump() {
    for (;;) {
      protocol_->CommitBatch();
      host_.RunPosted();
      if (host_.ready.empty()) return;
      std::vector<uint64_t> ready;
      ready.swap(host_.ready);
      for (uint64_t id : ready) {
        auto it = clients_.find(id);
        if (it == clients_.end()) continue;
        Client& c = *it->second;
        c.in.erase(0, c.session.Feed(c.in));
      }
    }
  }

  // A 2.1+ client past its VALIDATE.
  Client& Validated() {
    Client& c = Connect();
    EXPECT_EQ(Send(c, Validate()), "");
    return c;
  }

  bool Closed(const Client& c) const {
    return host_.closed.count(c.session.id()) > 0;
  }
  const FakeHost::Closed& Why(const Client& c) {
    return host_.closed[c.session.id()];
  }

  FakeHost host_;
  std::unique_ptr<store::KvStore> store_;
  std::unique_ptr<TcpStoreProtocol> protocol_;
  std::map<uint64_t, std::unique_ptr<Client>> clients_;
  uint64_t next_id_ = 1;
};

// ---- queries ----

TEST_F(SessionTest, Torch21EveryKeyValueQuery) {
  Client& c = Validated();
  EXPECT_EQ(c.session.dialect(), k21);
  EXPECT_EQ(Send(c, Word(k21, Op::kPing, 0xABCD1234)), U32(0xABCD1234));
  EXPECT_EQ(Send(c, Req(k21, Op::kSet, "/a", "1")), "");  // No reply.
  EXPECT_EQ(Send(c, Req(k21, Op::kGet, "/a")), Bytes("1"));
  EXPECT_EQ(Send(c, Req(k21, Op::kGet, "/none")), Bytes(""));
  EXPECT_EQ(Send(c, Number(k21, Op::kAdd, "/n", 5)), I64(5));
  EXPECT_EQ(Send(c, Number(k21, Op::kAdd, "/n", -2)), I64(3));
  Request cas;
  cas.op = Op::kCompareSet;
  cas.key = "/a";
  cas.expected = "1";
  cas.value = "2";
  EXPECT_EQ(Send(c, Req(k21, cas)), Bytes("2"));  // Swapped.
  cas.expected = "x";
  cas.value = "3";
  EXPECT_EQ(Send(c, Req(k21, cas)), Bytes("2"));  // Not: the current value.
  EXPECT_EQ(Send(c, Req(k21, Op::kAppend, "/a", "b")), "");
  EXPECT_EQ(Send(c, KeysReq(k21, Op::kCheck, {"/a", "/n"})), kReady);
  EXPECT_EQ(Send(c, KeysReq(k21, Op::kCheck, {"/a", "/none"})), kNotReady);
  Request multi_set;
  multi_set.op = Op::kMultiSet;
  multi_set.keys = {"/m1", "/m2"};
  multi_set.values = {"x", "y"};
  EXPECT_EQ(Send(c, Req(k21, multi_set)), "");
  EXPECT_EQ(Send(c, KeysReq(k21, Op::kMultiGet, {"/a", "/m2", "/none"})),
            Bytes("2b") + Bytes("y") + Bytes(""));
  EXPECT_EQ(Send(c, Req(k21, Op::kNumKeys)), I64(4));
  EXPECT_EQ(Send(c, Req(k21, Op::kListKeys)),
            I64(4) + Bytes("/a") + Bytes("/m1") + Bytes("/m2") + Bytes("/n"));
  EXPECT_EQ(Send(c, Req(k21, Op::kDeleteKey, "/m1")), I64(1));
  EXPECT_EQ(Send(c, Req(k21, Op::kDeleteKey, "/m1")), I64(0));
  EXPECT_EQ(Send(c, KeysReq(k21, Op::kWait, {"/a", "/n"})), kStopWaiting);
  // CANCEL_WAIT with nothing waiting is answered all the same.
  EXPECT_EQ(Send(c, Req(k21, Op::kCancelWait)), kWaitCanceled);
  EXPECT_EQ(*store_->TryGet("/a"), std::optional<std::string>("2b"));
  EXPECT_FALSE(Closed(c));
  EXPECT_EQ(protocol_->stats().requests, 20u);
}

TEST_F(SessionTest, Torch113DialectHasNoHandshake) {
  Client& c = Connect();
  // SET is code 0 in 1.13, like VALIDATE in 2.1: told apart by what follows.
  EXPECT_EQ(Send(c, Req(k113, Op::kSet, "/k", "v")), "");
  EXPECT_EQ(c.session.dialect(), k113);
  EXPECT_EQ(Send(c, Req(k113, Op::kGet, "/k")), Bytes("v"));
  EXPECT_EQ(Send(c, Number(k113, Op::kAdd, "/n", 7)), I64(7));
  EXPECT_EQ(Send(c, KeysReq(k113, Op::kCheck, {"/k"})), kReady);
  EXPECT_EQ(Send(c, Req(k113, Op::kNumKeys)), I64(2));
  EXPECT_EQ(Send(c, Req(k113, Op::kDeleteKey, "/n")), I64(1));
  EXPECT_EQ(Send(c, KeysReq(k113, Op::kWait, {"/k"})), kStopWaiting);
  EXPECT_FALSE(Closed(c));
  // 1.13's server drops a GET of a missing key; so does cohortd.
  EXPECT_EQ(Send(c, Req(k113, Op::kGet, "/none")), "");
  EXPECT_TRUE(Closed(c));
  EXPECT_TRUE(absl::StrContains(Why(c).why, "GET of missing key"));
  EXPECT_FALSE(Why(c).bad_input);
}

TEST_F(SessionTest, Torch113WatchKeyIsRefused) {
  Client& c = Connect();
  EXPECT_EQ(Send(c, Req(k113, Op::kWatchKey, "/k")), "");
  EXPECT_TRUE(Closed(c));
  EXPECT_TRUE(absl::StrContains(Why(c).why, "WATCH_KEY is not supported"));
}

TEST_F(SessionTest, TheDialectWaitsForTheBytesThatTellIt) {
  Client& c = Connect();
  const std::string validate = Validate();
  // Its first byte is no hello: it is let in without one.
  EXPECT_EQ(c.session.Next(validate.substr(0, 1)).progress, Progress::kOpening);
  for (size_t n = 1; n < validate.size(); ++n) {
    const TcpStoreSession::Step step = c.session.Next(validate.substr(0, n));
    EXPECT_EQ(step.progress, Progress::kStopped) << n;
    EXPECT_EQ(step.used, 0u);
    EXPECT_GT(step.need, n);
    EXPECT_EQ(c.session.dialect(), std::nullopt);
  }
  EXPECT_EQ(Send(c, validate + Word(k21, Op::kPing, 9)), U32(9));
  EXPECT_EQ(c.session.dialect(), k21);
}

TEST_F(SessionTest, ValidateWithAnotherMagicIsBadInput) {
  Client& c = Validated();
  EXPECT_EQ(Send(c, Word(k21, Op::kValidate, 0x12345678)), "");
  EXPECT_TRUE(Closed(c));
  EXPECT_TRUE(Why(c).bad_input);
  EXPECT_TRUE(absl::StrContains(Why(c).why, "VALIDATE with magic 0x12345678"));
}

// ---- hellos ----

TEST_F(SessionTest, ANamespaceHelloConfinesEveryQuery) {
  ASSERT_TRUE(store_->Set("/outside", "x").ok());
  Client& a = Connect();
  EXPECT_EQ(Send(a, Hello("/job/a/") + Validate()), "");
  EXPECT_EQ(a.session.name_space(), "/job/a/");
  Client& b = Connect();
  EXPECT_EQ(Send(b, Hello("/job/b/") + Validate()), "");
  EXPECT_EQ(Send(a, Req(k21, Op::kSet, "/k", "a")), "");
  EXPECT_EQ(Send(b, Req(k21, Op::kSet, "/k", "b")), "");
  EXPECT_EQ(Send(a, Req(k21, Op::kGet, "/k")), Bytes("a"));
  EXPECT_EQ(Send(b, Req(k21, Op::kGet, "/k")), Bytes("b"));
  EXPECT_EQ(Send(a, KeysReq(k21, Op::kCheck, {"/outside"})), kNotReady);
  EXPECT_EQ(Send(a, Req(k21, Op::kNumKeys)), I64(1));
  EXPECT_EQ(Send(a, Req(k21, Op::kListKeys)), I64(1) + Bytes("/k"));
  EXPECT_EQ(Send(a, Req(k21, Op::kQueuePush, "/q", "item")), "");
  EXPECT_EQ(Send(b, Req(k21, Op::kQueueLen, "/q")), I64(0));
  EXPECT_EQ(Send(a, Req(k21, Op::kQueueLen, "/q")), I64(1));
  EXPECT_EQ(Send(a, Req(k21, Op::kNumKeys)), I64(1));  // Queues left out.
  EXPECT_EQ(*store_->TryGet("/job/a//k"), std::optional<std::string>("a"));
  EXPECT_EQ(*store_->TryGet("/job/b//k"), std::optional<std::string>("b"));
}

TEST_F(SessionTest, ThePrefixComesBeforeTheHellosNamespace) {
  Restart({.prefix = "/jobs/"});
  Client& plain = Validated();
  EXPECT_EQ(plain.session.name_space(), "/jobs/");
  EXPECT_EQ(Send(plain, Req(k21, Op::kSet, "/k", "v")), "");
  Client& named = Connect();
  EXPECT_EQ(
      Send(named, Hello("/run/") + Validate() + Req(k21, Op::kSet, "/k", "w") +
                      Req(k21, Op::kNumKeys)),
      I64(1));
  EXPECT_EQ(*store_->TryGet("/jobs//k"), std::optional<std::string>("v"));
  EXPECT_EQ(*store_->TryGet("/jobs//run//k"), std::optional<std::string>("w"));
}

TEST_F(SessionTest, BadHellosAreBadInput) {
  std::string bad_magic = Hello("/ns/");
  bad_magic[3] = '9';
  std::string reserved;
  Encoder e(&reserved);
  for (char ch : tcpstore::kNamespaceHelloMagic) {
    e.U8(static_cast<uint8_t>(ch));
  }
  e.U32(8);
  reserved += "/cohort/";
  for (const std::string& hello : {bad_magic, reserved}) {
    Client& c = Connect();
    EXPECT_EQ(Send(c, hello + Validate()), "");
    EXPECT_TRUE(Closed(c)) << absl::CHexEscape(hello);
    EXPECT_TRUE(Why(c).bad_input);
    EXPECT_TRUE(absl::StrContains(Why(c).why, "bad namespace hello"));
  }
}

TEST_F(SessionTest, TokenHellosAreAuthorizedAgainstTheirNamespace) {
  std::vector<std::string> asked;
  bool valid = true;
  Restart(
      {.authorize = [&](absl::string_view token, absl::string_view name_space)
           -> absl::StatusOr<TcpStoreGrant> {
         asked.push_back(absl::StrCat(token, " ", name_space));
         if (token != "good-token-0123456789") {
           return absl::UnauthenticatedError("unknown token");
         }
         return TcpStoreGrant{.owner = "token abc",
                              .still_valid = [&valid]() -> absl::Status {
                                if (valid) return absl::OkStatus();
                                return absl::PermissionDeniedError("revoked");
                              }};
       },
       .require_token = true});
  Client& torch = Connect();
  EXPECT_EQ(Send(torch, Validate()), "");
  EXPECT_TRUE(Closed(torch));
  EXPECT_TRUE(absl::StrContains(Why(torch).why, "this listener needs a token"));
  Client& no_token = Connect();
  EXPECT_EQ(Send(no_token, Hello("/j/") + Validate()), "");
  EXPECT_TRUE(absl::StrContains(Why(no_token).why, "carries no token"));
  Client& bad = Connect();
  EXPECT_EQ(Send(bad, Hello("/j/", "bad-token-0123456789")), "");
  EXPECT_TRUE(absl::StrContains(Why(bad).why, "refused: unknown token"));
  Client& good = Connect();
  EXPECT_EQ(Send(good, Hello("/j/", "good-token-0123456789") + Validate() +
                           Word(k21, Op::kPing, 1)),
            U32(1));
  EXPECT_EQ(asked, (std::vector<std::string>{"bad-token-0123456789 /j/",
                                             "good-token-0123456789 /j/"}));
  valid = false;  // Revoked: the next request ends the connection.
  EXPECT_EQ(Send(good, Word(k21, Op::kPing, 2)), "");
  EXPECT_TRUE(absl::StrContains(Why(good).why, "no longer valid: revoked"));
  EXPECT_EQ(protocol_->stats().refused_unauthenticated, 4u);
  for (const auto& [id, closed] : host_.closed) EXPECT_FALSE(closed.bad_input);
  Restart({});  // Before `valid` and `asked` go.
}

TEST_F(SessionTest, ATokenHelloNeedsAListenerThatTakesTokens) {
  Client& c = Connect();
  EXPECT_EQ(Send(c, Hello("/j/", "some-token-0123456789") + Validate()), "");
  EXPECT_TRUE(absl::StrContains(Why(c).why, "takes no tokens"));
}

// ---- c10d's rules ----

TEST_F(SessionTest, WritesToTheReservedNamespaceCloseTheConnection) {
  Request multi_set;
  multi_set.op = Op::kMultiSet;
  multi_set.keys = {"/fine", "/cohort/x"};
  multi_set.values = {"a", "b"};
  for (const std::string& write :
       {Req(k21, Op::kSet, "/cohort/x", "v"),
        Req(k21, Op::kAppend, "/cohort/x", "v"),
        Number(k21, Op::kAdd, "/cohort/n", 1),
        Req(k21, Op::kDeleteKey, "/cohort/x"), Req(k21, multi_set),
        Number(k21, Op::kBarrier, "/cohort/b", 2)}) {
    Client& c = Validated();
    EXPECT_EQ(Send(c, write + Word(k21, Op::kPing, 1)), "");
    EXPECT_TRUE(Closed(c));
    EXPECT_TRUE(absl::StrContains(Why(c).why, "refused")) << Why(c).why;
    EXPECT_FALSE(Why(c).bad_input);
  }
  EXPECT_EQ(store_->NumKeys()->num_keys, 0);
  // Reads there, and queues named so, are not writes to it.
  Client& reader = Validated();
  EXPECT_EQ(Send(reader, Req(k21, Op::kGet, "/cohort/x") +
                             Req(k21, Op::kQueuePush, "/cohort/q", "i") +
                             Req(k21, Op::kQueueLen, "/cohort/q")),
            Bytes("") + I64(1));
  EXPECT_FALSE(Closed(reader));
}

// ---- bad input ----

TEST_F(SessionTest, BadInputClosesTheSessionAsBadInput) {
  std::string huge_key;
  Encoder e(&huge_key);
  e.U8(*tcpstore::OpCode(k21, Op::kGet));
  e.U64(uint64_t{1} << 40);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {Validate() + "\x7f", "unknown"},
      {Validate() + huge_key, ""},
      {"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "first bytes"},
  };
  for (const auto& [bytes, says] : cases) {
    Client& c = Connect();
    EXPECT_EQ(Send(c, bytes), "");
    EXPECT_TRUE(Closed(c)) << absl::CHexEscape(bytes);
    EXPECT_TRUE(Why(c).bad_input);
    EXPECT_TRUE(absl::StrContains(Why(c).why, says)) << Why(c).why;
    // Nothing is taken after it.
    EXPECT_EQ(c.session.Next(Word(k21, Op::kPing, 1)).progress,
              Progress::kStopped);
  }
}

TEST_F(SessionTest, AnOverLongLengthIsRefusedBeforeItsBytesArrive) {
  Client& c = Validated();
  std::string prefix;
  Encoder e(&prefix);
  e.U8(*tcpstore::OpCode(k21, Op::kSet));
  e.U64(2048);  // Over the store's 1024-byte keys.
  const TcpStoreSession::Step step = c.session.Next(prefix);
  EXPECT_EQ(step.progress, Progress::kStopped);
  EXPECT_TRUE(Closed(c));
  EXPECT_TRUE(Why(c).bad_input);
}

// ---- queues ----

TEST_F(SessionTest, QueuesPushPopAndLen) {
  Client& c = Validated();
  EXPECT_EQ(Send(c, Req(k21, Op::kQueueLen, "/never")), I64(0));
  EXPECT_EQ(Send(c, Req(k21, Op::kQueuePop, "/never")), I64(0));
  EXPECT_EQ(Send(c, Req(k21, Op::kQueuePush, "/q", "a") +
                        Req(k21, Op::kQueuePush, "/q", "b")),
            "");
  EXPECT_EQ(Send(c, Req(k21, Op::kQueueLen, "/q")), I64(2));
  // The length before the pop, then the item.
  EXPECT_EQ(Send(c, Req(k21, Op::kQueuePop, "/q")), I64(2) + Bytes("a"));
  EXPECT_EQ(Send(c, Req(k21, Op::kQueuePop, "/q")), I64(1) + Bytes("b"));
  EXPECT_EQ(Send(c, Req(k21, Op::kQueuePop, "/q")), I64(0));
  EXPECT_EQ(Send(c, Req(k21, Op::kQueuePush, "/q", "c")), "");
  // A key whose queue holds items exists to CHECK and WAIT, not to
  // GETNUMKEYS or LIST_KEYS.
  EXPECT_EQ(Send(c, KeysReq(k21, Op::kCheck, {"/q"})), kReady);
  EXPECT_EQ(Send(c, KeysReq(k21, Op::kWait, {"/q"})), kStopWaiting);
  EXPECT_EQ(Send(c, Req(k21, Op::kNumKeys)), I64(0));
  EXPECT_EQ(Send(c, Req(k21, Op::kListKeys)), I64(0));
  EXPECT_EQ(store_->queue_stats().items, 1);
}

TEST_F(SessionTest, APushWakesOneWaiterAndAPopperThatLeavesPassesItOn) {
  Client& first = Validated();
  Client& second = Validated();
  Client& pusher = Validated();
  EXPECT_EQ(Send(first, KeysReq(k21, Op::kWait, {"/q"})), "");
  EXPECT_EQ(Send(second, KeysReq(k21, Op::kWait, {"/q"})), "");
  EXPECT_TRUE(first.session.blocked());
  EXPECT_EQ(protocol_->stats().blocked, 2u);
  EXPECT_EQ(Send(pusher, Req(k21, Op::kQueuePush, "/q", "item")), "");
  EXPECT_EQ(first.Take(), kStopWaiting);  // The oldest only.
  EXPECT_EQ(second.Take(), "");
  // `first` does something else than pop: its wake-up goes to `second`.
  EXPECT_EQ(Send(first, Word(k21, Op::kPing, 3)), U32(3));
  EXPECT_EQ(second.Take(), kStopWaiting);
  EXPECT_EQ(Send(second, Req(k21, Op::kQueuePop, "/q")),
            I64(1) + Bytes("item"));
  EXPECT_EQ(protocol_->stats().blocked, 0u);
}

TEST_F(SessionTest, AWokenWaiterThatEndsPassesTheItemOn) {
  Client& first = Validated();
  Client& second = Validated();
  Client& pusher = Validated();
  Send(first, KeysReq(k21, Op::kWait, {"/q"}));
  Send(second, KeysReq(k21, Op::kWait, {"/q"}));
  Send(pusher, Req(k21, Op::kQueuePush, "/q", "item"));
  EXPECT_EQ(first.Take(), kStopWaiting);
  first.session.End();  // Its client left before popping.
  Pump();
  EXPECT_EQ(second.Take(), kStopWaiting);
}

TEST_F(SessionTest, APopOfAnEndedSessionIsLeftOutOfTheBatch) {
  Client& c = Validated();
  Send(c, Req(k21, Op::kQueuePush, "/q", "item"));
  SendUncommitted(c, Req(k21, Op::kQueuePop, "/q"));
  EXPECT_TRUE(protocol_->has_batch());
  c.session.End();
  protocol_->CommitBatch();
  EXPECT_EQ(store_->queue_stats().items, 1);
}

// ---- waits and barriers ----

TEST_F(SessionTest, AWaitIsAnsweredWhenAnotherSessionSetsTheKeys) {
  Client& waiter = Validated();
  Client& writer = Validated();
  // The PING behind the WAIT waits too: replies go out in order.
  EXPECT_EQ(Send(waiter, KeysReq(k21, Op::kWait, {"/a", "/b"}) +
                             Word(k21, Op::kPing, 5)),
            "");
  EXPECT_TRUE(waiter.session.blocked());
  EXPECT_EQ(Send(writer, Req(k21, Op::kSet, "/a", "1")), "");
  EXPECT_EQ(waiter.Take(), "");
  EXPECT_EQ(Send(writer, Req(k21, Op::kSet, "/b", "2")), "");
  EXPECT_EQ(waiter.Take(), kStopWaiting + U32(5));
  EXPECT_FALSE(waiter.session.blocked());
}

TEST_F(SessionTest, OnlyCancelWaitPassesABlockedWait) {
  Client& c = Validated();
  EXPECT_EQ(Send(c, KeysReq(k21, Op::kWait, {"/k"})), "");
  const std::string ping = Word(k21, Op::kPing, 1);
  const TcpStoreSession::Step step = c.session.Next(ping);
  EXPECT_EQ(step.progress, Progress::kStopped);
  EXPECT_EQ(step.used, 0u);
  EXPECT_EQ(Send(c, Req(k21, Op::kCancelWait) + ping), kWaitCanceled + U32(1));
  EXPECT_FALSE(c.session.blocked());
  // The cancelled wait ends nothing later.
  Client& writer = Validated();
  Send(writer, Req(k21, Op::kSet, "/k", "v"));
  EXPECT_EQ(c.Take(), "");
}

TEST_F(SessionTest, Torch113RequestsAfterATimedOutWaitAreServed) {
  Client& c = Connect();
  EXPECT_EQ(Send(c, KeysReq(k113, Op::kWait, {"/k"})), "");
  EXPECT_TRUE(c.session.blocked());
  // Its client timed out and moved on: the wait is forgotten silently.
  EXPECT_EQ(Send(c, Req(k113, Op::kNumKeys)), I64(0));
  Client& writer = Connect();
  Send(writer, Req(k113, Op::kSet, "/k", "v"));
  EXPECT_EQ(c.Take(), "");
}

TEST_F(SessionTest, ABarrierReleasesEveryoneWhenTheLastArrives) {
  Client& a = Validated();
  Client& b = Validated();
  Client& c = Validated();
  EXPECT_EQ(Send(a, Number(k21, Op::kBarrier, "/bar", 3)), "");
  EXPECT_EQ(Send(b, Number(k21, Op::kBarrier, "/bar", 3)), "");
  EXPECT_TRUE(a.session.blocked());
  EXPECT_EQ(protocol_->stats().blocked, 2u);
  EXPECT_EQ(Send(c, Number(k21, Op::kBarrier, "/bar", 3)), kStopWaiting);
  EXPECT_EQ(a.Take(), kStopWaiting);
  EXPECT_EQ(b.Take(), kStopWaiting);
  EXPECT_EQ(protocol_->stats().blocked, 0u);
  EXPECT_EQ(*store_->TryGet("/bar"), std::optional<std::string>("3"));
}

TEST_F(SessionTest, AStoreShutdownEndsBlockedSessions) {
  Client& waiter = Validated();
  Client& barrier = Validated();
  Send(waiter, KeysReq(k21, Op::kWait, {"/never"}));
  Send(barrier, Number(k21, Op::kBarrier, "/bar", 2));
  store_->Shutdown(absl::UnavailableError("draining"));
  Pump();
  EXPECT_TRUE(absl::StrContains(Why(waiter).why, "wait ended: draining"));
  EXPECT_TRUE(absl::StrContains(Why(barrier).why, "BARRIER ended: draining"));
}

// ---- the batch ----

TEST_F(SessionTest, ChangesWithoutRepliesWaitForTheBatch) {
  Client& c = Validated();
  Client& other = Validated();
  SendUncommitted(c, Req(k21, Op::kSet, "/k", "v"));
  EXPECT_TRUE(protocol_->has_batch());
  EXPECT_FALSE(protocol_->MustCommit());
  EXPECT_FALSE(protocol_->Overdue(host_.now_ns));
  EXPECT_EQ(*store_->TryGet("/k"), std::nullopt);  // In flight.
  host_.now_ns += TcpStoreProtocol::kMaxBatchDelayNs;
  EXPECT_TRUE(protocol_->Overdue(host_.now_ns));
  EXPECT_TRUE(protocol_->MustCommit());
  // A read of any session commits the batch first, then answers.
  SendUncommitted(other, Req(k21, Op::kGet, "/k"));
  EXPECT_FALSE(protocol_->has_batch());
  EXPECT_EQ(other.Take(), Bytes("v"));
}

TEST_F(SessionTest, AChangeWithAReplyMustBeCommittedThisPass) {
  Client& c = Validated();
  SendUncommitted(c, Number(k21, Op::kAdd, "/n", 1));
  EXPECT_TRUE(protocol_->MustCommit());
  EXPECT_EQ(c.Take(), "");  // Answered at the commit.
  protocol_->CommitBatch();
  EXPECT_EQ(c.Take(), I64(1));
}

TEST_F(SessionTest, OnQueryReportsEachRequestOnce) {
  std::vector<std::pair<Op, TcpStoreOutcome>> seen;
  Restart({.on_query = [&](Op op, TcpStoreOutcome outcome, absl::Duration) {
    seen.emplace_back(op, outcome);
  }});
  Client& c = Validated();
  Send(c, Req(k21, Op::kSet, "/k", "v") + Req(k21, Op::kGet, "/k") +
              KeysReq(k21, Op::kWait, {"/w"}) + Req(k21, Op::kCancelWait));
  Send(c, Req(k21, Op::kSet, "/cohort/x", "v"));
  using O = TcpStoreOutcome;
  EXPECT_EQ(seen, (std::vector<std::pair<Op, O>>{{Op::kValidate, O::kOk},
                                                 {Op::kSet, O::kOk},
                                                 {Op::kGet, O::kOk},
                                                 {Op::kWait, O::kCancelled},
                                                 {Op::kCancelWait, O::kOk},
                                                 {Op::kSet, O::kFailed}}));
  Restart({});  // Before `seen` goes.
}

// ---- quotas ----

TEST_F(SessionTest, QueuesAndWaitsAreChargedToTheConnection) {
  Quotas quotas({.queue_bytes = 8, .waits = 1});
  Restart({.quotas = &quotas});
  Client& c = Validated();
  const std::string owner = "connection 10.0.0.1:5000";
  EXPECT_EQ(quotas.Used(owner, Quota::kConnections), 1u);
  Send(c, Req(k21, Op::kQueuePush, "/q", "12345"));
  EXPECT_EQ(quotas.Used(owner, Quota::kQueueBytes), 5u);
  Send(c, Req(k21, Op::kQueuePop, "/q"));
  EXPECT_EQ(quotas.Used(owner, Quota::kQueueBytes), 0u);
  Send(c, KeysReq(k21, Op::kWait, {"/a", "/b"}));
  EXPECT_EQ(quotas.Used(owner, Quota::kWaits), 1u);
  EXPECT_EQ(quotas.Used(owner, Quota::kWaitedKeys), 2u);
  Send(c, Req(k21, Op::kCancelWait));
  EXPECT_EQ(quotas.Used(owner, Quota::kWaits), 0u);
  Send(c, Req(k21, Op::kQueuePush, "/q", "123456789"));
  EXPECT_TRUE(Closed(c));
  EXPECT_TRUE(absl::StrContains(Why(c).why, "QUEUE_PUSH refused"));
  EXPECT_EQ(protocol_->stats().refused_quota, 1u);
  EXPECT_EQ(quotas.Used(owner, Quota::kConnections), 0u);
  Restart({});  // Before `quotas` goes.
}

TEST_F(SessionTest, TheQueueBoundCountsWhatTheStoreHolds) {
  Restart({.max_queue_bytes_total = 10});
  ASSERT_TRUE(store_->QueuePush("/q", "123456").ok());
  Client& c = Validated();
  Send(c, Req(k21, Op::kQueuePush, "/q", "1234"));
  EXPECT_FALSE(Closed(c));
  Send(c, Req(k21, Op::kQueuePush, "/q", "1"));
  EXPECT_TRUE(absl::StrContains(Why(c).why, "--tcpstore_max_queue_bytes=10"));
}

TEST(TcpStorePrefixTest, PrefixesThatReachTheReservedNamespaceAreRefused) {
  for (const char* prefix :
       {"/cohort/runs/", "/cohort/", "/cohort", "/co", "/"}) {
    absl::Status s = CheckTcpStorePrefix(prefix);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << prefix;
    EXPECT_TRUE(absl::StrContains(s.message(), "reserved")) << s;
  }
  for (const char* prefix : {"", "/cohortrun/", "/cohorts/", "torch/"}) {
    EXPECT_TRUE(CheckTcpStorePrefix(prefix).ok()) << prefix;
  }
}

// ---- requests split across reads ----

// A conversation touching every kind of step: the hello, the dialect, a
// batched write, reads, a queue, a wait that is already over.
std::string Conversation() {
  // Request holds views: the 40-byte value must outlive the encoding.
  const std::string long_value(40, 'y');
  Request multi_set;
  multi_set.op = Op::kMultiSet;
  multi_set.keys = {"/m1", "/m2"};
  multi_set.values = {"x", long_value};
  return Hello("/ns/") + Validate() + Req(k21, Op::kSet, "/k", "value") +
         Number(k21, Op::kAdd, "/n", 3) + Req(k21, Op::kGet, "/k") +
         Req(k21, multi_set) + KeysReq(k21, Op::kMultiGet, {"/m1", "/m2"}) +
         Req(k21, Op::kQueuePush, "/q", "item") +
         KeysReq(k21, Op::kWait, {"/q"}) + Req(k21, Op::kQueuePop, "/q") +
         Req(k21, Op::kListKeys) + Word(k21, Op::kPing, 42);
}

TEST_F(SessionTest, ARequestSplitAtAnyByteGetsTheSameReplies) {
  const std::string bytes = Conversation();
  Client& whole = Connect();
  const std::string expected = Send(whole, bytes);
  ASSERT_FALSE(Closed(whole));
  ASSERT_EQ(whole.in, "");
  ASSERT_TRUE(absl::EndsWith(expected, U32(42)));
  for (size_t cut = 1; cut < bytes.size(); ++cut) {
    Restart({});
    Client& c = Connect();
    std::string got = Send(c, bytes.substr(0, cut));
    got += Send(c, bytes.substr(cut));
    EXPECT_EQ(got, expected) << "cut at " << cut;
    EXPECT_FALSE(Closed(c)) << "cut at " << cut;
    EXPECT_EQ(c.in, "") << "cut at " << cut;
  }
}

TEST_F(SessionTest, OneByteAtATimeGetsTheSameReplies) {
  const std::string bytes = Conversation();
  Client& whole = Connect();
  const std::string expected = Send(whole, bytes);
  Restart({});
  Client& c = Connect();
  std::string got;
  for (char ch : bytes) got += Send(c, std::string(1, ch));
  EXPECT_EQ(got, expected);
}

TEST_F(SessionTest, NextSaysHowManyBytesItNeeds) {
  Client& c = Validated();
  const std::string set = Req(k21, Op::kSet, "/key", "value");
  for (size_t n = 1; n < set.size(); ++n) {
    const TcpStoreSession::Step step = c.session.Next(set.substr(0, n));
    EXPECT_EQ(step.progress, Progress::kStopped) << n;
    EXPECT_EQ(step.used, 0u) << n;
    EXPECT_GT(step.need, n) << n;
    EXPECT_LE(step.need, set.size()) << n;
  }
  const TcpStoreSession::Step step = c.session.Next(set);
  EXPECT_EQ(step.progress, Progress::kRequest);
  EXPECT_EQ(step.used, set.size());
}

}  // namespace
}  // namespace cohort::server
