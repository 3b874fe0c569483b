// tcpstore_wire_fuzz: the TCPStore request parser on arbitrary bytes, as
// cohortd's listener reads them from a connection.
//
// The first byte picks the dialect and the limits; the rest is the stream.
// Requests are parsed off its front one after another, and for each:
//  - a complete request takes between 1 byte and what is left, within
//    max_request_bytes, and encodes back to exactly the bytes it took
//    (so nothing is skipped or invented);
//  - parsing it again with any tail appended gives the same request;
//  - an incomplete one asks for more than is left, but no more than
//    max_request_bytes, and every shorter prefix is incomplete too;
//  - an invalid one says why.
#include <cstdint>
#include <string>

#include "proto/tcpstore/wire.h"
#include "tests/fuzz/fuzz_input.h"

namespace cohort::tcpstore {
namespace {

bool Same(const Request& a, const Request& b) {
  return a.op == b.op && a.key == b.key && a.value == b.value &&
         a.expected == b.expected && a.keys == b.keys && a.values == b.values &&
         a.number == b.number && a.word == b.word;
}

void Stream(Dialect dialect, const Limits& limits, absl::string_view data) {
  size_t pos = 0;
  while (pos < data.size()) {
    absl::string_view rest = data.substr(pos);
    Request r;
    ParseResult p = ParseRequest(dialect, rest, limits, &r);
    if (p.status == ParseStatus::kInvalid) {
      FUZZ_CHECK(!p.error.empty());
      return;
    }
    if (p.status == ParseStatus::kIncomplete) {
      FUZZ_CHECK(p.size > rest.size());
      FUZZ_CHECK(p.size <= limits.max_request_bytes);
      for (size_t cut = 0; cut < rest.size(); cut += 1 + cut / 4) {
        Request shorter;
        FUZZ_CHECK(ParseRequest(dialect, rest.substr(0, cut), limits, &shorter)
                       .status == ParseStatus::kIncomplete);
      }
      return;
    }
    FUZZ_CHECK(p.size >= 1 && p.size <= rest.size());
    FUZZ_CHECK(p.size <= limits.max_request_bytes);
    FUZZ_CHECK(OpCode(dialect, r.op).has_value());
    FUZZ_CHECK(r.key.size() <= limits.max_key_bytes);
    FUZZ_CHECK(r.value.size() <= limits.max_value_bytes);
    FUZZ_CHECK(r.keys.size() <= limits.max_keys_per_call);
    std::string encoded;
    EncodeRequest(dialect, r, &encoded);
    FUZZ_CHECK(encoded == rest.substr(0, p.size));
    std::string longer = encoded + "\x07tail";
    Request again;
    ParseResult q = ParseRequest(dialect, longer, limits, &again);
    FUZZ_CHECK(q.status == ParseStatus::kComplete && q.size == p.size);
    FUZZ_CHECK(Same(r, again));
    pos += p.size;
  }
}

}  // namespace
}  // namespace cohort::tcpstore

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cohort::tcpstore;
  if (size == 0) return 0;
  const uint8_t control = data[0];
  absl::string_view stream(reinterpret_cast<const char*>(data) + 1, size - 1);
  Limits limits;
  if (control & 2) {
    limits.max_key_bytes = 16;
    limits.max_value_bytes = 64;
    limits.max_keys_per_call = 8;
    limits.max_request_bytes = 512;
  }
  // A connection's dialect comes from its first bytes, as in the server.
  if (control & 1) {
    std::optional<Dialect> detected = DetectDialect(stream);
    FUZZ_CHECK(detected.has_value() || stream.size() < 5);
    if (!detected.has_value()) return 0;
    Stream(*detected, limits, stream);
  } else {
    Stream((control & 4) ? Dialect::kTorch21 : Dialect::kTorch113, limits,
           stream);
  }
  return 0;
}
