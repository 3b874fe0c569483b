// KvStore: c10d Store semantics, blocking waits and watches over a KvEngine.
//
// This is cohortd's store as a plain object with no I/O of its own, so the
// rules are unit-tested without a network and shared by the gRPC service and
// the client's in-process store. Every operation is linearizable: one mutex
// orders them all, and each mutation is applied to the engine (and so its
// write-ahead log) before the call returns.
//
// Blocking operations never block a thread: WaitForKeys registers a callback
// that runs when the keys exist, when its timeout passes (on one shared
// timer thread) or at Shutdown.
//
// It also keeps TCPStore's queues, as entries under kQueuePrefix
// (queue_keys.h): so they are as durable as every other key in every
// engine, and visible to whoever reads the store. An index of them is kept
// in memory, loaded from the engine at start and updated by every change
// applied (on a shared engine, by any replica).
//
// Its parts, all under the one mutex: the pending waits (wait_index.h), the
// watches and their history (watch_history.h), the queues
// (kv_store_queues.cc), and the path of a shared engine, whose commits are
// made without the mutex and come back through its feed
// (kv_store_shared.cc).
#ifndef COHORT_STORE_KV_STORE_H_
#define COHORT_STORE_KV_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/deadline_timer.h"
#include "proto/c10d/rules.h"
#include "store/kv_engine.h"
#include "store/queue_keys.h"
#include "store/wait_index.h"
#include "store/watch_history.h"

namespace cohort::store {

// Request limits. Violations fail with INVALID_ARGUMENT naming the limit.
struct StoreLimits {
  // c10d's limits, with its defaults (proto/c10d/rules.h).
  size_t max_key_bytes = c10d::Limits().max_key_bytes;
  size_t max_value_bytes = c10d::Limits().max_value_bytes;
  size_t max_keys_per_call = c10d::Limits().max_keys_per_call;
  size_t max_list_page = 10000;
  // Watch history kept in memory for resuming watches; the oldest changes
  // are dropped past either bound, and on restart.
  size_t history_events = 100000;
  size_t history_bytes = 64 << 20;
  // Each share's bounds (KvStore::SetShares): the keys stored under its
  // roots, and their bytes (key plus value). A torch job of tens of
  // thousands of ranks writes a few small keys per rank: far below both.
  uint64_t quota_keys = 1 << 20;
  uint64_t quota_bytes = 1ull << 30;

