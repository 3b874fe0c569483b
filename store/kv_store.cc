#include "store/kv_store.h"

#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace cohort::store {

struct KvStore::Waiter {
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

struct KvStore::ShareState {
  std::string name;
  // None lies under another.
  std::vector<std::string> roots;
  ShareUsage usage;
  // The scan's progress: roots before `scanning` are counted whole; of
  // roots[scanning], the keys up to and including `cursor` (none while it
  // is empty: keys never are).
  size_t scanning = 0;
  std::string cursor;

  bool counted() const { return scanning == roots.size(); }
  // Whether `usage` covers `key`, and so must follow its changes.
  bool Counts(absl::string_view key) const {
    for (size_t i = 0; i < roots.size() && i <= scanning; ++i) {
      if (!absl::StartsWith(key, roots[i])) continue;
      return i < scanning || (!cursor.empty() && key <= cursor);
    }
    return false;
  }
};

// The changes a list of writes makes to the shares' counts, each write
// seeing the ones before it. Lives within one hold of the store's lock.
class KvStore::ShareTally {
 public:
  explicit ShareTally(KvStore& store) : store_(store) {}

  // Tallies `key` changing to a value of `value_bytes` (nullopt: deleted).
  // With `enforce`, a change that would take a counted share past a bound
  // is refused with RESOURCE_EXHAUSTED (and counted) and not tallied.
  absl::Status Change(absl::string_view key, std::optional<size_t> value_bytes,
                      bool enforce) ABSL_EXCLUSIVE_LOCKS_REQUIRED(store_.mu_) {
    if (store_.shares_.empty()) return absl::OkStatus();
    std::vector<ShareState*> hit;
    for (const std::shared_ptr<ShareState>& share : store_.shares_) {
      if (share->Counts(key)) hit.push_back(share.get());
    }
    if (hit.empty()) return absl::OkStatus();
    const std::optional<uint64_t> before = SizeNow(key);
    std::optional<uint64_t> after;
    if (value_bytes.has_value()) after = key.size() + *value_bytes;
    const Delta d{(after ? 1 : 0) - (before ? 1 : 0),
                  static_cast<int64_t>(after.value_or(0)) -
                      static_cast<int64_t>(before.value_or(0))};
    if (enforce) {
      for (ShareState* share : hit) {
        if (!share->counted()) continue;
        auto it = deltas_.find(share);
        const Delta pending = it == deltas_.end() ? Delta() : it->second;
        const StoreLimits& limits = store_.limits_;
        if (d.keys > 0 &&
            Over(share->usage.keys, pending.keys + d.keys, limits.quota_keys)) {
          ++store_.share_refused_keys_;
          return Refusal(*share, "keys", share->usage.keys + pending.keys,
                         d.keys, limits.quota_keys, "quota_keys",
                         "delete keys it no longer needs");
        }
        if (d.bytes > 0 && Over(share->usage.bytes, pending.bytes + d.bytes,
                                limits.quota_bytes)) {
          ++store_.share_refused_bytes_;
          return Refusal(*share, "bytes", share->usage.bytes + pending.bytes,
                         d.bytes, limits.quota_bytes, "quota_bytes",
                         "delete keys or shrink values it no longer needs");
        }
      }
    }
    sizes_[key] = after;
    for (ShareState* share : hit) {
      Delta& sum = deltas_[share];
      sum.keys += d.keys;
      sum.bytes += d.bytes;
    }
    return absl::OkStatus();
  }

  // Adds what was tallied to the shares' counts.
  void Commit() ABSL_EXCLUSIVE_LOCKS_REQUIRED(store_.mu_) {
    for (auto& [share, d] : deltas_) {
      share->usage.keys = Add(share->usage.keys, d.keys);
      share->usage.bytes = Add(share->usage.bytes, d.bytes);
    }
  }

 private:
  struct Delta {
    int64_t keys = 0;
    int64_t bytes = 0;
  };

  static bool Over(uint64_t used, int64_t delta, uint64_t limit) {
    return static_cast<__int128>(used) + delta > static_cast<__int128>(limit);
  }
  static uint64_t Add(uint64_t used, int64_t delta) {
    const __int128 sum = static_cast<__int128>(used) + delta;
    return sum < 0 ? 0 : static_cast<uint64_t>(sum);
  }

  static absl::Status Refusal(const ShareState& share, absl::string_view what,
                              int64_t used, int64_t more, uint64_t limit,
                              absl::string_view flag,
                              absl::string_view advice) {
    std::vector<std::string> roots;
    for (const std::string& root : share.roots) {
      roots.push_back(absl::StrCat("'", absl::CHexEscape(root), "'"));
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "quota ", flag, " exceeded for ", absl::CHexEscape(share.name),
        ": the keys under ", absl::StrJoin(roots, ", "), " hold ", used, " ",
        what, " and this write adds ", more, ", over the limit of ", limit,
        " (", flag, "; cohortd's --", flag, "): ", advice,
        " (deletes always pass), or raise the limit"));
  }

  // Bytes of `key` and its value as the writes so far leave them.
  std::optional<uint64_t> SizeNow(absl::string_view key)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(store_.mu_) {
    if (auto it = sizes_.find(key); it != sizes_.end()) return it->second;
    absl::StatusOr<std::optional<std::string>> value = store_.engine_->Get(key);
    if (!value.ok() || !value->has_value()) return std::nullopt;
    return key.size() + (*value)->size();
  }

  KvStore& store_;
  absl::flat_hash_map<std::string, std::optional<uint64_t>> sizes_;
  absl::flat_hash_map<ShareState*, Delta> deltas_;
};

