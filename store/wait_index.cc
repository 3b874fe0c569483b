#include "store/wait_index.h"

#include <utility>

namespace cohort::store {

WaitIndex::WaitId WaitIndex::Add(std::unique_ptr<Waiter> waiter) {
  const WaitId id = next_id_++;
  waiter->id = id;
  waiters_.emplace(id, std::move(waiter));
  return id;
}

WaitIndex::Waiter* WaitIndex::Find(WaitId id) {
  auto it = waiters_.find(id);
  return it == waiters_.end() ? nullptr : it->second.get();
}

std::unique_ptr<WaitIndex::Waiter> WaitIndex::Take(WaitId id) {
  auto it = waiters_.find(id);
  if (it == waiters_.end()) return nullptr;
  std::unique_ptr<Waiter> waiter = std::move(it->second);
  waiters_.erase(it);
  return waiter;
}

std::unique_ptr<WaitIndex::Waiter> WaitIndex::Remove(WaitId id) {
  std::unique_ptr<Waiter> waiter = Take(id);
  if (waiter == nullptr) return nullptr;
  for (const std::string& key : waiter->keys) {
    auto it = by_key_.find(key);
    if (it == by_key_.end()) continue;
    it->second.erase(waiter->id);
    if (it->second.empty()) by_key_.erase(it);
    if (!waiter->queues) continue;
    auto q = queue_waiters_.find(key);
    if (q == queue_waiters_.end()) continue;
    q->second.erase(waiter->id);
    if (q->second.empty()) queue_waiters_.erase(q);
  }
  return waiter;
}

void WaitIndex::Index(absl::string_view key, const Waiter& waiter) {
  by_key_[key].insert(waiter.id);
  if (waiter.queues) {
    auto it = queue_waiters_.find(key);
    if (it == queue_waiters_.end()) {
      it = queue_waiters_.emplace(std::string(key), std::set<WaitId>()).first;
    }
    it->second.insert(waiter.id);
  }
}

bool WaitIndex::Unindex(WaitId id, absl::string_view key, bool queues) {
  if (queues) {
    if (auto q = queue_waiters_.find(key); q != queue_waiters_.end()) {
      q->second.erase(id);
      if (q->second.empty()) queue_waiters_.erase(q);
    }
  }
  auto k = by_key_.find(key);
  if (k == by_key_.end() || !k->second.erase(id)) return false;
  if (k->second.empty()) by_key_.erase(k);
  return true;
}

void WaitIndex::KeyPut(absl::string_view key, Complete complete) {
  auto it = by_key_.find(key);
  if (it == by_key_.end()) return;
  absl::flat_hash_set<WaitId> ids = std::move(it->second);
  by_key_.erase(it);
  auto queued = queue_waiters_.find(key);
  for (WaitId id : ids) {
    auto w = waiters_.find(id);
    if (w == waiters_.end()) continue;
    if (w->second->queues && queued != queue_waiters_.end()) {
      queued->second.erase(id);
    }
    if (--w->second->missing > 0 || w->second->registering) continue;
    if (complete(*w->second)) waiters_.erase(w);
  }
  queued = queue_waiters_.find(key);
  if (queued != queue_waiters_.end() && queued->second.empty()) {
    queue_waiters_.erase(queued);
  }
}

void WaitIndex::QueuePushed(absl::string_view queue, Complete complete) {
  auto it = queue_waiters_.find(queue);
  if (it == queue_waiters_.end()) return;
  std::set<WaitId>& ids = it->second;
  while (!ids.empty()) {
    const WaitId id = *ids.begin();
    ids.erase(ids.begin());
    auto w = waiters_.find(id);
    if (w == waiters_.end()) continue;
    // From now on the queue counts as present for this wait, as a key
    // that was set does.
    if (auto k = by_key_.find(queue); k != by_key_.end()) {
      k->second.erase(id);
      if (k->second.empty()) by_key_.erase(k);
    }
    // One that misses other keys too takes no wake-up: the next wait may.
    if (--w->second->missing > 0 || w->second->registering) continue;
    w->second->queue_wake = true;
    if (complete(*w->second)) {
      waiters_.erase(w);
      break;
    }
    w->second->queue_wake = false;
  }
  // Still valid: queue_waiters_ is a std::map, and nothing above erased
  // this entry.
  if (ids.empty()) queue_waiters_.erase(it);
}

absl::flat_hash_map<WaitIndex::WaitId, std::unique_ptr<WaitIndex::Waiter>>
WaitIndex::TakeAll() {
  absl::flat_hash_map<WaitId, std::unique_ptr<Waiter>> all;
  all.swap(waiters_);
  by_key_.clear();
  queue_waiters_.clear();
  return all;
}

}  // namespace cohort::store
