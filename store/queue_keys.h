// Where KvStore keeps TCPStore's queues (QUEUE_PUSH/POP/LEN, PyTorch 2.4+):
// one ordinary store entry per item, in cohortd's reserved namespace.
//
//   /cohort/queues/<L>:<queue>/<seq>  ->  the item's bytes
//
// <queue> is the queue's name as the store sees it (a torch client's
// queue_push("jobs", ...) names "/jobs"; a namespaced connection's names
// start with its namespace), <L> its length in decimal, so that no queue's
// items lie under another queue's prefix whatever bytes the names hold
// ("a" and "a/b" stay apart), and <seq> the push's number, 20 digits
// zero-padded, so that byte order is push order. For example
// "/cohort/queues/5:/jobs/00000000000000000042". Only KvStore writes these
// keys (clients' writes under "/cohort/" are refused); everyone may read,
// list and watch them.
#ifndef COHORT_STORE_QUEUE_KEYS_H_
#define COHORT_STORE_QUEUE_KEYS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace cohort::store {

inline constexpr absl::string_view kQueuePrefix = "/cohort/queues/";

// The prefix every item of `queue` starts with, and no other key.
std::string QueueItemPrefix(absl::string_view queue);

// The key of `queue`'s item number `seq` (0 <= seq).
std::string QueueItemKey(absl::string_view queue, int64_t seq);

// A key of the layout above, taken apart; views into that key.
struct QueueItemName {
  absl::string_view queue;
  int64_t seq = 0;
};
// nullopt when `key` is not an item's key.
std::optional<QueueItemName> ParseQueueItemKey(absl::string_view key);

}  // namespace cohort::store

#endif  // COHORT_STORE_QUEUE_KEYS_H_