namespace {

// Long requests hold the lock for at most this many keys at a time, so a
// 131,072-key wait cannot stall every other call.
constexpr size_t kKeysPerSlice = 4096;

// How long a call on a shared engine waits for the feed to bring what it
// needs (its own commit, or the barrier of a read).
constexpr absl::Duration kFeedTimeout = absl::Seconds(10);

// Attempts of a guarded commit that keeps losing to other writers.
constexpr int kMaxGuardedAttempts = 64;

// The value bytes a mutation leaves, nullopt for a delete.
std::optional<size_t> SizeOf(const Mutation& m) {
  if (m.kind == Mutation::Kind::kDelete) return std::nullopt;
  return m.value.size();
}

// `roots` sorted, without duplicates and without those under another.
std::vector<std::string> DisjointRoots(std::vector<std::string> roots) {
  std::sort(roots.begin(), roots.end());
  std::vector<std::string> out;
  for (std::string& root : roots) {
    // A root's prefixes sort before it.
    if (!out.empty() && absl::StartsWith(root, out.back())) continue;
    out.push_back(std::move(root));
  }
  return out;
}

// A share's scan reads at most this many bytes of values per hold of the
// store's lock.
constexpr size_t kScanBytesPerSlice = 16 << 20;

size_t EventBytes(const Event& e) {
  return sizeof(Event) + e.key.size() + (e.value ? e.value->size() : 0);
}

}  // namespace

c10d::Limits StoreLimits::c10d_limits() const {
  c10d::Limits out;
  out.max_key_bytes = max_key_bytes;
  out.max_value_bytes = max_value_bytes;
  out.max_keys_per_call = max_keys_per_call;
  return out;
}

KvStore::KvStore(std::unique_ptr<KvEngine> engine, StoreLimits limits)
    : limits_(limits),
      rules_(limits.c10d_limits()),
      engine_(std::move(engine)) {
  revision_ = engine_->revision();
  last_delete_revision_ = revision_;
  compacted_revision_ = revision_;
  {
    absl::MutexLock lock(&mu_);
    queue_load_ = LoadQueuesLocked();
  }
  if (engine_->shared()) {
    shared_ = engine_.get();
    loaded_revision_ = revision_;
    absl::Status started =
        shared_->StartFeed([this](int64_t revision, std::vector<Mutation> m) {
          OnFeed(revision, std::move(m));
        });
    if (!started.ok()) {
      shutdown_ = absl::UnavailableError(absl::StrCat(
          "the shared engine's feed did not start: ", started.message()));
    }
  }
}

KvStore::~KvStore() {
  // The feed calls into everything below: stop it first.
  if (shared_ != nullptr) shared_->StopFeed();
  Shutdown(absl::UnavailableError("the store is closing"));
}

int64_t KvStore::revision() {
  absl::MutexLock lock(&mu_);
  return revision_;
}

absl::StatusOr<int64_t> KvStore::CommitLocked(std::vector<Mutation> mutations,
                                              Deferred& deferred) {
  // The engine may be ahead: a write reported as failed can still have
  // reached its log and come back when the engine reopened after a full
  // disk. Revisions never repeat either way.
  const int64_t revision = std::max(revision_, engine_->revision()) + 1;
  ShareTally tally(*this);
  for (const Mutation& m : mutations) {
    tally.Change(m.key, SizeOf(m), /*enforce=*/false).IgnoreError();
  }
  if (absl::Status s = engine_->Apply(mutations, revision); !s.ok()) return s;
  tally.Commit();
  revision_ = revision;
  PublishLocked(revision, std::move(mutations), deferred);
  return revision;
}

void KvStore::PublishLocked(int64_t revision, std::vector<Mutation> mutations,
                            Deferred& deferred) {
  std::vector<std::string> pushed;
  IndexQueuesLocked(mutations, pushed);
  std::vector<Event> events;
  events.reserve(mutations.size());
  for (Mutation& m : mutations) {
    Event e;
    e.revision = revision;
    if (m.kind == Mutation::Kind::kPut) {
      e.type = Event::Type::kPut;
      e.value = std::make_shared<const std::string>(std::move(m.value));
    } else {
      e.type = Event::Type::kDelete;
      last_delete_revision_ = revision;
    }
    e.key = std::move(m.key);
    events.push_back(std::move(e));
  }

  for (auto& [id, watcher] : watchers_) {
    if (revision < watcher.start_revision) continue;
    std::vector<Event> matching;
    for (const Event& e : events) {
      if (absl::StartsWith(e.key, watcher.prefix)) {
        matching.push_back(e);
      }
    }
    if (!matching.empty()) watcher.on_events(std::move(matching));
  }
  for (const Event& e : events) {
    if (e.type == Event::Type::kPut) WakeWaitersLocked(e.key, deferred);
    history_bytes_ += EventBytes(e);
  }
  // One wait per push: the one whose client pops the item.
  for (const std::string& queue : pushed) {
    WakeQueueWaiterLocked(queue, deferred);
  }
  for (Event& e : events) history_.push_back(std::move(e));
  TrimHistoryLocked();
}

void KvStore::OnFeed(int64_t revision, std::vector<Mutation> mutations) {
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    if (revision <= revision_ && mutations.empty() &&
        revision == loaded_revision_ && loaded_revision_ > 0) {
      // The engine says its replay is whole.
      FinishReplayLocked();
      return;
    }
    if (revision <= revision_) {
      // A change from before the store loaded: history only, so that a
      // watch may resume from it.
      if (revision <= loaded_revision_ && !mutations.empty() &&
          (history_.empty() || history_.back().revision < revision)) {
        if (replayed_from_ == 0) replayed_from_ = revision;
        std::vector<Event> events;
        for (Mutation& m : mutations) {
          Event e;
          e.revision = revision;
          e.type = m.kind == Mutation::Kind::kPut ? Event::Type::kPut
                                                  : Event::Type::kDelete;
          if (m.kind == Mutation::Kind::kPut) {
            e.value = std::make_shared<const std::string>(std::move(m.value));
          }
          e.key = std::move(m.key);
          history_bytes_ += EventBytes(e);
          history_.push_back(std::move(e));
        }
        TrimHistoryLocked();
        // Until the replay is over the history is not contiguous: resuming
        // watches stay refused below the loaded revision.
        compacted_revision_ = loaded_revision_;
      }
      return;
    }
    if (loaded_revision_ > 0) FinishReplayLocked();
    if (!mutations.empty()) {
      // Updates the engine's view only: the change is already committed.
      ShareTally tally(*this);
      for (const Mutation& m : mutations) {
        tally.Change(m.key, SizeOf(m), /*enforce=*/false).IgnoreError();
      }
      if (absl::Status s = engine_->Apply(mutations, revision); !s.ok()) {
        return;
      }
      tally.Commit();
      PublishLocked(revision, std::move(mutations), deferred);
    }
    revision_ = revision;
  }
  for (auto& fn : deferred) fn();
}

