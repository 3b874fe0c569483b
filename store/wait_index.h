// WaitIndex: KvStore's pending waits (WaitForKeys, WaitForKeysOrQueues)
// and, for each key one of them misses, which. A write looks up only the
// waits on the keys it writes; a push to a queue wakes only the oldest wait
// that counts that queue.
//
// Not thread-safe: it is part of KvStore's state, and every call REQUIRES
// the store's lock (KvStore holds it ABSL_GUARDED_BY that lock). KvStore
// decides when a wait completes (its keys present in the engine, the
// revision, the values to read); the index keeps track of which waits a
// change concerns.
#ifndef COHORT_STORE_WAIT_INDEX_H_
#define COHORT_STORE_WAIT_INDEX_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/deadline_timer.h"

namespace cohort::store {

// What a completed wait delivers (KvStore::WaitForKeys).
struct ReadResult {
  std::vector<std::string> values;  // Empty unless values were asked for.
  int64_t revision = 0;
  // WaitForKeysOrQueues: ended by a push, whose item the waiter's client is
  // to pop (or pass on: KvStore::PassQueueWakes).
  bool queue_wake = false;
};

class WaitIndex {
 public:
  using WaitId = uint64_t;
  using ReadCallback = std::function<void(absl::StatusOr<ReadResult>)>;

  // One pending wait: what KvStore needs to complete it, and how many of
  // its keys the index still holds it under.
  struct Waiter {
    WaitId id = 0;
    std::vector<std::string> keys;
    bool read_values = false;
    ReadCallback done;
    base::DeadlineTimer::TimerId timer = 0;
    absl::Duration timeout;
    // Keys not yet seen; the waiter is indexed under each of them.
    size_t missing = 0;
    // The store's revision when the waiter last checked its keys.
    int64_t checked_at = 0;
    // Set while WaitForKeys is still indexing the keys, slice by slice: the
    // waiter may not complete before every key has been looked at.
    bool registering = false;
    // WaitForKeysOrQueues: a key whose queue holds items counts as present.
    bool queues = false;
    // Being completed by a push (ReadResult::queue_wake).
    bool queue_wake = false;
  };

  // Completes a waiter that misses no key. True if it did (the index then
  // drops it); false if a key turned out missing after all and it indexed
  // the waiter again under what it misses (Index).
  using Complete = absl::FunctionRef<bool(Waiter&)>;

  // Takes `waiter`, giving it the next id, which it returns. It is indexed
  // under no key until Index.
  WaitId Add(std::unique_ptr<Waiter> waiter);
  // The pending wait `id`, or null (completed, cancelled or timed out).
  Waiter* Find(WaitId id);
  // Drops the wait `id`, which Complete completed outside KeyPut and
  // QueuePushed (so is indexed under no key).
  void Erase(WaitId id) { waiters_.erase(id); }
  // Takes the wait `id` out, so that nothing completes it, but leaves its
  // index entries for the caller to drop with Unindex, a slice of keys at
  // a time. Null if there is no such wait.
  std::unique_ptr<Waiter> Take(WaitId id);
  // Takes the wait `id` out with every index entry of it. Null if there is
  // no such wait.
  std::unique_ptr<Waiter> Remove(WaitId id);

  // Indexes `waiter` under `key`, which it misses (and, for a queue-counting
  // wait, among the waits on the queue `key`, oldest first).
  void Index(absl::string_view key, const Waiter& waiter);
  // Drops the index entries of wait `id` under `key` (its queue entry too,
  // with `queues`). Returns whether it was indexed under `key`: whether it
  // still missed it.
  bool Unindex(WaitId id, absl::string_view key, bool queues);

  // `key` was written: each wait indexed under it misses one key fewer, and
  // those that miss none (and are not registering) go to `complete`.
  void KeyPut(absl::string_view key, Complete complete);
  // An item was pushed to `queue`, which holds items: the oldest
  // queue-counting wait on it counts it as present, and goes to `complete`
  // if it misses nothing else (its queue_wake set meanwhile). At most one
  // wait completes: the one whose client pops the item.
  void QueuePushed(absl::string_view queue, Complete complete);

  // Every pending wait, taken out; the index is left empty (Shutdown).
  absl::flat_hash_map<WaitId, std::unique_ptr<Waiter>> TakeAll();

  size_t size() const { return waiters_.size(); }

 private:
  WaitId next_id_ = 1;
  absl::flat_hash_map<WaitId, std::unique_ptr<Waiter>> waiters_;
  absl::flat_hash_map<std::string, absl::flat_hash_set<WaitId>> by_key_;
  // The queue-counting waits among those (WaitForKeysOrQueues), oldest
  // first, by the key they miss. A std::map: waking one may index others.
  std::map<std::string, std::set<WaitId>, std::less<>> queue_waiters_;
};

}  // namespace cohort::store

#endif  // COHORT_STORE_WAIT_INDEX_H_
