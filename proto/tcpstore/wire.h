// The wire format of PyTorch's c10d TCPStore, for cohortd's TCPStore
// listener (server/) and cohort::TcpStoreClient (client/).
//
// A request is one query-type byte followed by its fields, with no framing:
// integers are little-endian (c10d copies them in host order, and every host
// it runs on is little-endian), a string is a u64 length and its bytes, and a
// key list is a u64 count and that many strings. Replies come back in request
// order; SET, APPEND, MULTI_SET, QUEUE_PUSH and VALIDATE have none, and a
// WAIT's or BARRIER's reply may come much later.
//
// The query-type codes changed between releases, so each connection speaks
// one of two dialects, told apart by its first bytes (DetectDialect):
//   kTorch113: PyTorch 1.13 and 2.0. No handshake; SET=0 ... DELETE_KEY=8,
//              with WATCH_KEY=7 (which cohortd refuses).
//   kTorch21:  PyTorch 2.1 and later. The connection opens with VALIDATE
//              (code 0, u32 magic 0x3C85F7CE); codes run VALIDATE=0 ...
//              BARRIER=18.
//
// Before either, a connection may open with cohort's namespace hello, which
// no torch client sends (a 1.13 request starts with a query code of 0 to 8,
// a 2.1+ connection with VALIDATE=0):
//
//   0xC0 'N' 'S' '1'   magic
//   u32 L              little-endian length of the namespace
//   L bytes            the namespace
//
// The namespace is non-empty, starts and ends with "/", is at most
// kMaxNamespaceBytes long and is not in cohortd's reserved namespace
// (c10d::kReservedPrefix). cohortd then reads every key of the connection
// as the namespace followed by the key the client sent, so the connection
// sees only the keys under it (cohortrun's node proxy binds each job's
// workers to /cohortrun/<run id>/<round>/ this way). The dialect is then
// told from the bytes that follow, as above.
//
// A cohortd with tokens (--auth_tokens) takes the hello with a token, whose
// grant must cover the namespace:
//
//   0xC0 'N' 'S' '2'   magic
//   u32 L, L bytes     the namespace, as above
//   u32 T, T bytes     the token (1 to kMaxHelloTokenBytes)
#ifndef COHORT_PROTO_TCPSTORE_WIRE_H_
#define COHORT_PROTO_TCPSTORE_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "proto/c10d/rules.h"

