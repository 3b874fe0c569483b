#include "proto/tcpstore/wire.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/text.h"

namespace cohort::tcpstore {
namespace {

// Wire codes, indexed by code; the position in each table is the byte.
constexpr Op kTorch113Codes[] = {
    Op::kSet,  Op::kCompareSet, Op::kGet,      Op::kAdd,       Op::kCheck,
    Op::kWait, Op::kNumKeys,    Op::kWatchKey, Op::kDeleteKey,
};
constexpr Op kTorch21Codes[] = {
    Op::kValidate,   Op::kSet,      Op::kCompareSet, Op::kGet,
    Op::kAdd,        Op::kCheck,    Op::kWait,       Op::kNumKeys,
    Op::kDeleteKey,  Op::kAppend,   Op::kMultiGet,   Op::kMultiSet,
    Op::kCancelWait, Op::kPing,     Op::kQueuePush,  Op::kQueuePop,
    Op::kQueueLen,   Op::kListKeys, Op::kBarrier,
};

template <size_t N>
std::optional<uint8_t> Find(const Op (&table)[N], Op op) {
  for (size_t i = 0; i < N; ++i) {
    if (table[i] == op) return static_cast<uint8_t>(i);
  }
  return std::nullopt;
}

// Parses the fields of `request->op`, whose type byte `d` has consumed.
// Returns false when a field is missing (incomplete) or bad (*error set).
class FieldParser {
 public:
  FieldParser(Decoder& d, const Limits& limits, Request* request,
              std::string* error)
      : d_(d), limits_(limits), r_(request), error_(error) {}

  bool Parse() {
    switch (r_->op) {
      case Op::kValidate:
      case Op::kPing:
        return d_.U32(&r_->word);
      case Op::kSet:
      case Op::kAppend:
      case Op::kQueuePush:
        return Key(&r_->key) && Value(&r_->value);
      case Op::kCompareSet:
        return Key(&r_->key) && Value(&r_->expected) && Value(&r_->value);
      case Op::kGet:
      case Op::kWatchKey:
      case Op::kDeleteKey:
      case Op::kQueuePop:
      case Op::kQueueLen:
        return Key(&r_->key);
      case Op::kAdd:
      case Op::kBarrier:
        return Key(&r_->key) && d_.I64(&r_->number);
      case Op::kCheck:
      case Op::kWait:
      case Op::kMultiGet:
        return KeyList(/*with_values=*/false);
      case Op::kMultiSet:
        return KeyList(/*with_values=*/true);
      case Op::kNumKeys:
      case Op::kCancelWait:
      case Op::kListKeys:
        return true;
    }
    return false;
  }

 private:
  bool Key(absl::string_view* key) {
    return String(limits_.max_key_bytes, "key", "max_key_bytes", key);
  }
  bool Value(absl::string_view* value) {
    return String(limits_.max_value_bytes, "value", "max_value_bytes", value);
  }
  bool String(size_t max, absl::string_view what, absl::string_view limit,
              absl::string_view* out) {
    uint64_t over = 0;
    if (d_.Bytes(max, out, &over)) return true;
    if (over != 0) {
      *error_ = absl::StrCat(OpName(r_->op), ": ", what, " length prefix ",
                             over, " is over ", limit, " (", max, " bytes)");
    }
    return false;
  }
  bool KeyList(bool with_values) {
    uint64_t count = 0;
    if (!d_.U64(&count)) return false;
    if (count > limits_.max_keys_per_call) {
      *error_ = absl::StrCat(OpName(r_->op), " names ", count,
                             " keys, over max_keys_per_call (",
                             limits_.max_keys_per_call, ")");
      return false;
    }
    // Each key takes at least its 8-byte length, so a count that cannot fit
    // in max_request_bytes is refused before anything is reserved for it.
    if (count * (with_values ? 16 : 8) > limits_.max_request_bytes) {
      *error_ = absl::StrCat(OpName(r_->op), " names ", count,
                             " keys, more than fit in max_request_bytes (",
                             limits_.max_request_bytes, ")");
      return false;
    }
    r_->keys.reserve(count);
    if (with_values) r_->values.reserve(count);
    for (uint64_t i = 0; i < count; ++i) {
      absl::string_view key, value;
      if (!Key(&key)) return false;
      r_->keys.push_back(key);
      if (with_values) {
        if (!Value(&value)) return false;
        r_->values.push_back(value);
      }
    }
    return true;
  }

