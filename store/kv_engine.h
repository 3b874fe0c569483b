// KvEngine: the storage behind cohortd's key-value store.
//
// An engine stores bytes under bytes plus one int64, the store revision, and
// applies a batch of mutations atomically together with the new revision.
// It knows nothing of blocking, watching or the c10d rules: KvStore
// (kv_store.h) builds those on top, and serialises every call, so engines
// need no locking of their own.
#ifndef COHORT_STORE_KV_ENGINE_H_
#define COHORT_STORE_KV_ENGINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace rocksdb {
class Env;
}

namespace cohort::store {

struct Mutation {
  enum class Kind { kPut, kDelete };
  Kind kind = Kind::kPut;
  std::string key;
  std::string value;  // kPut only.
};

class KvEngine {
 public:
  virtual ~KvEngine() = default;

  // "rocksdb" or "memory", for logs.
  virtual absl::string_view name() const = 0;

  // The value of `key`, or nullopt if it is absent. May read from disk.
  virtual absl::StatusOr<std::optional<std::string>> Get(
      absl::string_view key) const = 0;

  // Whether `key` exists. Answered from memory, never from disk: waiters
  // and checks call it once per key while the store's lock is held.
  virtual bool Contains(absl::string_view key) const = 0;

  // Values read later, outside the store's lock, as they are now.
  class PreparedRead {
   public:
    virtual ~PreparedRead() = default;
    // The values of the keys given to PrepareRead, in order, as they were
    // when it was called (each key must have existed then). Called once.
    virtual absl::StatusOr<std::vector<std::string>> Read() = 0;
  };
  // Pins the current values of `keys` (all of which exist) cheaply, so that
  // the possibly slow reading happens in Read() without the store's lock.
  virtual std::unique_ptr<PreparedRead> PrepareRead(
      std::vector<std::string> keys) const = 0;

  // Applies `mutations` in order, all or none, and records `revision` as the
  // store's revision. When this returns OK the change survives the process
  // being killed (it is in the engine's write-ahead log).
  virtual absl::Status Apply(absl::Span<const Mutation> mutations,
                             int64_t revision) = 0;

  // The revision recorded by the last Apply (0 for a new store).
  virtual int64_t revision() const = 0;

  // The number of keys stored.
  virtual int64_t NumKeys() const = 0;

  // The number of keys that start with `prefix`, in time proportional to
  // that number (not to every key stored). May read from disk.
  virtual absl::StatusOr<int64_t> CountKeys(absl::string_view prefix) const = 0;

  // Up to `limit` keys that start with `prefix` and sort after `start_after`
  // (all of them if start_after is empty), in byte order.
  virtual absl::StatusOr<std::vector<std::string>> ListKeys(
      absl::string_view prefix, absl::string_view start_after,
      size_t limit) const = 0;

  // Makes everything applied so far durable on disk (a no-op in memory).
  virtual absl::Status Flush() = 0;

  // OK while writes can be made durable. Otherwise RESOURCE_EXHAUSTED (the
  // disk is full, or cannot hold its reserve: so from the start on a disk
  // smaller than the reserve) or the engine's error. An engine that
  // stopped after a failed write tries to resume here once the cause is
  // gone, so calling this periodically is how writes come back.
  virtual absl::Status CheckWritable() { return absl::OkStatus(); }

  // The bytes the engine's files take on disk (0 in memory), for
  // monitoring. Scans the data dir, so call it seldom. Unlike the calls
  // above it may run concurrently with them (it reads only the folder).
  virtual uint64_t DiskBytes() const { return 0; }

  // From now on, `observe` gets the time each write-ahead-log sync takes
  // (each Apply with sync_writes, each Flush); null stops it. It runs
  // inside Apply and Flush, so it must be fast. Engines without a log
  // never call it.
  virtual void SetSyncObserver(std::function<void(absl::Duration)> observe) {}

  // --- Engines that other writers share (etcd under several cohortd
  // replicas). KvStore then commits through ApplyGuarded, without its lock,
  // and takes every change, its own included, from the feed, which calls
  // Apply to update the engine's own view. Every other call reads that view.

  // Whether this is such an engine.
  virtual bool shared() const { return false; }

  // A key that must still have the modification revision it had when read
  // (0: absent) for a guarded commit to apply.
  struct Guard {
    std::string key;
    int64_t mod_revision = 0;
  };
  // Commits `mutations` as one revision iff every guard holds; returns the
  // revision created. ABORTED when a guard failed (another writer got
  // there first: read again once the view caught up, and retry).
  // UNAVAILABLE when it could not tell: with guards it is not retried, as
  // the commit may have applied. Thread-safe.
  virtual absl::StatusOr<int64_t> ApplyGuarded(
      absl::Span<const Mutation> mutations, absl::Span<const Guard> guards) {
    return absl::UnimplementedError("not a shared engine");
  }
  // The modification revision of `key` in the view; 0 if absent.
  virtual int64_t ModRevision(absl::string_view key) const { return 0; }
  // A revision at least as new as every change acknowledged to anyone
  // before this call; the feed reports reaching it soon after (an empty
  // change). Thread-safe.
  virtual absl::StatusOr<int64_t> ReadBarrier() { return revision(); }
  // Every writer's committed changes, in revision order, each revision
  // once, on the engine's thread; empty `mutations`: nothing under this
  // engine changed up to `revision`.
  using Feed =
      std::function<void(int64_t revision, std::vector<Mutation> mutations)>;
  virtual absl::Status StartFeed(Feed feed) {
    return absl::UnimplementedError("not a shared engine");
  }
  // Stops the feed; no call after this returns. Idempotent.
  virtual void StopFeed() {}
};

// An engine that keeps everything in memory and loses it on exit.
std::unique_ptr<KvEngine> NewMemoryEngine();

struct RocksDbOptions {
  // The folder holding the database; created if missing.
  std::string path;
  // fsync the write-ahead log on every Apply. Without it an acknowledged
  // write survives the process being killed, but not the machine losing
  // power. It costs one fsync per mutation (about 0.1-2 ms on SSDs).
  bool sync_writes = false;
  // Writes that would leave less than this free on the data dir's disk are
  // refused with RESOURCE_EXHAUSTED before RocksDB runs out of space.
  // Deletes are always let through, so the reserve is what lets an operator
  // (or a job's cleanup) delete keys on a full disk, and what RocksDB's own
  // flushes and compactions use. Up to 1 MiB of it is held as the file
  // "cohort-reserve" in the data dir, which another program filling the
  // disk cannot take: it is given back to deletes once RocksDB itself runs
  // out of space, and taken again when space returns.
  uint64_t min_free_bytes = 64 << 20;
  // Where RocksDB's warnings and errors go (its info LOG is not written to
  // the data dir, which may be the full disk). Default: stderr.
  std::function<void(absl::string_view)> log;
  // For tests: the Env RocksDB does its I/O through (faults can be
  // injected there). Null: the default Env.
  rocksdb::Env* env = nullptr;
};

// Opens (or creates) a RocksDB-backed engine. Fails with a message naming the
// path if the database cannot be opened, e.g. because another cohortd holds
// its lock.
absl::StatusOr<std::unique_ptr<KvEngine>> OpenRocksDbEngine(
    const RocksDbOptions& options);

}  // namespace cohort::store

#endif  // COHORT_STORE_KV_ENGINE_H_
