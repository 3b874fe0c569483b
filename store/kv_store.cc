#include "store/kv_store.h"

#include <algorithm>
#include <deque>
#include <map>
#include <utility>

#include "absl/base/attributes.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace cohort::store {

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
      engine_(std::move(engine)),
      shared_(engine_->shared() ? engine_.get() : nullptr),
      history_(limits.history_events, limits.history_bytes,
               engine_->revision()) {
  revision_ = engine_->revision();
  last_delete_revision_ = revision_;
  {
    absl::MutexLock lock(&mu_);
    queue_load_ = LoadQueuesLocked();
  }
  if (shared_ != nullptr) {
    history_.ExpectReplay(revision_);
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
  if (absl::Status s = ApplyLocked(mutations, revision); !s.ok()) return s;
  revision_ = revision;
  PublishLocked(revision, std::move(mutations), deferred);
  return revision;
}

absl::Status KvStore::ApplyLocked(absl::Span<const Mutation> mutations,
                                  int64_t revision) {
  ShareTally tally(*this);
  for (const Mutation& m : mutations) {
    tally.Change(m.key, SizeOf(m), /*enforce=*/false).IgnoreError();
  }
  if (absl::Status s = engine_->Apply(mutations, revision); !s.ok()) return s;
  tally.Commit();
  return absl::OkStatus();
}

void KvStore::PublishLocked(int64_t revision, std::vector<Mutation> mutations,
                            Deferred& deferred) {
  std::vector<std::string> pushed;
  IndexQueuesLocked(mutations, pushed);
  bool deleted = false;
  std::vector<Event> events =
      WatchHistory::EventsOf(revision, std::move(mutations), &deleted);
  // Before any wait completes: one may have seen a key this deletes.
  if (deleted) last_delete_revision_ = revision;
  history_.Deliver(revision, events);
  for (const Event& e : events) {
    if (e.type == Event::Type::kPut) WakeWaitersLocked(e.key, deferred);
  }
  // One wait per push: the one whose client pops the item.
  for (const std::string& queue : pushed) {
    WakeQueueWaiterLocked(queue, deferred);
  }
  history_.Append(std::move(events));
}

void KvStore::WakeWaitersLocked(absl::string_view key, Deferred& deferred) {
  waits_.KeyPut(key, [&](Waiter& waiter) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return TryCompleteLocked(waiter, deferred);
  });
}

void KvStore::WakeQueueWaiterLocked(absl::string_view queue,
                                    Deferred& deferred) {
  if (QueueLengthLocked(queue) == 0) return;
  waits_.QueuePushed(queue,
                     [&](Waiter& waiter) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                       return TryCompleteLocked(waiter, deferred);
                     });
}

bool KvStore::PresentLocked(absl::string_view key, bool queues) const {
  return engine_->Contains(key) || (queues && QueueLengthLocked(key) > 0);
}