  Decoder& d_;
  const Limits& limits_;
  Request* r_;
  std::string* error_;
};

}  // namespace

absl::string_view DialectName(Dialect dialect) {
  return dialect == Dialect::kTorch113 ? "PyTorch 1.13/2.0" : "PyTorch 2.1+";
}

absl::string_view OpName(Op op) {
  switch (op) {
    case Op::kValidate:
      return "VALIDATE";
    case Op::kSet:
      return "SET";
    case Op::kCompareSet:
      return "COMPARE_SET";
    case Op::kGet:
      return "GET";
    case Op::kAdd:
      return "ADD";
    case Op::kCheck:
      return "CHECK";
    case Op::kWait:
      return "WAIT";
    case Op::kNumKeys:
      return "GETNUMKEYS";
    case Op::kWatchKey:
      return "WATCH_KEY";
    case Op::kDeleteKey:
      return "DELETE_KEY";
    case Op::kAppend:
      return "APPEND";
    case Op::kMultiGet:
      return "MULTI_GET";
    case Op::kMultiSet:
      return "MULTI_SET";
    case Op::kCancelWait:
      return "CANCEL_WAIT";
    case Op::kPing:
      return "PING";
    case Op::kQueuePush:
      return "QUEUE_PUSH";
    case Op::kQueuePop:
      return "QUEUE_POP";
    case Op::kQueueLen:
      return "QUEUE_LEN";
    case Op::kListKeys:
      return "LIST_KEYS";
    case Op::kBarrier:
      return "BARRIER";
  }
  return "?";
}

std::optional<uint8_t> OpCode(Dialect dialect, Op op) {
  return dialect == Dialect::kTorch113 ? Find(kTorch113Codes, op)
                                       : Find(kTorch21Codes, op);
}

std::optional<Op> OpFromCode(Dialect dialect, uint8_t code) {
  if (dialect == Dialect::kTorch113) {
    if (code < std::size(kTorch113Codes)) return kTorch113Codes[code];
  } else if (code < std::size(kTorch21Codes)) {
    return kTorch21Codes[code];
  }
  return std::nullopt;
}

std::optional<Dialect> DetectDialect(absl::string_view first_bytes) {
  if (first_bytes.empty()) return std::nullopt;
  if (first_bytes[0] != 0) return Dialect::kTorch113;
  std::string validate;
  Encoder(&validate).U8(0);
  Encoder(&validate).U32(kValidateMagic);
  const size_t n = std::min(first_bytes.size(), validate.size());
  if (first_bytes.substr(0, n) != absl::string_view(validate).substr(0, n)) {
    return Dialect::kTorch113;
  }
  if (n < validate.size()) return std::nullopt;
  return Dialect::kTorch21;
}

ParseResult ParseRequest(Dialect dialect, absl::string_view bytes,
                         const Limits& limits, Request* request) {
  ParseResult result;
  Decoder d(bytes);
  uint8_t code = 0;
  if (!d.U8(&code)) {
    result.size = 1;
    return result;
  }
  std::optional<Op> op = OpFromCode(dialect, code);
  if (!op.has_value()) {
    result.status = ParseStatus::kInvalid;
    result.error = absl::StrCat("unknown query type ", code, " for the ",
                                DialectName(dialect), " protocol");
    return result;
  }
  *request = Request();
  request->op = *op;
  FieldParser fields(d, limits, request, &result.error);
  if (fields.Parse() && d.consumed() <= limits.max_request_bytes) {
    result.status = ParseStatus::kComplete;
    result.size = d.consumed();
    return result;
  }
  if (!result.error.empty()) {
    result.status = ParseStatus::kInvalid;
    return result;
  }
  const size_t needed = std::max(d.needed(), d.consumed());
  if (needed > limits.max_request_bytes) {
    result.status = ParseStatus::kInvalid;
    result.error = absl::StrCat(OpName(*op), " takes at least ", needed,
                                " bytes, over max_request_bytes (",
                                limits.max_request_bytes, ")");
    return result;
  }
  result.size = needed;
  return result;
}

absl::Status CheckNamespace(absl::string_view name_space) {
  if (name_space.empty()) {
    return absl::InvalidArgumentError("the namespace is empty");
  }
  if (name_space.size() > kMaxNamespaceBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("the namespace is ", name_space.size(), " bytes, over ",
                     kMaxNamespaceBytes));
  }
  if (name_space.front() != '/' || name_space.back() != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("namespace ", base::Quote(name_space),
                     " must start and end with \"/\""));
  }
  if (absl::StartsWith(name_space, c10d::kReservedPrefix)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "namespace ", base::Quote(name_space),
        " is in cohortd's reserved namespace \"", c10d::kReservedPrefix, "\""));
  }
  return absl::OkStatus();
}

