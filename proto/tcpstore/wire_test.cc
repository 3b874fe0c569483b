#include "proto/tcpstore/wire.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace cohort::tcpstore {
namespace {

std::string Bytes(std::initializer_list<int> bytes) {
  std::string s;
  for (int b : bytes) s.push_back(static_cast<char>(b));
  return s;
}

TEST(WireTest, CodesOfBothDialects) {
  EXPECT_EQ(OpCode(Dialect::kTorch113, Op::kSet), 0);
  EXPECT_EQ(OpCode(Dialect::kTorch113, Op::kWatchKey), 7);
  EXPECT_EQ(OpCode(Dialect::kTorch113, Op::kDeleteKey), 8);
  EXPECT_EQ(OpCode(Dialect::kTorch113, Op::kAppend), std::nullopt);
  EXPECT_EQ(OpCode(Dialect::kTorch21, Op::kValidate), 0);
  EXPECT_EQ(OpCode(Dialect::kTorch21, Op::kSet), 1);
  EXPECT_EQ(OpCode(Dialect::kTorch21, Op::kDeleteKey), 8);
  EXPECT_EQ(OpCode(Dialect::kTorch21, Op::kCancelWait), 12);
  EXPECT_EQ(OpCode(Dialect::kTorch21, Op::kPing), 13);
  EXPECT_EQ(OpCode(Dialect::kTorch21, Op::kBarrier), 18);
  EXPECT_EQ(OpCode(Dialect::kTorch21, Op::kWatchKey), std::nullopt);
  EXPECT_EQ(OpFromCode(Dialect::kTorch21, 19), std::nullopt);
  EXPECT_EQ(OpFromCode(Dialect::kTorch113, 9), std::nullopt);
}

TEST(WireTest, DetectsDialectFromFirstBytes) {
  EXPECT_EQ(DetectDialect(""), std::nullopt);
  EXPECT_EQ(DetectDialect(Bytes({3})), Dialect::kTorch113);  // 1.13 ADD
  EXPECT_EQ(DetectDialect(Bytes({0, 0xCE, 0xF7})), std::nullopt);
  EXPECT_EQ(DetectDialect(Bytes({0, 0xCE, 0xF7, 0x85, 0x3C})),
            Dialect::kTorch21);
  // A 1.13 SET of a 4-byte key: byte 0, then a u64 length of 4.
  EXPECT_EQ(DetectDialect(Bytes({0, 4, 0, 0, 0})), Dialect::kTorch113);
  EXPECT_EQ(DetectDialect("GET / HTTP/1.1\r\n"), Dialect::kTorch113);
}

TEST(WireTest, ParsesWhatItEncodesInBothDialects) {
  const std::string binary("v\0w", 3);
  Request set;
  set.op = Op::kSet;
  set.key = "/k";
  set.value = binary;
  Request multi;
  multi.op = Op::kMultiSet;
  multi.keys = {"/a", "/b"};
  multi.values = {"1", ""};
  Request add;
  add.op = Op::kAdd;
  add.key = "/c";
  add.number = -5;
  for (Dialect dialect : {Dialect::kTorch113, Dialect::kTorch21}) {
    for (const Request* r : {&set, &multi, &add}) {
      if (!OpCode(dialect, r->op)) continue;
      std::string wire;
      EncodeRequest(dialect, *r, &wire);
      wire += "tail";
      Request parsed;
      ParseResult result = ParseRequest(dialect, wire, Limits(), &parsed);
      ASSERT_EQ(result.status, ParseStatus::kComplete) << result.error;
      EXPECT_EQ(result.size, wire.size() - 4);
      EXPECT_EQ(parsed.op, r->op);
      EXPECT_EQ(parsed.key, r->key);
      EXPECT_EQ(parsed.value, r->value);
      EXPECT_EQ(parsed.keys, r->keys);
      EXPECT_EQ(parsed.values, r->values);
      EXPECT_EQ(parsed.number, r->number);
      // Every proper prefix is incomplete, and says how much more it needs.
      for (size_t n = 0; n < result.size; ++n) {
        ParseResult partial =
            ParseRequest(dialect, wire.substr(0, n), Limits(), &parsed);
        ASSERT_EQ(partial.status, ParseStatus::kIncomplete) << n;
        EXPECT_GT(partial.size, n);
        EXPECT_LE(partial.size, result.size);
      }
    }
  }
}

TEST(WireTest, WireBytesOfA21Set) {
  Request r;
  r.op = Op::kSet;
  r.key = "/k";
  r.value = "v";
  std::string wire;
  EncodeRequest(Dialect::kTorch21, r, &wire);
  EXPECT_EQ(wire, Bytes({1,   2, 0, 0, 0, 0, 0, 0, 0, '/',
                         'k', 1, 0, 0, 0, 0, 0, 0, 0, 'v'}));
}

TEST(WireTest, RefusesAbsurdLengthsBeforeBuffering) {
  Request r;
  // SET with a key length of 2^60: refused from its 9 bytes.
  std::string wire = Bytes({0, 0, 0, 0, 0, 0, 0, 0, 0x10});
  ParseResult result = ParseRequest(Dialect::kTorch113, wire, Limits(), &r);
  EXPECT_EQ(result.status, ParseStatus::kInvalid);
  EXPECT_NE(result.error.find("over max_key_bytes"), std::string::npos)
      << result.error;
  // WAIT naming 2^40 keys.
  wire = Bytes({5, 0, 0, 0, 0, 0, 1, 0, 0});
  result = ParseRequest(Dialect::kTorch113, wire, Limits(), &r);
  EXPECT_EQ(result.status, ParseStatus::kInvalid);
  EXPECT_NE(result.error.find("max_keys_per_call"), std::string::npos);
  // A value just over the limit.
  Limits small;
  small.max_value_bytes = 3;
  Request set;
  set.op = Op::kSet;
  set.key = "/k";
  set.value = "four";
  wire.clear();
  EncodeRequest(Dialect::kTorch21, set, &wire);
  result = ParseRequest(Dialect::kTorch21, wire, small, &r);
  EXPECT_EQ(result.status, ParseStatus::kInvalid);
  EXPECT_NE(result.error.find("max_value_bytes"), std::string::npos);
  // Many values each under the limit, but more than max_request_bytes.
  small = Limits();
  small.max_request_bytes = 100;
  Request multi;
  multi.op = Op::kMultiSet;
  std::string big(60, 'x');
  multi.keys = {"/a", "/b"};
  multi.values = {big, big};
  wire.clear();
  EncodeRequest(Dialect::kTorch21, multi, &wire);
  result = ParseRequest(Dialect::kTorch21, wire, small, &r);
  EXPECT_EQ(result.status, ParseStatus::kInvalid);
  EXPECT_NE(result.error.find("max_request_bytes"), std::string::npos);
}

TEST(WireTest, UnknownQueryTypes) {
  Request r;
  ParseResult result =
      ParseRequest(Dialect::kTorch113, Bytes({9}), Limits(), &r);
  EXPECT_EQ(result.status, ParseStatus::kInvalid);
  EXPECT_NE(result.error.find("unknown query type 9"), std::string::npos);
  result = ParseRequest(Dialect::kTorch21, "GET / HTTP/1.1", Limits(), &r);
  EXPECT_EQ(result.status, ParseStatus::kInvalid);
}

TEST(WireTest, NamespaceHelloRoundTripsAndNeverLooksLikeTorch) {
  std::string wire;
  EncodeNamespaceHello("/cohortrun/job/0/", &wire);
  EXPECT_EQ(wire.substr(0, 8), Bytes({0xC0, 'N', 'S', '1', 17, 0, 0, 0}));
  Request set;
  set.op = Op::kSet;
  set.key = "/k";
  EncodeRequest(Dialect::kTorch21, set, &wire);  // Torch bytes follow.
  absl::string_view name_space;
  ParseResult result = ParseNamespaceHello(wire, &name_space);
  ASSERT_EQ(result.status, ParseStatus::kComplete) << result.error;
  EXPECT_EQ(result.size, 8u + 17u);
  EXPECT_EQ(name_space, "/cohortrun/job/0/");
  for (size_t n = 0; n < result.size; ++n) {
    ParseResult partial =
        ParseNamespaceHello(absl::string_view(wire).substr(0, n), &name_space);
    ASSERT_EQ(partial.status, ParseStatus::kIncomplete) << n;
    EXPECT_GT(partial.size, n);
    EXPECT_LE(partial.size, result.size);
  }
  // No torch request of either dialect starts with the hello's first byte.
  EXPECT_TRUE(IsNamespaceHello(wire[0]));
  for (int code = 0; code < 256; ++code) {
    if (OpFromCode(Dialect::kTorch113, code) ||
        OpFromCode(Dialect::kTorch21, code)) {
      EXPECT_FALSE(IsNamespaceHello(static_cast<char>(code))) << code;
    }
  }
}

TEST(WireTest, TokenHelloRoundTrips) {
  std::string wire;
  EncodeNamespaceHello("/cohortrun/job/0/", &wire, "tok-0123456789abcdef");
  EXPECT_EQ(wire.substr(0, 4), Bytes({0xC0, 'N', 'S', '2'}));
  absl::string_view name_space, token;
  ParseResult result = ParseNamespaceHello(wire, &name_space, &token);
  ASSERT_EQ(result.status, ParseStatus::kComplete) << result.error;
  EXPECT_EQ(result.size, wire.size());
  EXPECT_EQ(name_space, "/cohortrun/job/0/");
  EXPECT_EQ(token, "tok-0123456789abcdef");
  for (size_t n = 0; n < result.size; ++n) {
    ParseResult partial = ParseNamespaceHello(
        absl::string_view(wire).substr(0, n), &name_space, &token);
    ASSERT_EQ(partial.status, ParseStatus::kIncomplete) << n;
    EXPECT_GT(partial.size, n);
    EXPECT_LE(partial.size, result.size);
  }
  // A plain hello carries none.
  std::string plain;
  EncodeNamespaceHello("/ns/", &plain);
  ASSERT_EQ(ParseNamespaceHello(plain, &name_space, &token).status,
            ParseStatus::kComplete);
  EXPECT_TRUE(token.empty());
  // An absurd token length is refused from the bytes announcing it.
  std::string absurd(kTokenHelloMagic, 4);
  Encoder(&absurd).U32(4);
  absurd.append("/ns/");
  Encoder(&absurd).U32(1 << 20);
  ParseResult bad = ParseNamespaceHello(absurd, &name_space, &token);
  EXPECT_EQ(bad.status, ParseStatus::kInvalid);
  EXPECT_NE(bad.error.find("hello token of 1048576 bytes"), std::string::npos)
      << bad.error;
}

TEST(WireTest, BadNamespaceHellos) {
  auto hello = [](absl::string_view name_space) {
    std::string wire(kNamespaceHelloMagic, 4);
    Encoder(&wire).U32(name_space.size());
    wire.append(name_space.data(), name_space.size());
    return wire;
  };
  struct Case {
    std::string bytes;
    std::string error;
  };
  const std::vector<Case> cases = {
      {Bytes({0xC0, 'X'}), "bad namespace hello magic"},
      {hello(""), "of 0 bytes"},
      {hello("job/"), "must start and end with \"/\""},
      {hello("/job"), "must start and end with \"/\""},
      {hello("/cohort/runs/"), "reserved namespace \"/cohort/\""},
      // An absurd length is refused from the 8 bytes that announce it.
      {Bytes({0xC0, 'N', 'S', '1', 0xFF, 0xFF, 0xFF, 0x7F}),
       "of 2147483647 bytes (must be 1 to 1024)"},
      {hello("/" + std::string(1023, 'x') + "/"), "of 1025 bytes"},
  };
  for (const Case& c : cases) {
    absl::string_view name_space;
    ParseResult result = ParseNamespaceHello(c.bytes, &name_space);
    EXPECT_EQ(result.status, ParseStatus::kInvalid) << c.error;
    EXPECT_NE(result.error.find(c.error), std::string::npos) << result.error;
  }
  EXPECT_TRUE(CheckNamespace("/").ok());
  EXPECT_TRUE(CheckNamespace("/" + std::string(1022, 'x') + "/").ok());
  EXPECT_FALSE(CheckNamespace("/" + std::string(1023, 'x') + "/").ok());
  EXPECT_TRUE(CheckNamespace("/cohortrun/a b\x01/7/").ok());
  EXPECT_FALSE(CheckNamespace("/cohort/").ok());
}

}  // namespace
}  // namespace cohort::tcpstore