void KvStore::FinishReplayLocked() {
  // The history now reaches back to the replay's start.
  if (replayed_from_ > 0 && !history_.empty() &&
      history_.front().revision <= loaded_revision_) {
    compacted_revision_ = history_.front().revision - 1;
  }
  replayed_from_ = 0;
  loaded_revision_ = 0;
}

absl::Status KvStore::AwaitRevision(int64_t target, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto reached = [this, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return revision_ >= target;
  };
  if (mu_.AwaitWithTimeout(absl::Condition(&reached), timeout)) {
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat(
      "the store's view is at revision ", revision_, " and did not reach ",
      target, " within ", absl::FormatDuration(timeout),
      ": the shared engine's change feed is behind or cut off"));
}

absl::Status KvStore::CatchUp() {
  if (shared_ == nullptr) return absl::OkStatus();
  absl::StatusOr<int64_t> barrier = shared_->ReadBarrier();
  if (!barrier.ok()) return barrier.status();
  return AwaitRevision(*barrier, kFeedTimeout);
}

void KvStore::TrimHistoryLocked() {
  while (!history_.empty() && (history_.size() > limits_.history_events ||
                               history_bytes_ > limits_.history_bytes)) {
    // Drop whole revisions, so a resumed watch never sees half of one.
    const int64_t dropped = history_.front().revision;
    while (!history_.empty() && history_.front().revision == dropped) {
      history_bytes_ -= EventBytes(history_.front());
      history_.pop_front();
    }
    compacted_revision_ = dropped;
  }
}

void KvStore::WakeWaitersLocked(absl::string_view key, Deferred& deferred) {
  auto it = waiters_by_key_.find(key);
  if (it == waiters_by_key_.end()) return;
  absl::flat_hash_set<WaitId> ids = std::move(it->second);
  waiters_by_key_.erase(it);
  auto queued = queue_waiters_.find(key);
  for (WaitId id : ids) {
    auto w = waiters_.find(id);
    if (w == waiters_.end()) continue;
    if (w->second->queues && queued != queue_waiters_.end()) {
      queued->second.erase(id);
    }
    if (--w->second->missing > 0 || w->second->registering) continue;
    if (TryCompleteLocked(w->second, deferred)) waiters_.erase(w);
  }
  queued = queue_waiters_.find(key);
  if (queued != queue_waiters_.end() && queued->second.empty()) {
    queue_waiters_.erase(queued);
  }
}

void KvStore::WakeQueueWaiterLocked(absl::string_view queue,
                                    Deferred& deferred) {
  auto it = queue_waiters_.find(queue);
  if (it == queue_waiters_.end() || QueueLengthLocked(queue) == 0) return;
  std::set<WaitId>& ids = it->second;
  while (!ids.empty()) {
    const WaitId id = *ids.begin();
    ids.erase(ids.begin());
    auto w = waiters_.find(id);
    if (w == waiters_.end()) continue;
    // From now on the queue counts as present for this wait, as a key
    // that was set does.
    if (auto k = waiters_by_key_.find(queue); k != waiters_by_key_.end()) {
      k->second.erase(id);
      if (k->second.empty()) waiters_by_key_.erase(k);
    }
    // One that misses other keys too takes no wake-up: the next wait may.
    if (--w->second->missing > 0 || w->second->registering) continue;
    w->second->queue_wake = true;
    if (TryCompleteLocked(w->second, deferred)) {
      waiters_.erase(w);
      break;
    }
    w->second->queue_wake = false;
  }
  // Still valid: queue_waiters_ is a std::map, and nothing above erased
  // this entry.
  if (ids.empty()) queue_waiters_.erase(it);
}

bool KvStore::PresentLocked(absl::string_view key, bool queues) const {
  return engine_->Contains(key) || (queues && QueueLengthLocked(key) > 0);
}

void KvStore::IndexWaiterLocked(absl::string_view key, const Waiter& waiter) {
  waiters_by_key_[key].insert(waiter.id);
  if (waiter.queues) {
    auto it = queue_waiters_.find(key);
    if (it == queue_waiters_.end()) {
      it = queue_waiters_.emplace(std::string(key), std::set<WaitId>()).first;
    }
    it->second.insert(waiter.id);
  }
}

bool KvStore::TryCompleteLocked(std::unique_ptr<Waiter>& waiter,
                                Deferred& deferred) {
  if (last_delete_revision_ > waiter->checked_at) {
    // A key may have been deleted after it was seen: look again.
    std::vector<absl::string_view> missing;
    for (const std::string& key : waiter->keys) {
      if (!PresentLocked(key, waiter->queues)) missing.push_back(key);
    }
    waiter->checked_at = revision_;
    if (!missing.empty()) {
      absl::flat_hash_set<absl::string_view> distinct(missing.begin(),
                                                      missing.end());
      waiter->missing = distinct.size();
      for (absl::string_view key : distinct) IndexWaiterLocked(key, *waiter);
      return false;
    }
  }
  if (waiter->timer != 0) timer_.Cancel(waiter->timer);
  const int64_t revision = revision_;
  if (!waiter->read_values) {
    deferred.push_back([done = std::move(waiter->done), revision,
                        queue_wake = waiter->queue_wake] {
      ReadResult result;
      result.revision = revision;
      result.queue_wake = queue_wake;
      done(std::move(result));
    });
    return true;
  }
  // The values are pinned now and read after the lock is released.
  deferred.push_back(
      [done = std::move(waiter->done), revision,
       read = std::shared_ptr<KvEngine::PreparedRead>(
           engine_->PrepareRead(std::move(waiter->keys)))]() mutable {
        absl::StatusOr<std::vector<std::string>> values = read->Read();
        if (!values.ok()) return done(values.status());
        ReadResult result;
        result.revision = revision;
        result.values = std::move(*values);
        done(std::move(result));
      });
  return true;
}

