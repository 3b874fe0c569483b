#include "store/queue_keys.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace cohort::store {
namespace {

// int64's largest value has 19 digits: 20 leave no number longer.
constexpr size_t kSeqDigits = 20;

}  // namespace

std::string QueueItemPrefix(absl::string_view queue) {
  return absl::StrCat(kQueuePrefix, queue.size(), ":", queue, "/");
}

std::string QueueItemKey(absl::string_view queue, int64_t seq) {
  return absl::StrCat(QueueItemPrefix(queue), absl::StrFormat("%020d", seq));
}

std::optional<QueueItemName> ParseQueueItemKey(absl::string_view key) {
  if (!absl::ConsumePrefix(&key, kQueuePrefix)) return std::nullopt;
  const size_t colon = key.find(':');
  if (colon == absl::string_view::npos || colon == 0 || colon > 20) {
    return std::nullopt;
  }
  const absl::string_view digits = key.substr(0, colon);
  for (char ch : digits) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(ch))) {
      return std::nullopt;
    }
  }
  uint64_t length = 0;
  if (!absl::SimpleAtoi(digits, &length)) return std::nullopt;
  key.remove_prefix(colon + 1);
  if (key.size() != length + 1 + kSeqDigits || key[length] != '/') {
    return std::nullopt;
  }
  QueueItemName name;
  name.queue = key.substr(0, length);
  const absl::string_view seq = key.substr(length + 1);
  for (char ch : seq) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(ch))) {
      return std::nullopt;
    }
  }
  if (!absl::SimpleAtoi(seq, &name.seq) || name.seq < 0) return std::nullopt;
  return name;
}

}  // namespace cohort::store