void EncodeNamespaceHello(absl::string_view name_space, std::string* out,
                          absl::string_view token) {
  const char* magic = token.empty() ? kNamespaceHelloMagic : kTokenHelloMagic;
  out->append(magic, sizeof(kNamespaceHelloMagic));
  Encoder(out).U32(static_cast<uint32_t>(name_space.size()));
  out->append(name_space.data(), name_space.size());
  if (!token.empty()) {
    Encoder(out).U32(static_cast<uint32_t>(token.size()));
    out->append(token.data(), token.size());
  }
}

ParseResult ParseNamespaceHello(absl::string_view bytes,
                                absl::string_view* name_space,
                                absl::string_view* token) {
  ParseResult result;
  if (token != nullptr) *token = absl::string_view();
  const absl::string_view magic(kNamespaceHelloMagic,
                                sizeof(kNamespaceHelloMagic));
  const absl::string_view token_magic(kTokenHelloMagic,
                                      sizeof(kTokenHelloMagic));
  const size_t n = std::min(bytes.size(), magic.size());
  const bool plain = bytes.substr(0, n) == magic.substr(0, n);
  const bool with_token = bytes.substr(0, n) == token_magic.substr(0, n);
  if (!plain && !with_token) {
    result.status = ParseStatus::kInvalid;
    result.error = absl::StrCat("bad namespace hello magic \"",
                                absl::CHexEscape(bytes.substr(0, n)), "\"");
    return result;
  }
  Decoder d(bytes.substr(n));
  uint32_t length = 0;
  if (n < magic.size() || !d.U32(&length)) {
    result.size = magic.size() + 4;
    return result;
  }
  if (length == 0 || length > kMaxNamespaceBytes) {
    result.status = ParseStatus::kInvalid;
    result.error =
        absl::StrCat("namespace hello of ", length, " bytes (must be 1 to ",
                     kMaxNamespaceBytes, ")");
    return result;
  }
  result.size = magic.size() + 4 + length;
  if (bytes.size() < result.size) return result;
  *name_space = bytes.substr(magic.size() + 4, length);
  if (absl::Status s = CheckNamespace(*name_space); !s.ok()) {
    result.status = ParseStatus::kInvalid;
    result.error = std::string(s.message());
    return result;
  }
  if (!plain) {
    // The token after the namespace.
    Decoder t(bytes.substr(result.size));
    uint32_t token_length = 0;
    if (!t.U32(&token_length)) {
      result.size += 4;
      return result;
    }
    if (token_length == 0 || token_length > kMaxHelloTokenBytes) {
      result.status = ParseStatus::kInvalid;
      result.error = absl::StrCat("hello token of ", token_length,
                                  " bytes (must be 1 to ",
                                  kMaxHelloTokenBytes, ")");
      return result;
    }
    const size_t token_at = result.size + 4;
    result.size = token_at + token_length;
    if (bytes.size() < result.size) return result;
    if (token != nullptr) *token = bytes.substr(token_at, token_length);
  }
  result.status = ParseStatus::kComplete;
  return result;
}

