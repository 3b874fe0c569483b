#include "proto/c10d/rules.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/text.h"

namespace cohort::c10d {

using base::Quote;

absl::Status CheckKey(const Limits& limits, absl::string_view key) {
  if (key.empty()) return absl::InvalidArgumentError("key must not be empty");
  if (key.size() > limits.max_key_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "key ", Quote(key), " is ", key.size(), " bytes, over the limit of ",
        limits.max_key_bytes, " bytes (max_key_bytes)"));
  }
  return absl::OkStatus();
}

namespace {

std::string ValueTooLong(const Limits& limits, size_t size) {
  return absl::StrCat("value is ", size, " bytes, over the limit of ",
                      limits.max_value_bytes, " bytes (max_value_bytes)");
}

}  // namespace

absl::Status CheckValue(const Limits& limits, absl::string_view value) {
  if (value.size() > limits.max_value_bytes) {
    return absl::InvalidArgumentError(ValueTooLong(limits, value.size()));
  }
  return absl::OkStatus();
}

absl::Status CheckKeys(const Limits& limits,
                       absl::Span<const std::string> keys) {
  if (keys.size() > limits.max_keys_per_call) {
    return absl::InvalidArgumentError(
        absl::StrCat("request names ", keys.size(), " keys, over the limit of ",
                     limits.max_keys_per_call, " (max_keys_per_call)"));
  }
  for (const std::string& key : keys) {
    if (absl::Status s = CheckKey(limits, key); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status CheckPrefix(const Limits& limits, absl::string_view prefix) {
  if (prefix.size() > limits.max_key_bytes) return CheckKey(limits, prefix);
  return absl::OkStatus();
}

absl::Status CheckMultiSet(const Limits& limits,
                           absl::Span<const std::string> keys,
                           absl::Span<const std::string> values) {
  if (keys.size() != values.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "multi_set got ", keys.size(), " keys but ", values.size(), " values"));
  }
  if (absl::Status s = CheckKeys(limits, keys); !s.ok()) return s;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (absl::Status s = CheckValue(limits, values[i]); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("key ", Quote(keys[i]), ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<AddOutcome> Add(absl::string_view key,
                               const std::string* current, int64_t delta) {
  int64_t old = 0;
  if (current != nullptr && !absl::SimpleAtoi(*current, &old)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot add to key ", Quote(key), ": its value ", Quote(*current),
        " is not a decimal int64 (was it written by set rather than add?)"));
  }
  AddOutcome out;
  if (__builtin_add_overflow(old, delta, &out.value)) {
    return absl::OutOfRangeError(absl::StrCat("adding ", delta, " to key ",
                                              Quote(key), " (value ", old,
                                              ") overflows int64"));
  }
  out.text = absl::StrCat(out.value);
  return out;
}

CompareSetOutcome CompareSet(const std::string* current,
                             absl::string_view expected,
                             absl::string_view desired) {
  if (current == nullptr ? expected.empty() : *current == expected) {
    return {true, desired};
  }
  // c10d: a missing key returns `expected`, a mismatch the current value.
  return {false, current == nullptr ? expected : absl::string_view(*current)};
}

absl::StatusOr<std::string> Append(const Limits& limits, absl::string_view key,
                                   const std::string* current,
                                   absl::string_view value) {
  const size_t old = current == nullptr ? 0 : current->size();
  if (old + value.size() > limits.max_value_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("append to key ", Quote(key), ": ",
                     ValueTooLong(limits, old + value.size())));
  }
  std::string out;
  out.reserve(old + value.size());
  if (current != nullptr) out.append(*current);
  out.append(value.data(), value.size());
  return out;
}

absl::Status WaitTimeout(absl::Duration timeout, size_t num_keys,
                         const std::vector<absl::string_view>& missing) {
  return absl::DeadlineExceededError(absl::StrCat(
      "timed out after ", absl::FormatDuration(timeout), " waiting for ",
      missing.size(), " of ", num_keys, num_keys == 1 ? " key" : " keys",
      "; missing: ", base::QuoteList(missing)));
}

absl::Status CheckClientWrite(absl::string_view key) {
  if (!absl::StartsWith(key, kReservedPrefix)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "key ", Quote(key), " is in cohortd's reserved namespace ",
      Quote(kReservedPrefix),
      ": its coordination records are written only by cohortd; use the "
      "Rendezvous and Membership RPCs"));
}

}  // namespace cohort::c10d