namespace cohort::tcpstore {

enum class Dialect : uint8_t { kTorch113, kTorch21 };
absl::string_view DialectName(Dialect dialect);

inline constexpr uint32_t kValidateMagic = 0x3C85F7CE;

// Every query either dialect knows, by meaning; OpCode/OpFromCode map them
// to and from each dialect's bytes.
enum class Op : uint8_t {
  kValidate,    // u32 magic; no reply.                          (2.1+)
  kSet,         // key, value; no reply.
  kCompareSet,  // key, expected, desired -> bytes.
  kGet,         // key -> bytes.
  kAdd,         // key, i64 delta -> i64 new value.
  kCheck,       // keys -> u8 CheckReply.
  kWait,        // keys -> u8 WaitReply::kStopWaiting, when all exist.
  kNumKeys,     // -> i64.
  kWatchKey,    // key; 1.13 only, refused by cohortd.
  kDeleteKey,   // key -> i64 number deleted.
  kAppend,      // key, value; no reply.                         (2.1+)
  kMultiGet,    // keys -> one bytes per key.                    (2.1+)
  kMultiSet,    // u64 n, n x (key, value); no reply.            (2.1+)
  kCancelWait,  // -> u8 WaitReply::kWaitCanceled.               (2.1+)
  kPing,        // u32 nonce -> u32 nonce.                       (2.1+)
  kQueuePush,   // key, value; no reply.                         (2.1+)
  kQueuePop,    // key -> i64 length before the pop, then bytes if > 0.
  kQueueLen,    // key -> i64.                                   (2.1+)
  kListKeys,    // -> i64 count, then count strings.             (2.1+)
  kBarrier,     // key, i64 world size -> u8 kStopWaiting once the counter
                // at key (which it increments) reaches it.      (2.1+)
};
absl::string_view OpName(Op op);

// The byte `op` is sent as in `dialect`, or nullopt if it has none there.
std::optional<uint8_t> OpCode(Dialect dialect, Op op);
std::optional<Op> OpFromCode(Dialect dialect, uint8_t code);

enum class CheckReply : uint8_t { kReady = 0, kNotReady = 1 };
enum class WaitReply : uint8_t { kStopWaiting = 0, kWaitCanceled = 1 };

// The dialect a connection speaks, from the first bytes it sent; nullopt
// until enough have arrived to tell (at most 5). A 2.1+ client always
// starts with VALIDATE; a 1.13 SET also starts with byte 0, but its key
// length could never begin with the magic's bytes and stay under any limit.
std::optional<Dialect> DetectDialect(absl::string_view first_bytes);

inline constexpr char kNamespaceHelloMagic[4] = {'\xC0', 'N', 'S', '1'};
inline constexpr size_t kMaxNamespaceBytes = 1024;
inline constexpr char kTokenHelloMagic[4] = {'\xC0', 'N', 'S', '2'};
inline constexpr size_t kMaxHelloTokenBytes = 4096;

// Whether a connection whose first byte is `first_byte` opens with a
// namespace hello (and not a torch request).
inline bool IsNamespaceHello(char first_byte) {
  return first_byte == kNamespaceHelloMagic[0];
}

// OK, or INVALID_ARGUMENT saying which rule of the hello above `name_space`
// breaks.
absl::Status CheckNamespace(absl::string_view name_space);

// Appends the hello binding `name_space`, with `token` when it is not
// empty. REQUIRES: CheckNamespace is OK, token at most kMaxHelloTokenBytes.
void EncodeNamespaceHello(absl::string_view name_space, std::string* out,
                          absl::string_view token = "");

// Sizes a request may have; anything larger is refused before it is
// buffered, so a bad length prefix costs no memory. Keys, values and keys
// per request are c10d's limits (proto/c10d/rules.h), the ones the store
// behind the protocol enforces.
struct Limits : c10d::Limits {
  // The most bytes one request may take on the wire (a MULTI_SET of many
  // values, say).
  size_t max_request_bytes = 64 << 20;
};

// One request, its strings pointing into the bytes it was parsed from.
struct Request {
  Op op = Op::kSet;
  absl::string_view key;       // Single-key queries.
  absl::string_view value;     // SET, APPEND, QUEUE_PUSH; COMPARE_SET desired.
  absl::string_view expected;  // COMPARE_SET.
  std::vector<absl::string_view> keys;    // CHECK, WAIT, MULTI_GET, MULTI_SET.
  std::vector<absl::string_view> values;  // MULTI_SET, one per key.
  int64_t number = 0;                     // ADD delta, BARRIER world size.
  uint32_t word = 0;                      // VALIDATE magic, PING nonce.
};

enum class ParseStatus { kComplete, kIncomplete, kInvalid };
struct ParseResult {
  ParseStatus status = ParseStatus::kIncomplete;
  // kComplete: the request's size in bytes. kIncomplete: the fewest bytes
  // the request can take given what has arrived (parse again once that
  // many are buffered).
  size_t size = 0;
  std::string error;  // kInvalid: what was wrong, for a log line.
};

// Parses the request at the start of `bytes`. Never reads past `bytes`, and
// rejects (kInvalid) an unknown query type or a length or count over
// `limits` as soon as its prefix arrives.
ParseResult ParseRequest(Dialect dialect, absl::string_view bytes,
                         const Limits& limits, Request* request);

// Parses the namespace hello at the start of `bytes` as ParseRequest
// parses a request: kComplete with its size and *name_space pointing into
// `bytes`; kIncomplete with the fewest bytes it can take; kInvalid, as soon
// as the magic, the length or the namespace shows it, with the reason.
// *token is set to the token of a hello that carries one, else emptied.
ParseResult ParseNamespaceHello(absl::string_view bytes,
                                absl::string_view* name_space,
                                absl::string_view* token = nullptr);

// Appends `request` as `dialect` sends it. REQUIRES: OpCode(dialect, op).
void EncodeRequest(Dialect dialect, const Request& request, std::string* out);

// Appends values in wire encoding (replies, and requests by hand in tests).
class Encoder {
 public:
  explicit Encoder(std::string* out) : out_(out) {}
  void U8(uint8_t v) { out_->push_back(static_cast<char>(v)); }
  void U32(uint32_t v);
  void U64(uint64_t v);
  void I64(int64_t v) { U64(static_cast<uint64_t>(v)); }
  void Bytes(absl::string_view bytes);  // u64 length, then the bytes.

 private:
  std::string* out_;
};

// Reads values in wire encoding from a buffer. Each read returns false,
// consuming nothing, when the buffer is too short; needed() then says how
// long it must be.
class Decoder {
 public:
  explicit Decoder(absl::string_view bytes) : bytes_(bytes) {}
  bool U8(uint8_t* v);
  bool U32(uint32_t* v);
  bool U64(uint64_t* v);
  bool I64(int64_t* v);
  // A length-prefixed string of at most `max` bytes. When the prefix is
  // over it, returns false and sets *over (if given) to the prefix.
  bool Bytes(size_t max, absl::string_view* v, uint64_t* over = nullptr);
  size_t consumed() const { return pos_; }
  size_t needed() const { return needed_; }

 private:
  bool Take(size_t n, const char** p);
  absl::string_view bytes_;
  size_t pos_ = 0;
  size_t needed_ = 0;
};

}  // namespace cohort::tcpstore

#endif  // COHORT_PROTO_TCPSTORE_WIRE_H_