void KvStore::UnindexWaiterLocked(const Waiter& waiter) {
  for (const std::string& key : waiter.keys) {
    auto it = waiters_by_key_.find(key);
    if (it == waiters_by_key_.end()) continue;
    it->second.erase(waiter.id);
    if (it->second.empty()) waiters_by_key_.erase(it);
    if (!waiter.queues) continue;
    auto q = queue_waiters_.find(key);
    if (q == queue_waiters_.end()) continue;
    q->second.erase(waiter.id);
    if (q->second.empty()) queue_waiters_.erase(q);
  }
}

ChangeResult KvStore::ApplyOne(const Change& change) {
  return std::move(ApplyBatch({&change, 1})[0]);
}

absl::StatusOr<int64_t> KvStore::Set(absl::string_view key,
                                     absl::string_view value) {
  ChangeResult r =
      ApplyOne({.kind = Change::Kind::kSet, .key = key, .value = value});
  if (!r.status.ok()) return r.status;
  return r.revision;
}

absl::StatusOr<AddResult> KvStore::Add(absl::string_view key, int64_t delta) {
  ChangeResult r =
      ApplyOne({.kind = Change::Kind::kAdd, .key = key, .delta = delta});
  if (!r.status.ok()) return r.status;
  return AddResult{r.number, r.revision};
}

absl::StatusOr<CompareSetResult> KvStore::CompareSet(
    absl::string_view key, absl::string_view expected,
    absl::string_view desired) {
  ChangeResult r = ApplyOne({.kind = Change::Kind::kCompareSet,
                             .key = key,
                             .value = desired,
                             .expected = expected});
  if (!r.status.ok()) return r.status;
  return CompareSetResult{std::move(r.value), r.number == 1, r.revision};
}

absl::StatusOr<int64_t> KvStore::Append(absl::string_view key,
                                        absl::string_view value) {
  ChangeResult r =
      ApplyOne({.kind = Change::Kind::kAppend, .key = key, .value = value});
  if (!r.status.ok()) return r.status;
  return r.revision;
}

absl::StatusOr<DeleteResult> KvStore::Delete(absl::string_view key) {
  ChangeResult r = ApplyOne({.kind = Change::Kind::kDelete, .key = key});
  if (!r.status.ok()) return r.status;
  return DeleteResult{r.number == 1, r.revision};
}

absl::StatusOr<int64_t> KvStore::MultiSet(
    absl::Span<const std::string> keys, absl::Span<const std::string> values) {
  if (absl::Status s = c10d::CheckMultiSet(rules_, keys, values); !s.ok()) {
    return s;
  }
  std::vector<Mutation> m(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    m[i].key = keys[i];
    m[i].value = values[i];
  }
  if (m.empty()) return revision();
  if (shared_ != nullptr) {
    {
      absl::MutexLock lock(&mu_);
      if (absl::Status s = CheckSharesLocked(m); !s.ok()) return s;
    }
    absl::StatusOr<int64_t> committed = shared_->ApplyGuarded(m, {});
    if (!committed.ok()) return committed.status();
    AwaitRevision(*committed, kFeedTimeout).IgnoreError();
    return committed;
  }
  Deferred deferred;
  absl::StatusOr<int64_t> revision;
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckSharesLocked(m); !s.ok()) return s;
    revision = CommitLocked(std::move(m), deferred);
  }
  for (auto& fn : deferred) fn();
  return revision;
}

