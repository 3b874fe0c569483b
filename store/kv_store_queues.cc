// KvStore's TCPStore queues (kv_store.h, queue_keys.h): the public calls,
// and the index of items kept in memory. Waking one wait per push belongs
// to the wait index (wait_index.h), and planning pushes and pops within a
// batch to ApplyBatch, like every other change (kv_store.cc).
#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "store/kv_store.h"
#include "store/queue_keys.h"

namespace cohort::store {
namespace {

// Calls hold the store's lock for at most this many queues or items at a
// time (as kv_store.cc does for keys).
constexpr size_t kPerSlice = 4096;

}  // namespace

KvStore::WaitId KvStore::WaitForKeysOrQueues(std::vector<std::string> keys,
                                             absl::Duration timeout,
                                             ReadCallback done) {
  return StartWait(std::move(keys), /*read_values=*/false, /*queues=*/true,
                   timeout, std::move(done));
}

absl::StatusOr<CheckResult> KvStore::CheckKeysOrQueues(
    absl::Span<const std::string> keys) {
  return CheckPresent(keys, /*queues=*/true);
}

absl::StatusOr<int64_t> KvStore::QueuePush(absl::string_view queue,
                                           absl::string_view value) {
  ChangeResult r = ApplyOne(
      {.kind = Change::Kind::kQueuePush, .key = queue, .value = value});
  if (!r.status.ok()) return r.status;
  return r.revision;
}

absl::StatusOr<QueuePopResult> KvStore::QueuePop(absl::string_view queue) {
  ChangeResult r = ApplyOne({.kind = Change::Kind::kQueuePop, .key = queue});
  if (!r.status.ok()) return r.status;
  return QueuePopResult{.length = r.number,
                        .value = std::move(r.value),
                        .item_key = std::move(r.queue_item),
                        .revision = r.revision};
}

absl::StatusOr<int64_t> KvStore::QueueLen(absl::string_view queue) {
  if (absl::Status s = c10d::CheckKey(rules_, queue); !s.ok()) return s;
  if (absl::Status s = CatchUp(); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (!queue_load_.ok()) return queue_load_;
  return QueueLengthLocked(queue);
}

QueueStats KvStore::queue_stats() {
  absl::MutexLock lock(&mu_);
  return QueueStats{.queues = static_cast<int64_t>(queues_.size()),
                    .items = queue_items_,
                    .bytes = queue_bytes_};
}

void KvStore::PassQueueWakes(absl::Span<const std::string> queues) {
  Deferred deferred;
  for (size_t begin = 0; begin < queues.size(); begin += kPerSlice) {
    absl::MutexLock lock(&mu_);
    const size_t end = std::min(queues.size(), begin + kPerSlice);
    for (size_t i = begin; i < end; ++i) {
      WakeQueueWaiterLocked(queues[i], deferred);
    }
  }
  for (auto& fn : deferred) fn();
}

int64_t KvStore::QueueLengthLocked(absl::string_view queue) const {
  auto it = queues_.find(queue);
  return it == queues_.end() ? 0 : it->second.items.size();
}

void KvStore::IndexQueuesLocked(absl::Span<const Mutation> mutations,
                                std::vector<std::string>& pushed) {
  for (const Mutation& m : mutations) {
    if (!absl::StartsWith(m.key, kQueuePrefix)) continue;
    std::optional<QueueItemName> item = ParseQueueItemKey(m.key);
    if (!item.has_value()) continue;
    if (m.kind == Mutation::Kind::kPut) {
      QueueIndex& q = queues_[item->queue];
      auto [at, added] = q.items.try_emplace(item->seq, m.value.size());
      if (added) {
        ++queue_items_;
        pushed.emplace_back(item->queue);
      } else {
        queue_bytes_ -= at->second;
        at->second = m.value.size();
      }
      queue_bytes_ += m.value.size();
      continue;
    }
    auto q = queues_.find(item->queue);
    if (q == queues_.end()) continue;
    auto at = q->second.items.find(item->seq);
    if (at == q->second.items.end()) continue;
    queue_bytes_ -= at->second;
    --queue_items_;
    q->second.items.erase(at);
    if (q->second.items.empty()) queues_.erase(q);
  }
}

absl::Status KvStore::LoadQueuesLocked() {
  std::string after;
  for (;;) {
    absl::StatusOr<std::vector<std::string>> keys =
        engine_->ListKeys(kQueuePrefix, after, kPerSlice);
    if (!keys.ok()) {
      return absl::Status(
          keys.status().code(),
          absl::StrCat("listing the queues' items under ", kQueuePrefix, ": ",
                       keys.status().message()));
    }
    std::vector<Mutation> items;
    for (const std::string& key : *keys) {
      absl::StatusOr<std::optional<std::string>> value = engine_->Get(key);
      if (!value.ok()) {
        return absl::Status(
            value.status().code(),
            absl::StrCat("reading the queue item '", absl::CHexEscape(key),
                         "': ", value.status().message()));
      }
      if (!value->has_value()) continue;
      items.push_back({.key = key, .value = std::move(**value)});
    }
    std::vector<std::string> pushed;
    IndexQueuesLocked(items, pushed);
    if (keys->size() < kPerSlice) return absl::OkStatus();
    after = keys->back();
  }
}

}  // namespace cohort::store
