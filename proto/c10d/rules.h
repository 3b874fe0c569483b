// c10d's Store rules and cohort's request limits, written once for every
// store that keeps data: cohortd's KvStore (so its gRPC service and its
// TCPStore listener) and the client's FileStore. Pure functions over the
// values a store already holds: no I/O, no locking, no gRPC. The store
// reads the current value, asks these what to write and what to return,
// and writes it.
//
// The error codes and texts are part of the contract: store.proto and
// client/store.h document them, and tests assert them.
#ifndef COHORT_PROTO_C10D_RULES_H_
#define COHORT_PROTO_C10D_RULES_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace cohort::c10d {

// Request limits. A request over one fails with INVALID_ARGUMENT naming the
// limit (e.g. "(max_value_bytes)"); cohortd's flags of the same names set
// them on the server.
struct Limits {
  // The longest key, in bytes. Keys must also be non-empty.
  size_t max_key_bytes = 4096;
  // The longest value, in bytes; also the longest an Append may make one.
  size_t max_value_bytes = 8 << 20;
  // The most keys one call may name (Wait, Check, MultiGet, MultiSet).
  size_t max_keys_per_call = 128 << 10;
};

// OK, or INVALID_ARGUMENT: the key is empty or over max_key_bytes.
absl::Status CheckKey(const Limits& limits, absl::string_view key);
// OK, or INVALID_ARGUMENT: the value is over max_value_bytes.
absl::Status CheckValue(const Limits& limits, absl::string_view value);
// CheckKey for each key, after checking their count (max_keys_per_call).
absl::Status CheckKeys(const Limits& limits,
                       absl::Span<const std::string> keys);
// A prefix (ListKeys, Watch) may be empty but no longer than a key.
absl::Status CheckPrefix(const Limits& limits, absl::string_view prefix);
// MultiSet's request: one value per key, CheckKeys, and CheckValue for
// each value (the error names its key).
absl::Status CheckMultiSet(const Limits& limits,
                           absl::Span<const std::string> keys,
                           absl::Span<const std::string> values);

// In the functions below `current` is the key's value now, or null when the
// key is missing; `key` is only named in errors.

// Add: the value is an int64 in decimal text; a missing key counts as 0.
struct AddOutcome {
  int64_t value = 0;  // The sum, which Add returns.
  std::string text;   // The sum as the store keeps it.
};
// FAILED_PRECONDITION when `current` is not a decimal int64, OUT_OF_RANGE
// when the sum overflows.
absl::StatusOr<AddOutcome> Add(absl::string_view key,
                               const std::string* current, int64_t delta);

// compare_set:
//   key missing, expected empty     -> writes desired, returns desired
//   key missing, expected non-empty -> writes nothing, returns expected
//   current == expected             -> writes desired, returns desired
//   otherwise                       -> writes nothing, returns current
struct CompareSetOutcome {
  bool write = false;  // Whether to store `desired`.
  // What CompareSet returns: a view of `desired`, `expected` or *current,
  // valid as long as they are.
  absl::string_view result;
};
CompareSetOutcome CompareSet(const std::string* current,
                             absl::string_view expected,
                             absl::string_view desired);

// Append: the new value, `value` after *current (a missing key counts as
// empty). INVALID_ARGUMENT, naming the key, when it would pass
// max_value_bytes; nothing is built then.
absl::StatusOr<std::string> Append(const Limits& limits, absl::string_view key,
                                   const std::string* current,
                                   absl::string_view value);

// The error of a wait (Get, Wait, MultiGet) for `num_keys` keys that timed
// out after `timeout` with `missing` (distinct, in request order) still
// absent: DEADLINE_EXCEEDED, "timed out after 5s waiting for 2 of 3 keys;
// missing: "a", "b"".
absl::Status WaitTimeout(absl::Duration timeout, size_t num_keys,
                         const std::vector<absl::string_view>& missing);

// cohortd keeps its coordination records (runs, groups and members) in the
// store under this prefix. Clients may read, list and watch them, but only
// cohortd's own state machines write there.
inline constexpr absl::string_view kReservedPrefix = "/cohort/";

// For cohortd's protocol entry points (gRPC and TCPStore): OK, or
// PERMISSION_DENIED when a client's write would change `key` in
// kReservedPrefix.
absl::Status CheckClientWrite(absl::string_view key);

}  // namespace cohort::c10d

#endif  // COHORT_PROTO_C10D_RULES_H_