  // The first three, for the rules every store follows.
  c10d::Limits c10d_limits() const;
};

// c10d's default timeout for blocking calls.
inline constexpr absl::Duration kDefaultTimeout = absl::Seconds(300);

struct AddResult {
  int64_t value = 0;
  int64_t revision = 0;
};

struct CompareSetResult {
  std::string value;
  bool swapped = false;
  int64_t revision = 0;
};

struct DeleteResult {
  bool deleted = false;
  int64_t revision = 0;
};

struct CheckResult {
  bool all_exist = false;
  int64_t revision = 0;
};

struct NumKeysResult {
  int64_t num_keys = 0;
  int64_t revision = 0;
};

struct ListResult {
  std::vector<std::string> keys;
  std::string next_page_token;  // Empty when the listing is complete.
  int64_t revision = 0;
};

// One change of a batch (KvStore::ApplyBatch). Strings are read during the
// call only.
struct Change {
  enum class Kind {
    kSet,
    kAdd,
    kCompareSet,
    kAppend,
    kDelete,
    kQueuePush,  // Appends `value` to the queue named `key`.
    kQueuePop,   // Takes the queue `key`'s oldest item, if it has one.
  };
  Kind kind = Kind::kSet;
  absl::string_view key;
  // kSet, kAppend, kQueuePush; kCompareSet: desired.
  absl::string_view value;
  absl::string_view expected;  // kCompareSet.
  int64_t delta = 0;           // kAdd.
};

struct ChangeResult {
  // This change's own failure (the others still apply), or the commit's.
  absl::Status status;
  // kAdd: the new value; kCompareSet, kDelete: 1 if it wrote; kQueuePop:
  // the queue's length before the pop (0: it was empty; nothing popped).
  int64_t number = 0;
  // kCompareSet: what CompareSet returns; kQueuePop: the item popped.
  std::string value;
  // kQueuePush, kQueuePop: the item's key (queue_keys.h); empty when
  // nothing was popped.
  std::string queue_item;
  int64_t revision = 0;
};

struct QueuePopResult {
  // Items in the queue before the pop; 0: it was empty, nothing popped.
  int64_t length = 0;
  std::string value;     // The item popped.
  std::string item_key;  // Its key (queue_keys.h).
  int64_t revision = 0;
};

// Every queue together, for limits and monitoring.
struct QueueStats {
  int64_t queues = 0;  // Holding items.
  int64_t items = 0;
  uint64_t bytes = 0;  // Of the items' values.
};

// A part of the keyspace bounded as one (a tenant's): every key under any
// of `roots`. Roots of one share that lie under another of its roots are
// dropped (their keys count once).
struct Share {
  // Names the share in refusals, e.g. "token 0123456789ab".
  std::string name;
  std::vector<std::string> roots;
};

struct ShareUsage {
  uint64_t keys = 0;
  uint64_t bytes = 0;  // Keys plus values.
};

// What KvStore::stats() reports, for monitoring.
struct StoreStats {
  int64_t keys = 0;
  int64_t revision = 0;
  size_t waiters = 0;       // WaitForKeys calls pending.
  size_t watches = 0;       // Watch registrations open.
  uint64_t disk_bytes = 0;  // KvEngine::DiskBytes.
  // Writes refused for taking a share past quota_keys, or quota_bytes.
  uint64_t share_refused_keys = 0;
  uint64_t share_refused_bytes = 0;
};

class KvStore {
 public:
  using WaitId = WaitIndex::WaitId;
  using WatchId = WatchHistory::WatchId;
  using ReadCallback = WaitIndex::ReadCallback;
  // Called with events in revision order, under the store's lock: it must
  // not block or call back into the store.
  using EventsCallback = WatchHistory::EventsCallback;
  // Called once when the store ends a watch (Shutdown); not after CancelWatch.
  using CloseCallback = WatchHistory::CloseCallback;

  explicit KvStore(std::unique_ptr<KvEngine> engine, StoreLimits limits = {});
  // Shuts down (UNAVAILABLE) if Shutdown was not called.
  ~KvStore();

  KvStore(const KvStore&) = delete;
  KvStore& operator=(const KvStore&) = delete;

  const StoreLimits& limits() const { return limits_; }
  int64_t revision() ABSL_LOCKS_EXCLUDED(mu_);

  // Non-blocking operations; see proto/cohort/v1/store.proto for the rules
  // (written once, in proto/c10d/rules.h).
  // Each mutation returns the revision it created; one that changes nothing
  // (a failed CompareSet, deleting a missing key) returns the current one.
  absl::StatusOr<int64_t> Set(absl::string_view key, absl::string_view value);
  absl::StatusOr<AddResult> Add(absl::string_view key, int64_t delta);
  absl::StatusOr<CompareSetResult> CompareSet(absl::string_view key,
                                              absl::string_view expected,
                                              absl::string_view desired);
  absl::StatusOr<int64_t> Append(absl::string_view key,
                                 absl::string_view value);
  absl::StatusOr<DeleteResult> Delete(absl::string_view key);
  absl::StatusOr<int64_t> MultiSet(absl::Span<const std::string> keys,
                                   absl::Span<const std::string> values);
  // Applies `changes` in order, each seeing the ones before it, as one
  // commit: one revision and one write to the engine (so one write-ahead
  // log record) for all, then the waiters they satisfy are woken. Each
  // change follows the rules of its single-key call (Set, Add, CompareSet,
  // Append, Delete) and may fail alone; if the commit itself fails, every
  // change that would have written fails with its status. This is how the
  // TCPStore listener commits the requests of many connections at once.
  std::vector<ChangeResult> ApplyBatch(absl::Span<const Change> changes);
  absl::StatusOr<CheckResult> Check(absl::Span<const std::string> keys);
  // TCPStore's CHECK: as Check, but a key whose queue holds items exists too
  // (torch's server answers so).
  absl::StatusOr<CheckResult> CheckKeysOrQueues(
      absl::Span<const std::string> keys);
  // The value of `key` now, or nullopt; never waits.
  absl::StatusOr<std::optional<std::string>> TryGet(absl::string_view key);
  // The values of `keys` now, in order (nullopt: missing), all read at one
  // revision; never waits. TCPStore's MULTI_GET (which torch's client sends
  // once a WAIT for the keys has returned).
  absl::StatusOr<std::vector<std::optional<std::string>>> TryGetMany(
      absl::Span<const std::string> keys);
  // The number of keys, or of those under `prefix` (counted in time
  // proportional to their number; the TCPStore listener's namespaces).
  // Queue items are left out: a queue is not a key to c10d's num_keys
  // (torch's server does not count them either), whichever protocol asks.
  absl::StatusOr<NumKeysResult> NumKeys(absl::string_view prefix = "");
  // page_size 0 means limits().max_list_page.
  absl::StatusOr<ListResult> ListKeys(absl::string_view prefix,
                                      size_t page_size,
                                      absl::string_view page_token);