void KvStore::PlanLocked(absl::Span<const Change> changes,
                         std::vector<ChangeResult>& results,
                         std::vector<Mutation>& mutations,
                         std::vector<size_t>& writers,
                         std::vector<KvEngine::Guard>* guards) {
  {
    // What the batch has written so far, by key (nullopt: deleted).
    absl::flat_hash_map<absl::string_view, std::optional<std::string>> now;
    auto current = [&](absl::string_view key)
        -> absl::StatusOr<std::optional<std::string>> {
      if (auto it = now.find(key); it != now.end()) return it->second;
      if (guards != nullptr) {
        guards->push_back({std::string(key), engine_->ModRevision(key)});
      }
      return engine_->Get(key);
    };
    // Refuses the writes that would take a share past its bounds.
    ShareTally shares(*this);
    auto write = [&](size_t i, absl::string_view key,
                     std::optional<std::string> value) -> absl::Status {
      std::optional<size_t> value_bytes;
      if (value.has_value()) value_bytes = value->size();
      if (absl::Status s = shares.Change(key, value_bytes, /*enforce=*/true);
          !s.ok()) {
        return s;
      }
      // Later changes read what this one wrote; the last one (a single
      // call's only one) need not keep a copy.
      const bool last = i + 1 == changes.size();
      Mutation m;
      m.key.assign(key.data(), key.size());
      if (!value.has_value()) {
        m.kind = Mutation::Kind::kDelete;
      } else if (last) {
        m.value = std::move(*value);
      } else {
        m.value = *value;
      }
      mutations.push_back(std::move(m));
      writers.push_back(i);
      if (!last) now[key] = std::move(value);
      return absl::OkStatus();
    };
    // The queues as the batch leaves them, by name.
    struct QueuePlan {
      // The engine's items the batch has not popped: from `next`, `left`.
      std::map<int64_t, uint64_t>::const_iterator next;
      size_t left = 0;
      // Items the batch pushed and has not popped: numbers and values.
      std::deque<std::pair<int64_t, absl::string_view>> pushed;
      int64_t last_seq = 0;
    };
    absl::flat_hash_map<absl::string_view, QueuePlan> queues;
    auto plan_of = [&](absl::string_view name) -> QueuePlan& {
      auto [it, fresh] = queues.try_emplace(name);
      QueuePlan& plan = it->second;
      if (!fresh) return plan;
      // Numbers only grow: past the last item's, and past the revision
      // (so a queue emptied, or one emptied before a restart, does not
      // reuse the keys of items long gone).
      plan.last_seq = std::max(revision_, engine_->revision());
      if (auto q = queues_.find(name); q != queues_.end()) {
        plan.next = q->second.items.begin();
        plan.left = q->second.items.size();
        plan.last_seq =
            std::max(plan.last_seq, q->second.items.rbegin()->first);
      }
      return plan;
    };
    // Writes an item's key: `value`, or nullopt to delete it.
    auto write_item =
        [&](size_t i, std::string key,
            std::optional<absl::string_view> value) -> absl::Status {
      std::optional<size_t> value_bytes;
      if (value.has_value()) value_bytes = value->size();
      if (absl::Status s = shares.Change(key, value_bytes, /*enforce=*/true);
          !s.ok()) {
        return s;
      }
      if (guards != nullptr) {
        // A push's key must still be free, a pop's item still there: else
        // another replica pushed or popped first.
        guards->push_back(
            {key, value.has_value() ? 0 : engine_->ModRevision(key)});
      }
      Mutation m;
      m.key = std::move(key);
      if (value.has_value()) {
        m.value.assign(value->data(), value->size());
      } else {
        m.kind = Mutation::Kind::kDelete;
      }
      mutations.push_back(std::move(m));
      writers.push_back(i);
      return absl::OkStatus();
    };
    for (size_t i = 0; i < changes.size(); ++i) {
      const Change& c = changes[i];
      ChangeResult& r = results[i];
      r.status = c10d::CheckKey(rules_, c.key);
      if (r.status.ok() && (c.kind == Change::Kind::kSet ||
                            c.kind == Change::Kind::kCompareSet ||
                            c.kind == Change::Kind::kQueuePush)) {
        r.status = c10d::CheckValue(rules_, c.value);
      }
      if (!r.status.ok()) continue;
      if (c.kind == Change::Kind::kQueuePush ||
          c.kind == Change::Kind::kQueuePop) {
        if (!queue_load_.ok()) {
          r.status = queue_load_;
          continue;
        }
        QueuePlan& q = plan_of(c.key);
        if (c.kind == Change::Kind::kQueuePush) {
          const int64_t seq = q.last_seq + 1;
          std::string key = QueueItemKey(c.key, seq);
          r.status = write_item(i, key, c.value);
          if (!r.status.ok()) continue;
          q.last_seq = seq;
          q.pushed.emplace_back(seq, c.value);
          r.queue_item = std::move(key);
          continue;
        }
        r.number = q.left + q.pushed.size();
        if (r.number == 0) continue;
        if (q.left > 0) {
          std::string key = QueueItemKey(c.key, q.next->first);
          absl::StatusOr<std::optional<std::string>> value = engine_->Get(key);
          if (value.ok() && !value->has_value()) {
            value = absl::InternalError(absl::StrCat(
                "the queue index names the item '", absl::CHexEscape(key),
                "', which the engine does not hold"));
          }
          if (!value.ok()) {
            r.status = value.status();
            r.number = 0;
            continue;
          }
          r.value = std::move(**value);
          r.queue_item = std::move(key);
          ++q.next;
          --q.left;
        } else {
          r.value.assign(q.pushed.front().second.data(),
                         q.pushed.front().second.size());
          r.queue_item = QueueItemKey(c.key, q.pushed.front().first);
          q.pushed.pop_front();
        }
        // Deletes always pass.
        write_item(i, r.queue_item, std::nullopt).IgnoreError();
        continue;
      }
      if (c.kind == Change::Kind::kSet) {
        r.status = write(i, c.key, std::string(c.value));
        continue;
      }
      if (c.kind == Change::Kind::kDelete) {
        // Whether the key exists, without reading its value.
        auto it = now.find(c.key);
        if (it == now.end() && guards != nullptr) {
          guards->push_back({std::string(c.key), engine_->ModRevision(c.key)});
        }
        if (it != now.end() ? it->second.has_value()
                            : engine_->Contains(c.key)) {
          r.number = 1;
          write(i, c.key, std::nullopt).IgnoreError();  // Always passes.
        }
        continue;
      }
      absl::StatusOr<std::optional<std::string>> value = current(c.key);
      if (!value.ok()) {
        r.status = value.status();
        continue;
      }
      const std::string* now_value = value->has_value() ? &**value : nullptr;
      switch (c.kind) {
        case Change::Kind::kAdd: {
          absl::StatusOr<c10d::AddOutcome> sum =
              c10d::Add(c.key, now_value, c.delta);
          if (!sum.ok()) {
            r.status = sum.status();
            break;
          }
          r.status = write(i, c.key, std::move(sum->text));
          if (r.status.ok()) r.number = sum->value;
          break;
        }
        case Change::Kind::kCompareSet: {
          c10d::CompareSetOutcome cas =
              c10d::CompareSet(now_value, c.expected, c.value);
          r.value.assign(cas.result.data(), cas.result.size());
          if (cas.write) {
            r.status = write(i, c.key, r.value);
            r.number = r.status.ok() ? 1 : 0;
          }
          break;
        }
        case Change::Kind::kAppend: {
          absl::StatusOr<std::string> appended =
              c10d::Append(rules_, c.key, now_value, c.value);
          if (!appended.ok()) {
            r.status = appended.status();
          } else {
            r.status = write(i, c.key, std::move(*appended));
          }
          break;
        }
        case Change::Kind::kSet:
        case Change::Kind::kDelete:
        case Change::Kind::kQueuePush:
        case Change::Kind::kQueuePop:
          break;
      }
    }
  }
}

