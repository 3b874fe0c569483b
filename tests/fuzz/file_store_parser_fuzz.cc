// file_store_parser_fuzz: FileStore's log parser on arbitrary bytes.
//
// Two properties per input:
//  1. The input as a file's tail: ParseRecords never crashes or reads out
//     of bounds (ASan), consumes whole records only (at most the input),
//     fails only with DATA_LOSS, and what it parsed encodes back to exactly
//     the bytes it consumed; parsing just those bytes gives the same.
//  2. The input as a recipe for records: what EncodeRecord writes parses
//     back identically, whole, and cut anywhere parses to the records
//     before the cut.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/file_store_log.h"
#include "tests/fuzz/fuzz_input.h"

namespace cohort::file_store_internal {
namespace {

std::string EncodeAll(const std::vector<Record>& records) {
  std::string out;
  for (const Record& r : records) {
    absl::StatusOr<std::string> bytes = EncodeRecord(r.kind, r.mutations);
    FUZZ_CHECK(bytes.ok());
    out += *bytes;
  }
  return out;
}

void ParseArbitraryBytes(absl::string_view data) {
  std::vector<Record> records;
  absl::StatusOr<size_t> used = ParseRecords(data, 20, "fuzz", records);
  if (!used.ok()) {
    FUZZ_CHECK(used.status().code() == absl::StatusCode::kDataLoss);
    return;
  }
  FUZZ_CHECK(*used <= data.size());
  for (const Record& r : records) {
    FUZZ_CHECK(r.kind == kBatch || r.kind == kOpen || r.kind == kClose);
    for (const Mutation& m : r.mutations)
      FUZZ_CHECK(m.is_put || m.value.empty());
  }
  // What is left is a record cut short: fewer bytes than it says it has.
  FUZZ_CHECK(data.size() - *used < 4 || [&] {
    uint32_t size = 0;
    for (int i = 0; i < 4; ++i) {
      size |= uint32_t{static_cast<uint8_t>(data[*used + i])} << (8 * i);
    }
    return data.size() - *used - 4 < size;
  }());
  FUZZ_CHECK(EncodeAll(records) == data.substr(0, *used));

  std::vector<Record> again;
  absl::StatusOr<size_t> used_again =
      ParseRecords(data.substr(0, *used), 20, "fuzz", again);
  FUZZ_CHECK(used_again.ok() && *used_again == *used && again == records);
}

void RoundTrip(fuzz::FuzzInput& in) {
  constexpr char kKinds[] = {kBatch, kOpen, kClose};
  std::vector<Record> records(in.Pick(5));
  for (Record& r : records) {
    r.kind = kKinds[in.Pick(3)];
    r.mutations.resize(in.Pick(4));
    for (Mutation& m : r.mutations) {
      m.is_put = in.Pick(3) != 0;
      m.key = in.Bytes(12);
      if (m.is_put) m.value = in.Bytes(40);
    }
  }
  const std::string log = EncodeAll(records);
  std::vector<Record> read;
  absl::StatusOr<size_t> used = ParseRecords(log, 0, "fuzz", read);
  FUZZ_CHECK(used.ok() && *used == log.size() && read == records);

  // Cut at some byte: the records wholly before the cut, nothing else.
  const size_t cut = log.empty() ? 0 : in.U32() % log.size();
  size_t whole = 0, end = 0;
  for (const Record& r : records) {
    end += EncodeAll({r}).size();
    if (end > cut) break;
    ++whole;
  }
  std::vector<Record> prefix;
  used = ParseRecords(absl::string_view(log).substr(0, cut), 0, "fuzz", prefix);
  FUZZ_CHECK(used.ok() && prefix.size() == whole &&
             std::equal(prefix.begin(), prefix.end(), records.begin()));
}

}  // namespace
}  // namespace cohort::file_store_internal

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace cohort::file_store_internal;
  ParseArbitraryBytes(
      absl::string_view(reinterpret_cast<const char*>(data), size));
  cohort::fuzz::FuzzInput in(data, size);
  RoundTrip(in);
  return 0;
}