  // Calls `done` exactly once: with the keys' values (in order, if
  // read_values) once all of them exist at the same time; with
  // DEADLINE_EXCEEDED naming the missing keys once `timeout` passes; with
  // INVALID_ARGUMENT for bad keys; or with the Shutdown status. An infinite
  // `timeout` never expires (the wait ends by CancelWait or Shutdown). `done`
  // may run before this returns (then the result may be 0), and otherwise on
  // the thread that writes the last key or on the timer thread; it must not
  // block. Returns an id for CancelWait. The store's lock is held for at
  // most a few thousand keys at a time, and no value is read under it.
  WaitId WaitForKeys(std::vector<std::string> keys, bool read_values,
                     absl::Duration timeout, ReadCallback done);

  // TCPStore's WAIT, on which torch's blocking queue_pop blocks before it
  // sends QUEUE_POP: as WaitForKeys without values, but a key whose queue
  // holds items counts as present, and a push completes at most one of the
  // waits it could complete (the oldest), as torch's server wakes one
  // waiter per push rather than all. A Set of the key completes them all.
  // The result's queue_wake says which ended by a push.
  WaitId WaitForKeysOrQueues(std::vector<std::string> keys,
                             absl::Duration timeout, ReadCallback done);

  // Forgets a pending wait: its `done` is not called after this returns
  // (unless it is already running). Unknown ids are ignored.
  void CancelWait(WaitId id);

  // TCPStore's queues: one FIFO of items per name, kept under kQueuePrefix
  // (queue_keys.h). Names follow the key rules and items the value rules.
  // A push or pop is a change like any other (ApplyBatch's kQueuePush and
  // kQueuePop, which the TCPStore listener batches): it is in the engine's
  // write-ahead log before the call returns, and its item's key is
  // reported to watchers. Items keep push order across restarts; on a
  // shared engine every replica sees every push in the same order.
  // Appends `value`; returns the revision.
  absl::StatusOr<int64_t> QueuePush(absl::string_view queue,
                                    absl::string_view value);
  // Takes the oldest item, if any; never waits (WaitForKeysOrQueues does).
  absl::StatusOr<QueuePopResult> QueuePop(absl::string_view queue);
  // The items in `queue`: 0 when it has none or never had any.
  absl::StatusOr<int64_t> QueueLen(absl::string_view queue);
  QueueStats queue_stats() ABSL_LOCKS_EXCLUDED(mu_);

  // Passes on the wake-up of a push: for each of `queues` that holds items,
  // completes the wait that a push to it would complete now. For a wait
  // that may have been ended by a push but whose client will not pop after
  // all (it left, or gave up on the wait at the same moment), so that the
  // item does not sit in its queue while others wait for it. Does nothing
  // for a queue that is empty or that no wait is pending on.
  void PassQueueWakes(absl::Span<const std::string> queues)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The watch's id, and the revision from which it delivers every change.
  using WatchStart = WatchHistory::WatchStart;
  // Delivers the retained changes to keys under `prefix` with revision >=
  // from_revision (0: only changes after now), then every later one. Fails
  // with OUT_OF_RANGE if from_revision is older than the retained history.
  // A from_revision beyond the current one is valid: the watch delivers
  // changes once the store reaches it, and none before.
  absl::StatusOr<WatchStart> Watch(absl::string_view prefix,
                                   int64_t from_revision,
                                   EventsCallback on_events,
                                   CloseCallback on_close);
  void CancelWatch(WatchId id);