std::vector<ChangeResult> KvStore::ApplyBatchShared(
    absl::Span<const Change> changes) {
  // A queue is many keys: guards catch another replica's push or pop of
  // the same item, but only a view that holds every push acknowledged
  // before this call numbers this one after them.
  for (const Change& c : changes) {
    if (c.kind != Change::Kind::kQueuePush &&
        c.kind != Change::Kind::kQueuePop) {
      continue;
    }
    if (absl::Status s = CatchUp(); !s.ok()) {
      std::vector<ChangeResult> results(changes.size());
      for (ChangeResult& r : results) r.status = s;
      return results;
    }
    break;
  }
  for (int attempt = 1;; ++attempt) {
    std::vector<ChangeResult> results(changes.size());
    std::vector<Mutation> mutations;
    std::vector<size_t> writers;
    std::vector<KvEngine::Guard> guards;
    int64_t revision;
    {
      absl::MutexLock lock(&mu_);
      PlanLocked(changes, results, mutations, writers, &guards);
      revision = revision_;
    }
    if (!mutations.empty()) {
      absl::StatusOr<int64_t> committed =
          shared_->ApplyGuarded(mutations, guards);
      if (absl::IsAborted(committed.status()) &&
          attempt < kMaxGuardedAttempts) {
        // Another writer changed a key this batch read: read it again.
        if (absl::Status s = CatchUp(); !s.ok())
          committed = s;
        else
          continue;
      }
      if (committed.ok()) {
        revision = *committed;
        // Read-your-writes: the reply waits for the view to hold it.
        AwaitRevision(revision, kFeedTimeout).IgnoreError();
      } else {
        for (size_t i : writers) {
          results[i].status = committed.status();
          results[i].number = 0;
        }
      }
    }
    for (ChangeResult& r : results) r.revision = revision;
    return results;
  }
}

std::vector<ChangeResult> KvStore::ApplyBatch(
    absl::Span<const Change> changes) {
  if (shared_ != nullptr) return ApplyBatchShared(changes);
  std::vector<ChangeResult> results(changes.size());
  std::vector<Mutation> mutations;
  std::vector<size_t> writers;  // Changes with a mutation in `mutations`.
  Deferred deferred;
  {
    absl::MutexLock lock(&mu_);
    PlanLocked(changes, results, mutations, writers, nullptr);
    int64_t revision = revision_;
    if (!mutations.empty()) {
      absl::StatusOr<int64_t> committed =
          CommitLocked(std::move(mutations), deferred);
      if (committed.ok()) {
        revision = *committed;
      } else {
        for (size_t i : writers) {
          results[i].status = committed.status();
          results[i].number = 0;
        }
      }
    }
    for (ChangeResult& r : results) r.revision = revision;
  }
  for (auto& fn : deferred) fn();
  return results;
}

absl::StatusOr<CheckResult> KvStore::Check(absl::Span<const std::string> keys) {
  return CheckPresent(keys, /*queues=*/false);
}