bool KvStore::TryCompleteLocked(Waiter& waiter, Deferred& deferred) {
  if (last_delete_revision_ > waiter.checked_at) {
    // A key may have been deleted after it was seen: look again.
    std::vector<absl::string_view> missing;
    for (const std::string& key : waiter.keys) {
      if (!PresentLocked(key, waiter.queues)) missing.push_back(key);
    }
    waiter.checked_at = revision_;
    if (!missing.empty()) {
      absl::flat_hash_set<absl::string_view> distinct(missing.begin(),
                                                      missing.end());
      waiter.missing = distinct.size();
      for (absl::string_view key : distinct) waits_.Index(key, waiter);
      return false;
    }
  }
  if (waiter.timer != 0) timer_.Cancel(waiter.timer);
  const int64_t revision = revision_;
  if (!waiter.read_values) {
    deferred.push_back([done = std::move(waiter.done), revision,
                        queue_wake = waiter.queue_wake] {
      ReadResult result;
      result.revision = revision;
      result.queue_wake = queue_wake;
      done(std::move(result));
    });
    return true;
  }
  // The values are pinned now and read after the lock is released.
  deferred.push_back(
      [done = std::move(waiter.done), revision,
       read = std::shared_ptr<KvEngine::PreparedRead>(
           engine_->PrepareRead(std::move(waiter.keys)))]() mutable {
        absl::StatusOr<std::vector<std::string>> values = read->Read();
        if (!values.ok()) return done(values.status());
        ReadResult result;
        result.revision = revision;
        result.values = std::move(*values);
        done(std::move(result));
      });
  return true;
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
  if (shared_ != nullptr) return MultiSetShared(std::move(m));
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

// One batch's plan (PlanLocked): each change sees what the changes before
// it wrote and the queues as they leave them. Lives within one hold of the
// store's lock; reads the store's engine and queue index, changes neither.
//
// Every write goes through here. The methods that run once per change are
// forced inline, so that PlanLocked's loop compiles as one function, as it
// did when they were its lambdas: out of line, each would cost a call (1.3%
// more instructions on a batch of 8 changes, under callgrind). Write and
// WriteItem stay calls, as those lambdas did.
class KvStore::BatchPlan {
 public:
  BatchPlan(KvStore& store, absl::Span<const Change> changes,
            std::vector<ChangeResult>& results,
            std::vector<Mutation>& mutations, std::vector<size_t>& writers,
            std::vector<KvEngine::Guard>* guards)
      : store_(store),
        changes_(changes),
        results_(results),
        mutations_(mutations),
        writers_(writers),
        guards_(guards),
        shares_(store) {}

  // Plans changes[i] into results[i] (all but its revision), after the
  // changes before it.
  ABSL_ATTRIBUTE_ALWAYS_INLINE void Plan(size_t i)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(store_.mu_) {
    const Change& c = changes_[i];
    ChangeResult& r = results_[i];
    r.status = c10d::CheckKey(store_.rules_, c.key);
    if (r.status.ok() &&
        (c.kind == Change::Kind::kSet || c.kind == Change::Kind::kCompareSet ||
         c.kind == Change::Kind::kQueuePush)) {
      r.status = c10d::CheckValue(store_.rules_, c.value);
    }
    if (!r.status.ok()) return;
    switch (c.kind) {
      case Change::Kind::kSet:
        // On a shared engine a set is guarded too: a commit that reached
        // etcd late (its answer lost, the network cut and healed) must not
        // land after a later write and bring an old value back.
        if (guards_ != nullptr && now_.find(c.key) == now_.end()) {
          guards_->push_back(
              {std::string(c.key), store_.engine_->ModRevision(c.key)});
        }
        r.status = Write(i, c.key, std::string(c.value));
        return;
      case Change::Kind::kDelete:
        return Delete(i);
      case Change::Kind::kAdd:
      case Change::Kind::kCompareSet:
      case Change::Kind::kAppend:
        return ReadModifyWrite(i);
      case Change::Kind::kQueuePush:
      case Change::Kind::kQueuePop: {
        if (!store_.queue_load_.ok()) {
          r.status = store_.queue_load_;
          return;
        }
        QueuePlan& q = PlanOf(c.key);
        return c.kind == Change::Kind::kQueuePush ? Push(i, q) : Pop(i, q);
      }
    }
  }

 private:
  // A queue as the batch leaves it.
  struct QueuePlan {
    // The engine's items the batch has not popped: from `next`, `left`.
    std::map<int64_t, uint64_t>::const_iterator next;
    size_t left = 0;
    // Items the batch pushed and has not popped: numbers and values.
    std::deque<std::pair<int64_t, absl::string_view>> pushed;
    int64_t last_seq = 0;
  };

  // kDelete: whether the key exists, without reading its value.
  ABSL_ATTRIBUTE_ALWAYS_INLINE void Delete(size_t i)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(store_.mu_) {
    const absl::string_view key = changes_[i].key;
    auto it = now_.find(key);
    if (it == now_.end() && guards_ != nullptr) {
      guards_->push_back({std::string(key), store_.engine_->ModRevision(key)});
    }
    if (it != now_.end() ? it->second.has_value()
                         : store_.engine_->Contains(key)) {
      results_[i].number = 1;
      Write(i, key, std::nullopt).IgnoreError();  // Always passes.
    }
  }

  // kAdd, kCompareSet and kAppend: a write computed from the key's value.
  ABSL_ATTRIBUTE_ALWAYS_INLINE void ReadModifyWrite(size_t i)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(store_.mu_) {
    const Change& c = changes_[i];
    ChangeResult& r = results_[i];
    absl::StatusOr<std::optional<std::string>> value = Current(c.key);
    if (!value.ok()) {
      r.status = value.status();
      return;
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
        r.status = Write(i, c.key, std::move(sum->text));
        if (r.status.ok()) r.number = sum->value;
        break;
      }
      case Change::Kind::kCompareSet: {
        c10d::CompareSetOutcome cas =
            c10d::CompareSet(now_value, c.expected, c.value);
        r.value.assign(cas.result.data(), cas.result.size());
        if (cas.write) {
          r.status = Write(i, c.key, r.value);
          r.number = r.status.ok() ? 1 : 0;
        }
        break;
      }
      case Change::Kind::kAppend: {
        absl::StatusOr<std::string> appended =
            c10d::Append(store_.rules_, c.key, now_value, c.value);
        if (!appended.ok()) {
          r.status = appended.status();
        } else {
          r.status = Write(i, c.key, std::move(*appended));
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

  // `key`'s value as the batch so far leaves it (nullopt: absent).
  ABSL_ATTRIBUTE_ALWAYS_INLINE absl::StatusOr<std::optional<std::string>>
  Current(absl::string_view key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(store_.mu_) {
    if (auto it = now_.find(key); it != now_.end()) return it->second;
    if (guards_ != nullptr) {
      guards_->push_back({std::string(key), store_.engine_->ModRevision(key)});
    }
    return store_.engine_->Get(key);
  }

  // Change i writes `value` to `key` (nullopt: deletes it), unless that
  // would take a share past its bounds.
  absl::Status Write(size_t i, absl::string_view key,
                     std::optional<std::string> value)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(store_.mu_) {
    std::optional<size_t> value_bytes;
    if (value.has_value()) value_bytes = value->size();
    if (absl::Status s = shares_.Change(key, value_bytes, /*enforce=*/true);
        !s.ok()) {
      return s;
    }
    // Later changes read what this one wrote; the last one (a single
    // call's only one) need not keep a copy.
    const bool last = i + 1 == changes_.size();
    Mutation m;
    m.key.assign(key.data(), key.size());
    if (!value.has_value()) {
      m.kind = Mutation::Kind::kDelete;
    } else if (last) {
      m.value = std::move(*value);
    } else {
      m.value = *value;
    }
    mutations_.push_back(std::move(m));
    writers_.push_back(i);
    if (!last) now_[key] = std::move(value);
    return absl::OkStatus();
  }

  // The plan of the queue `name`, from the store's index on first use.
  ABSL_ATTRIBUTE_ALWAYS_INLINE QueuePlan& PlanOf(absl::string_view name)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(store_.mu_) {
    auto [it, fresh] = queues_.try_emplace(name);
    QueuePlan& plan = it->second;
    if (!fresh) return plan;
    // Numbers only grow: past the last item's, and past the revision
    // (so a queue emptied, or one emptied before a restart, does not
    // reuse the keys of items long gone).
    plan.last_seq = std::max(store_.revision_, store_.engine_->revision());
    if (auto q = store_.queues_.find(name); q != store_.queues_.end()) {
      plan.next = q->second.items.begin();
      plan.left = q->second.items.size();
      plan.last_seq = std::max(plan.last_seq, q->second.items.rbegin()->first);
    }
    return plan;
  }

  // kQueuePush to `q`: the item goes after its last, under a fresh key.
  ABSL_ATTRIBUTE_ALWAYS_INLINE void Push(size_t i, QueuePlan& q)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(store_.mu_) {
    const Change& c = changes_[i];
    ChangeResult& r = results_[i];
    const int64_t seq = q.last_seq + 1;
    std::string key = QueueItemKey(c.key, seq);
    r.status = WriteItem(i, key, c.value);
    if (!r.status.ok()) return;
    q.last_seq = seq;
    q.pushed.emplace_back(seq, c.value);
    r.queue_item = std::move(key);
  }

  // kQueuePop from `q`: takes its oldest item, the engine's before the
  // batch's own.
  ABSL_ATTRIBUTE_ALWAYS_INLINE void Pop(size_t i, QueuePlan& q)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(store_.mu_) {
    const Change& c = changes_[i];
    ChangeResult& r = results_[i];
    r.number = q.left + q.pushed.size();
    if (r.number == 0) return;
    if (q.left > 0) {
      std::string key = QueueItemKey(c.key, q.next->first);
      absl::StatusOr<std::optional<std::string>> value =
          store_.engine_->Get(key);
      if (value.ok() && !value->has_value()) {
        value = absl::InternalError(absl::StrCat(
            "the queue index names the item '", absl::CHexEscape(key),
            "', which the engine does not hold"));
      }
      if (!value.ok()) {
        r.status = value.status();
        r.number = 0;
        return;
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
    WriteItem(i, r.queue_item, std::nullopt).IgnoreError();
  }

  // Change i writes an item's key: `value`, or nullopt to delete it.
  absl::Status WriteItem(size_t i, std::string key,
                         std::optional<absl::string_view> value)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(store_.mu_) {
    std::optional<size_t> value_bytes;
    if (value.has_value()) value_bytes = value->size();
    if (absl::Status s = shares_.Change(key, value_bytes, /*enforce=*/true);
        !s.ok()) {
      return s;
    }
    if (guards_ != nullptr) {
      // A push's key must still be free, a pop's item still there: else
      // another replica pushed or popped first.
      guards_->push_back(
          {key, value.has_value() ? 0 : store_.engine_->ModRevision(key)});
    }
    Mutation m;
    m.key = std::move(key);
    if (value.has_value()) {
      m.value.assign(value->data(), value->size());
    } else {
      m.kind = Mutation::Kind::kDelete;
    }
    mutations_.push_back(std::move(m));
    writers_.push_back(i);
    return absl::OkStatus();
  }

  KvStore& store_;
  const absl::Span<const Change> changes_;
  std::vector<ChangeResult>& results_;
  std::vector<Mutation>& mutations_;
  std::vector<size_t>& writers_;
  // With it, every key read from the engine and its modification revision.
  std::vector<KvEngine::Guard>* const guards_;
  // What the batch has written so far, by key (nullopt: deleted).
  absl::flat_hash_map<absl::string_view, std::optional<std::string>> now_;
  // Refuses the writes that would take a share past its bounds.
  ShareTally shares_;
  // The queues as the batch leaves them, by name.
  absl::flat_hash_map<absl::string_view, QueuePlan> queues_;
};

void KvStore::PlanLocked(absl::Span<const Change> changes,
                         std::vector<ChangeResult>& results,
                         std::vector<Mutation>& mutations,
                         std::vector<size_t>& writers,
                         std::vector<KvEngine::Guard>* guards) {
  BatchPlan plan(*this, changes, results, mutations, writers, guards);
  for (size_t i = 0; i < changes.size(); ++i) plan.Plan(i);
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

absl::StatusOr<std::vector<std::optional<std::string>>> KvStore::TryGetMany(
    absl::Span<const std::string> keys) {
  if (absl::Status s = c10d::CheckKeys(rules_, keys); !s.ok()) return s;
  if (absl::Status s = CatchUp(); !s.ok()) return s;
  std::vector<std::optional<std::string>> values;
  values.reserve(keys.size());
  absl::MutexLock lock(&mu_);
  for (const std::string& key : keys) {
    absl::StatusOr<std::optional<std::string>> value = engine_->Get(key);
    if (!value.ok()) return value.status();
    values.push_back(*std::move(value));
  }
  return values;
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

absl::Status KvStore::ReadyToWait(absl::Span<const std::string> keys) {
  if (absl::Status s = c10d::CheckKeys(rules_, keys); !s.ok()) return s;
  return CatchUp();
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
  if (absl::Status s = ReadyToWait(keys); !s.ok()) {
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
      waiter->checked_at = revision_;
      id = waits_.Add(std::move(waiter));
    }
  }
  if (!shutdown.ok()) {
    waiter->done(shutdown);
    return 0;
  }
  // Index the missing keys a slice at a time. Between slices the waiter
  // may be cancelled or shut down; then it is gone from waits_ and the
  // rest is skipped. Keys deleted after their slice was looked at are caught
  // by TryCompleteLocked's recheck. The timeout starts counting now but is
  // armed only once every key has been looked at, so it never reports keys
  // as missing that were not checked.
  for (size_t begin = 0; begin < distinct.size() || begin == 0;
       begin += kKeysPerSlice) {
    Deferred deferred;
    {
      absl::MutexLock lock(&mu_);
      Waiter* found = waits_.Find(id);
      if (found == nullptr) return id;
      Waiter& w = *found;
      const size_t end = std::min(distinct.size(), begin + kKeysPerSlice);
      for (size_t i = begin; i < end; ++i) {
        if (!PresentLocked(distinct[i], w.queues)) {
          waits_.Index(distinct[i], w);
          ++w.missing;
        }
      }
      if (end == distinct.size()) {
        w.registering = false;
        if (w.missing == 0 && TryCompleteLocked(w, deferred)) {
          waits_.Erase(id);
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
  std::unique_ptr<Waiter> waiter = waits_.Remove(id);
  if (waiter != nullptr && waiter->timer != 0) timer_.Cancel(waiter->timer);
}

void KvStore::OnWaitTimeout(WaitId id) {
  std::unique_ptr<Waiter> waiter;
  {
    absl::MutexLock lock(&mu_);
    waiter = waits_.Take(id);
    if (waiter == nullptr) return;
  }
  // Out of waits_, the waiter can no longer complete; its index entries
  // are removed (and the missing keys named) a slice at a time.
  std::vector<absl::string_view> missing;
  absl::flat_hash_set<absl::string_view> distinct;
  for (size_t begin = 0; begin < waiter->keys.size(); begin += kKeysPerSlice) {
    absl::MutexLock lock(&mu_);
    const size_t end = std::min(waiter->keys.size(), begin + kKeysPerSlice);
    for (size_t i = begin; i < end; ++i) {
      const std::string& key = waiter->keys[i];
      if (waits_.Unindex(id, key, waiter->queues) &&
          distinct.insert(key).second) {
        missing.push_back(key);
      }
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
  return history_.Watch(prefix, from_revision, revision_, std::move(on_events),
                        std::move(on_close));
}

void KvStore::CancelWatch(WatchId id) {
  absl::MutexLock lock(&mu_);
  history_.Cancel(id);
}

void KvStore::Shutdown(absl::Status status) {
  absl::flat_hash_map<WaitId, std::unique_ptr<Waiter>> waiters;
  absl::flat_hash_map<WatchId, WatchHistory::Watcher> watchers;
  {
    absl::MutexLock lock(&mu_);
    if (!shutdown_.ok()) return;
    shutdown_ = status;
    waiters = waits_.TakeAll();
    watchers = history_.TakeAll();
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
    stats.waiters = waits_.size();
    stats.watches = history_.watch_count();
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