  // Ends every pending wait and watch with `status` (e.g. UNAVAILABLE while
  // the server drains) and fails later blocking calls with it. Non-blocking
  // calls keep working. Idempotent.
  void Shutdown(absl::Status status);

  // On a shared engine, waits until this store's view holds every change
  // acknowledged anywhere before the call (what a newly elected leader
  // does before loading its state); OK at once on others.
  absl::Status Sync() ABSL_LOCKS_EXCLUDED(mu_) { return CatchUp(); }

  // Makes every applied change durable (see KvEngine::Flush).
  absl::Status Flush();

  // Whether writes can be made durable now (KvEngine::CheckWritable): OK,
  // or RESOURCE_EXHAUSTED while the data disk is full. cohortd's health
  // follows it.
  absl::Status CheckWritable();

  // Bounds the keys and bytes stored under each of `shares` by
  // limits().quota_keys and quota_bytes, in place of the shares set before
  // (one that stays, by name and roots, keeps its count). A new share is
  // counted by one scan of its roots, a slice of keys at a time with other
  // calls going on between slices, and is not enforced until its scan is
  // over. From then on every change applied, through any protocol (and on
  // a shared engine, by any replica), keeps its count, and a change that
  // would take a share past a bound fails alone with RESOURCE_EXHAUSTED
  // naming the share, the bound and its limit; changes that shrink a share
  // (deletes, smaller values) always pass. Returns a scan's read error (that
  // share stays unenforced). Calls are serialized.
  absl::Status SetShares(std::vector<Share> shares) ABSL_LOCKS_EXCLUDED(mu_);
  // What the share `name` holds, once counted; nullopt if there is no such
  // share or its scan is not over.
  std::optional<ShareUsage> share_usage(absl::string_view name)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Counts for monitoring. Scans the data dir (KvEngine::DiskBytes) outside
  // the store's lock: for a metrics scrape, not for every request.
  StoreStats stats() ABSL_LOCKS_EXCLUDED(mu_);

  // KvEngine::SetSyncObserver: `observe` gets each write-ahead-log sync's
  // time. It runs under the store's lock: it must not block or call back
  // into the store.
  void SetSyncObserver(std::function<void(absl::Duration)> observe)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Waiter = WaitIndex::Waiter;
  struct ShareState;
  // A queue's items in the engine, by sequence number: their value bytes.
  struct QueueIndex {
    std::map<int64_t, uint64_t> items;
  };
  class ShareTally;
  // PlanLocked's state: one batch's view of what it wrote, its queues
  // and its shares' tally.
  class BatchPlan;
  // Callbacks collected under the lock and run after it is released.
  using Deferred = std::vector<std::function<void()>>;

  // A batch of one: the single-key calls.
  ChangeResult ApplyOne(const Change& change);