absl::StatusOr<CheckResult> KvStore::CheckPresent(
    absl::Span<const std::string> keys, bool queues) {
  if (absl::Status s = c10d::CheckKeys(rules_, keys); !s.ok()) return s;
  if (absl::Status s = CatchUp(); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  CheckResult result;
  result.revision = revision_;
  result.all_exist = true;
  for (const std::string& key : keys) {
    if (!PresentLocked(key, queues)) {
      result.all_exist = false;
      break;
    }
  }
  return result;
}

absl::StatusOr<std::optional<std::string>> KvStore::TryGet(
    absl::string_view key) {
  if (absl::Status s = c10d::CheckKey(rules_, key); !s.ok()) return s;
  if (absl::Status s = CatchUp(); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  return engine_->Get(key);
}

absl::StatusOr<NumKeysResult> KvStore::NumKeys(absl::string_view prefix) {
  if (absl::Status s = c10d::CheckPrefix(rules_, prefix); !s.ok()) return s;
  if (absl::Status s = CatchUp(); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  NumKeysResult result;
  result.revision = revision_;
  if (prefix.empty()) {
    result.num_keys = engine_->NumKeys();
  } else {
    absl::StatusOr<int64_t> n = engine_->CountKeys(prefix);
    if (!n.ok()) return n.status();
    result.num_keys = *n;
  }
  if (absl::StartsWith(kQueuePrefix, prefix)) {
    result.num_keys -= queue_items_;  // All of them lie under `prefix`.
  } else if (absl::StartsWith(prefix, kQueuePrefix)) {
    result.num_keys = 0;
  }
  return result;
}

absl::StatusOr<ListResult> KvStore::ListKeys(absl::string_view prefix,
                                             size_t page_size,
                                             absl::string_view page_token) {
  if (absl::Status s = c10d::CheckPrefix(rules_, prefix); !s.ok()) return s;
  if (page_size == 0) page_size = limits_.max_list_page;
  if (page_size > limits_.max_list_page) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size ", page_size, " is over the limit of ",
                     limits_.max_list_page, " (max_list_page)"));
  }
  if (!page_token.empty() && !absl::StartsWith(page_token, prefix)) {
    return absl::InvalidArgumentError(
        "page_token does not belong to this prefix: pass back the "
        "next_page_token of the previous page, with the same prefix");
  }
  if (absl::Status s = CatchUp(); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  absl::StatusOr<std::vector<std::string>> keys =
      engine_->ListKeys(prefix, page_token, page_size + 1);
  if (!keys.ok()) return keys.status();
  ListResult result;
  result.revision = revision_;
  if (keys->size() > page_size) {
    keys->pop_back();
    result.next_page_token = keys->back();
  }
  result.keys = std::move(*keys);
  return result;
}

KvStore::WaitId KvStore::WaitForKeys(std::vector<std::string> keys,
                                     bool read_values, absl::Duration timeout,
                                     ReadCallback done) {
  return StartWait(std::move(keys), read_values, /*queues=*/false, timeout,
                   std::move(done));
}

KvStore::WaitId KvStore::StartWait(std::vector<std::string> keys,
                                   bool read_values, bool queues,
                                   absl::Duration timeout, ReadCallback done) {
  if (absl::Status s = c10d::CheckKeys(rules_, keys); !s.ok()) {
    done(s);
    return 0;
  }
  const absl::Time deadline =
      absl::Now() + std::max(timeout, absl::ZeroDuration());
  auto waiter = std::make_unique<Waiter>();
  waiter->keys = std::move(keys);
  waiter->read_values = read_values;
  waiter->queues = queues;
  waiter->done = std::move(done);
  waiter->timeout = std::max(timeout, absl::ZeroDuration());
  waiter->registering = true;
  // The distinct keys, worked out before taking the lock.
  std::vector<absl::string_view> distinct;
  {
    absl::flat_hash_set<absl::string_view> seen;
    distinct.reserve(waiter->keys.size());
    for (const std::string& key : waiter->keys) {
      if (seen.insert(key).second) distinct.push_back(key);
    }
  }

  WaitId id = 0;
  absl::Status shutdown;
  {
    absl::MutexLock lock(&mu_);
    shutdown = shutdown_;
    if (shutdown.ok()) {
      id = next_wait_id_++;
      waiter->id = id;
      waiter->checked_at = revision_;
      waiters_.emplace(id, std::move(waiter));
    }
  }
  if (!shutdown.ok()) {
    waiter->done(shutdown);
    return 0;
  }
  // Index the missing keys a slice at a time. Between slices the waiter
  // may be cancelled or shut down; then it is gone from waiters_ and the
  // rest is skipped. Keys deleted after their slice was looked at are caught
  // by TryCompleteLocked's recheck. The timeout starts counting now but is
  // armed only once every key has been looked at, so it never reports keys
  // as missing that were not checked.
  for (size_t begin = 0; begin < distinct.size() || begin == 0;
       begin += kKeysPerSlice) {
    Deferred deferred;
    {
      absl::MutexLock lock(&mu_);
      auto it = waiters_.find(id);
      if (it == waiters_.end()) return id;
      Waiter& w = *it->second;
      const size_t end = std::min(distinct.size(), begin + kKeysPerSlice);
      for (size_t i = begin; i < end; ++i) {
        if (!PresentLocked(distinct[i], w.queues)) {
          IndexWaiterLocked(distinct[i], w);
          ++w.missing;
        }
      }
      if (end == distinct.size()) {
        w.registering = false;
        if (w.missing == 0 && TryCompleteLocked(it->second, deferred)) {
          waiters_.erase(it);
        } else if (deadline != absl::InfiniteFuture()) {
          // (A wait without a timeout, as a TCPStore WAIT, ends only when
          // its keys exist or it is cancelled: it needs no timer.)
          w.timer =
              timer_.Schedule(deadline, [this, id] { OnWaitTimeout(id); });
        }
      }
    }
    for (auto& fn : deferred) fn();
    if (distinct.empty()) break;
  }
  return id;
}

void KvStore::CancelWait(WaitId id) {
  absl::MutexLock lock(&mu_);
  auto it = waiters_.find(id);
  if (it == waiters_.end()) return;
  if (it->second->timer != 0) timer_.Cancel(it->second->timer);
  UnindexWaiterLocked(*it->second);
  waiters_.erase(it);
}

void KvStore::OnWaitTimeout(WaitId id) {
  std::unique_ptr<Waiter> waiter;
  {
    absl::MutexLock lock(&mu_);
    auto it = waiters_.find(id);
    if (it == waiters_.end()) return;
    waiter = std::move(it->second);
    waiters_.erase(it);
  }
  // Out of waiters_, the waiter can no longer complete; its index entries
  // are removed (and the missing keys named) a slice at a time.
  std::vector<absl::string_view> missing;
  absl::flat_hash_set<absl::string_view> distinct;
  for (size_t begin = 0; begin < waiter->keys.size(); begin += kKeysPerSlice) {
    absl::MutexLock lock(&mu_);
    const size_t end = std::min(waiter->keys.size(), begin + kKeysPerSlice);
    for (size_t i = begin; i < end; ++i) {
      const std::string& key = waiter->keys[i];
      if (waiter->queues) {
        if (auto q = queue_waiters_.find(key); q != queue_waiters_.end()) {
          q->second.erase(id);
          if (q->second.empty()) queue_waiters_.erase(q);
        }
      }
      auto k = waiters_by_key_.find(key);
      if (k == waiters_by_key_.end() || !k->second.erase(id)) continue;
      if (k->second.empty()) waiters_by_key_.erase(k);
      if (distinct.insert(key).second) missing.push_back(key);
    }
  }
  waiter->done(
      c10d::WaitTimeout(waiter->timeout, waiter->keys.size(), missing));
}

absl::StatusOr<KvStore::WatchStart> KvStore::Watch(absl::string_view prefix,
                                                   int64_t from_revision,
                                                   EventsCallback on_events,
                                                   CloseCallback on_close) {
  if (absl::Status s = c10d::CheckPrefix(rules_, prefix); !s.ok()) return s;
  if (from_revision < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("from_revision must be >= 0, got ", from_revision));
  }
  absl::MutexLock lock(&mu_);
  if (!shutdown_.ok()) return shutdown_;
  WatchStart start;
  start.start_revision = from_revision == 0 ? revision_ + 1 : from_revision;
  if (start.start_revision <= compacted_revision_) {
    return absl::OutOfRangeError(absl::StrCat(
        "revision ", from_revision,
        " is no longer in the watch history (it "
        "holds revisions after ",
        compacted_revision_,
        "; history is bounded and starts afresh when cohortd restarts): list "
        "the keys, then watch from the listing's revision + 1"));
  }
  std::vector<Event> replay;
  for (const Event& e : history_) {
    if (e.revision >= start.start_revision && absl::StartsWith(e.key, prefix)) {
      replay.push_back(e);
    }
  }
  if (!replay.empty()) on_events(std::move(replay));
  start.id = next_watch_id_++;
  watchers_.emplace(start.id,
                    Watcher{std::string(prefix), start.start_revision,
                            std::move(on_events), std::move(on_close)});
  return start;
}