void EncodeRequest(Dialect dialect, const Request& r, std::string* out) {
  Encoder e(out);
  e.U8(*OpCode(dialect, r.op));
  switch (r.op) {
    case Op::kValidate:
    case Op::kPing:
      e.U32(r.word);
      break;
    case Op::kSet:
    case Op::kAppend:
    case Op::kQueuePush:
      e.Bytes(r.key);
      e.Bytes(r.value);
      break;
    case Op::kCompareSet:
      e.Bytes(r.key);
      e.Bytes(r.expected);
      e.Bytes(r.value);
      break;
    case Op::kGet:
    case Op::kWatchKey:
    case Op::kDeleteKey:
    case Op::kQueuePop:
    case Op::kQueueLen:
      e.Bytes(r.key);
      break;
    case Op::kAdd:
    case Op::kBarrier:
      e.Bytes(r.key);
      e.I64(r.number);
      break;
    case Op::kCheck:
    case Op::kWait:
    case Op::kMultiGet:
      e.U64(r.keys.size());
      for (absl::string_view k : r.keys) e.Bytes(k);
      break;
    case Op::kMultiSet:
      e.U64(r.keys.size());
      for (size_t i = 0; i < r.keys.size(); ++i) {
        e.Bytes(r.keys[i]);
        e.Bytes(i < r.values.size() ? r.values[i] : absl::string_view());
      }
      break;
    case Op::kNumKeys:
    case Op::kCancelWait:
    case Op::kListKeys:
      break;
  }
}

void Encoder::U32(uint32_t v) {
  char b[4];
  for (int i = 0; i < 4; ++i) b[i] = static_cast<char>(v >> (8 * i));
  out_->append(b, 4);
}

void Encoder::U64(uint64_t v) {
  char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>(v >> (8 * i));
  out_->append(b, 8);
}

void Encoder::Bytes(absl::string_view bytes) {
  U64(bytes.size());
  out_->append(bytes.data(), bytes.size());
}

bool Decoder::Take(size_t n, const char** p) {
  if (bytes_.size() - pos_ < n) {
    needed_ = pos_ + n;
    return false;
  }
  *p = bytes_.data() + pos_;
  pos_ += n;
  return true;
}

bool Decoder::U8(uint8_t* v) {
  const char* p;
  if (!Take(1, &p)) return false;
  *v = static_cast<uint8_t>(*p);
  return true;
}

bool Decoder::U32(uint32_t* v) {
  const char* p;
  if (!Take(4, &p)) return false;
  uint32_t x = 0;
  for (int i = 3; i >= 0; --i) x = (x << 8) | static_cast<uint8_t>(p[i]);
  *v = x;
  return true;
}

bool Decoder::U64(uint64_t* v) {
  const char* p;
  if (!Take(8, &p)) return false;
  uint64_t x = 0;
  for (int i = 7; i >= 0; --i) x = (x << 8) | static_cast<uint8_t>(p[i]);
  *v = x;
  return true;
}

bool Decoder::I64(int64_t* v) {
  uint64_t x;
  if (!U64(&x)) return false;
  *v = static_cast<int64_t>(x);
  return true;
}

bool Decoder::Bytes(size_t max, absl::string_view* v, uint64_t* over) {
  const size_t start = pos_;
  uint64_t length = 0;
  if (!U64(&length)) return false;
  if (length > max) {
    if (over != nullptr) *over = length;
    pos_ = start;
    return false;
  }
  const char* p;
  if (!Take(length, &p)) {
    pos_ = start;
    return false;
  }
  *v = absl::string_view(p, length);
  return true;
}

}  // namespace cohort::tcpstore