  // Works out the mutations `changes` make on the current view (each
  // change seeing the ones before it) and each change's result but its
  // revision; the indexes of the changes that write go to `writers`. With
  // `guards`, every key read from the engine is recorded there with its
  // modification revision (shared engines).
  void PlanLocked(absl::Span<const Change> changes,
                  std::vector<ChangeResult>& results,
                  std::vector<Mutation>& mutations,
                  std::vector<size_t>& writers,
                  std::vector<KvEngine::Guard>* guards)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ApplyBatch on a shared engine: plan, commit guarded without the lock,
  // and plan again when another writer got there first.
  std::vector<ChangeResult> ApplyBatchShared(absl::Span<const Change> changes)
      ABSL_LOCKS_EXCLUDED(mu_);
  // MultiSet on a shared engine: checked under the lock, committed
  // without it.
  absl::StatusOr<int64_t> MultiSetShared(std::vector<Mutation> mutations)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A shared engine's change, from its feed.
  void OnFeed(int64_t revision, std::vector<Mutation> mutations)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until the view holds revision `target`: OK, or UNAVAILABLE after
  // `timeout` naming both revisions.
  absl::Status AwaitRevision(int64_t target, absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Before a non-blocking read on a shared engine: waits until the view
  // holds every change acknowledged before the call (linearizable reads).
  absl::Status CatchUp() ABSL_LOCKS_EXCLUDED(mu_);
  // Before a wait: its keys are valid, and it starts from a caught-up view
  // (a wait completed from a stale view returns a stale value, or a key
  // deleted since, when another replica acknowledged the change).
  absl::Status ReadyToWait(absl::Span<const std::string> keys)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Records and publishes the events of `mutations` at `revision` and
  // completes the waiters they satisfy (into `deferred`).
  void PublishLocked(int64_t revision, std::vector<Mutation> mutations,
                     Deferred& deferred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Applies `mutations` as one revision, records and publishes their events
  // and completes the waiters they satisfy (into `deferred`).
  absl::StatusOr<int64_t> CommitLocked(std::vector<Mutation> mutations,
                                       Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Applies `mutations` to the engine (its view, on a shared engine) at
  // `revision`, and follows them in the shares' counts.
  absl::Status ApplyLocked(absl::Span<const Mutation> mutations,
                           int64_t revision) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WakeWaitersLocked(absl::string_view key, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes the oldest queue-counting wait on `queue` that its items now
  // complete, if it holds any (one per push).
  void WakeQueueWaiterLocked(absl::string_view queue, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  WaitId StartWait(std::vector<std::string> keys, bool read_values, bool queues,
                   absl::Duration timeout, ReadCallback done)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Check and CheckKeysOrQueues.
  absl::StatusOr<CheckResult> CheckPresent(absl::Span<const std::string> keys,
                                           bool queues)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Whether `key` exists, or (with `queues`) its queue holds items.
  bool PresentLocked(absl::string_view key, bool queues) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t QueueLengthLocked(absl::string_view queue) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Follows `mutations` in the queue index; the queue of each item pushed
  // goes to `pushed`.
  void IndexQueuesLocked(absl::Span<const Mutation> mutations,
                         std::vector<std::string>& pushed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Builds the queue index from the engine's keys under kQueuePrefix.
  absl::Status LoadQueuesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes `waiter` if all its keys exist, else indexes it again under
  // the missing ones. Returns whether it completed (WaitIndex::Complete).
  bool TryCompleteLocked(Waiter& waiter, Deferred& deferred)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnWaitTimeout(WaitId id) ABSL_LOCKS_EXCLUDED(mu_);
  // OK, or the refusal of the first of `mutations` (each seeing those
  // before it) that would take a share past a bound.
  absl::Status CheckSharesLocked(absl::Span<const Mutation> mutations)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts `share` from its roots, a slice at a time.
  absl::Status ScanShare(ShareState& share) ABSL_LOCKS_EXCLUDED(mu_);

  const StoreLimits limits_;
  const c10d::Limits rules_;  // limits_.c10d_limits()

  absl::Mutex mu_;
  std::unique_ptr<KvEngine> engine_ ABSL_GUARDED_BY(mu_);
  // engine_ when it is shared (its commit and barrier calls are
  // thread-safe and made without mu_); else null. Set by the constructor.
  KvEngine* const shared_;
  int64_t revision_ ABSL_GUARDED_BY(mu_) = 0;
  // The newest revision at which a key was deleted: a waiter registered
  // before it re-checks its keys before completing.
  int64_t last_delete_revision_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status shutdown_ ABSL_GUARDED_BY(mu_);

  // The pending waits, by the keys they miss.
  WaitIndex waits_ ABSL_GUARDED_BY(mu_);

  // The queues holding items, by name.
  absl::flat_hash_map<std::string, QueueIndex> queues_ ABSL_GUARDED_BY(mu_);
  int64_t queue_items_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t queue_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Why the index could not be loaded at start (queue calls then fail).
  absl::Status queue_load_ ABSL_GUARDED_BY(mu_);

  // The open watches, and the changes kept for them to resume from.
  WatchHistory history_ ABSL_GUARDED_BY(mu_);
  // The shares, in SetShares' order. The vector is replaced, never
  // changed in place, so a scan keeps its ShareState across slices.
  std::vector<std::shared_ptr<ShareState>> shares_ ABSL_GUARDED_BY(mu_);
  uint64_t share_refused_keys_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t share_refused_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Serializes SetShares, whose scans release mu_ between slices.
  absl::Mutex shares_mu_ ABSL_ACQUIRED_BEFORE(mu_);

  // Last, so it is destroyed (and its thread joined) first: its callbacks
  // use everything above.
  base::DeadlineTimer timer_;
};

}  // namespace cohort::store

#endif  // COHORT_STORE_KV_STORE_H_