void KvStore::CancelWatch(WatchId id) {
  absl::MutexLock lock(&mu_);
  watchers_.erase(id);
}

void KvStore::Shutdown(absl::Status status) {
  absl::flat_hash_map<WaitId, std::unique_ptr<Waiter>> waiters;
  absl::flat_hash_map<WatchId, Watcher> watchers;
  {
    absl::MutexLock lock(&mu_);
    if (!shutdown_.ok()) return;
    shutdown_ = status;
    waiters.swap(waiters_);
    watchers.swap(watchers_);
    waiters_by_key_.clear();
    queue_waiters_.clear();
    for (auto& [id, waiter] : waiters) {
      if (waiter->timer != 0) timer_.Cancel(waiter->timer);
    }
  }
  for (auto& [id, waiter] : waiters) waiter->done(status);
  for (auto& [id, watcher] : watchers) watcher.on_close(status);
}

absl::Status KvStore::CheckWritable() {
  absl::MutexLock lock(&mu_);
  return engine_->CheckWritable();
}

absl::Status KvStore::Flush() {
  absl::MutexLock lock(&mu_);
  return engine_->Flush();
}

absl::Status KvStore::CheckSharesLocked(absl::Span<const Mutation> mutations) {
  ShareTally tally(*this);
  for (const Mutation& m : mutations) {
    if (absl::Status s = tally.Change(m.key, SizeOf(m), /*enforce=*/true);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status KvStore::SetShares(std::vector<Share> shares) {
  absl::MutexLock serial(&shares_mu_);
  std::vector<std::shared_ptr<ShareState>> to_scan;
  {
    absl::MutexLock lock(&mu_);
    std::vector<std::shared_ptr<ShareState>> next;
    for (Share& share : shares) {
      auto state = std::make_shared<ShareState>();
      state->name = std::move(share.name);
      state->roots = DisjointRoots(std::move(share.roots));
      for (const std::shared_ptr<ShareState>& old : shares_) {
        if (old->name == state->name && old->roots == state->roots) {
          state = old;
          break;
        }
      }
      if (!state->counted()) {
        // Counted afresh, from nothing.
        state->usage = ShareUsage();
        state->scanning = 0;
        state->cursor.clear();
        to_scan.push_back(state);
      }
      next.push_back(std::move(state));
    }
    shares_ = std::move(next);
  }
  for (const std::shared_ptr<ShareState>& state : to_scan) {
    if (absl::Status s = ScanShare(*state); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status KvStore::ScanShare(ShareState& share) {
  for (;;) {
    absl::MutexLock lock(&mu_);
    if (share.counted()) return absl::OkStatus();
    const std::string& root = share.roots[share.scanning];
    absl::StatusOr<std::vector<std::string>> keys =
        engine_->ListKeys(root, share.cursor, kKeysPerSlice);
    if (!keys.ok()) {
      return absl::Status(
          keys.status().code(),
          absl::StrCat("counting the keys of ", absl::CHexEscape(share.name),
                       " under '", absl::CHexEscape(root),
                       "': ", keys.status().message()));
    }
    size_t bytes = 0;
    for (const std::string& key : *keys) {
      absl::StatusOr<std::optional<std::string>> value = engine_->Get(key);
      if (!value.ok()) {
        return absl::Status(
            value.status().code(),
            absl::StrCat("counting the keys of ", absl::CHexEscape(share.name),
                         ": reading '", absl::CHexEscape(key),
                         "': ", value.status().message()));
      }
      // A key listed is there: the store's lock is held.
      if (value->has_value()) {
        ++share.usage.keys;
        share.usage.bytes += key.size() + (*value)->size();
        bytes += (*value)->size();
      }
      share.cursor = key;
      if (bytes > kScanBytesPerSlice) break;
    }
    if (bytes <= kScanBytesPerSlice && keys->size() < kKeysPerSlice) {
      ++share.scanning;
      share.cursor.clear();
    }
  }
}

std::optional<ShareUsage> KvStore::share_usage(absl::string_view name) {
  absl::MutexLock lock(&mu_);
  for (const std::shared_ptr<ShareState>& share : shares_) {
    if (share->name == name) {
      if (!share->counted()) return std::nullopt;
      return share->usage;
    }
  }
  return std::nullopt;
}

StoreStats KvStore::stats() {
  StoreStats stats;
  const KvEngine* engine;
  {
    absl::MutexLock lock(&mu_);
    stats.keys = engine_->NumKeys();
    stats.revision = revision_;
    stats.waiters = waiters_.size();
    stats.watches = watchers_.size();
    stats.share_refused_keys = share_refused_keys_;
    stats.share_refused_bytes = share_refused_bytes_;
    engine = engine_.get();
  }
  stats.disk_bytes = engine->DiskBytes();
  return stats;
}

void KvStore::SetSyncObserver(std::function<void(absl::Duration)> observe) {
  absl::MutexLock lock(&mu_);
  engine_->SetSyncObserver(std::move(observe));
}

}  // namespace cohort::store
