// FileStore: a cohort::Store kept in one shared file, with no server. It is
// c10d's FileStore: processes that can all see one path (a local disk, or a
// shared filesystem with working fcntl locks) start a job from a
// `file:///path` init method without a coordinator.
//
// The file is an append-only log of records (a batch of sets and deletes, or
// the open/close of a store). Every access holds an exclusive fcntl lock on
// the file (an open-file-description lock, so two FileStores in one process
// exclude each other too); each FileStore keeps the keys in memory and reads
// only the records appended since its last access. Blocking calls poll the
// file (1 ms backing off to 16 ms), so a blocked reader sees a write from
// another process within about 16 ms. Revisions count batches: a MultiSet is
// one revision. The log is never compacted, so Watch can replay from any
// revision, and the file grows with every change.
//
// c10d's rules and cohort's request limits are those of every store
// (proto/c10d/rules.h): a key, value or call over FileStoreOptions::limits
// fails with INVALID_ARGUMENT naming the limit, as it would on cohortd.
//
// Thread-safe. A FileStore must not be used in a child of fork(): the child
// shares its lock. Open a new one there.
#ifndef COHORT_CLIENT_FILE_STORE_H_
#define COHORT_CLIENT_FILE_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "client/store.h"
#include "proto/c10d/rules.h"

namespace cohort {
namespace file_store_internal {
struct Mutation;  // One set or delete in a record; see file_store.cc.
}  // namespace file_store_internal

struct FileStoreOptions {
  // > 0 makes the store remove the file when num_workers stores have been
  // closed and none is open (c10d's cleanup); -1 keeps it.
  int num_workers = -1;
  // Key, value and keys-per-call limits; the defaults are cohortd's.
  c10d::Limits limits;
};

class FileStore final : public Store {
 public:
  // Opens the store in the file at `path`, creating the file if missing.
  // Errors name the path: the file cannot be opened or locked, or it is not
  // a FileStore file (FAILED_PRECONDITION), or is corrupt (DATA_LOSS).
  static absl::StatusOr<std::unique_ptr<FileStore>> Open(
      const std::string& path, const FileStoreOptions& options);
  // The same with default limits.
  static absl::StatusOr<std::unique_ptr<FileStore>> Open(
      const std::string& path, int num_workers = -1);

  // Records the close in the file and, per `num_workers`, removes it.
  // REQUIRES: every watch of this store has been destroyed.
  ~FileStore() override;

  const std::string& path() const { return path_; }

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  using Store::Get;
  absl::StatusOr<std::string> Get(absl::string_view key,
                                  absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;
  absl::StatusOr<std::string> CompareSet(absl::string_view key,
                                         absl::string_view expected,
                                         absl::string_view desired) override;
  using Store::Wait;
  absl::Status Wait(absl::Span<const std::string> keys,
                    absl::Duration timeout) override;
  absl::StatusOr<bool> Check(absl::Span<const std::string> keys) override;
  absl::StatusOr<bool> DeleteKey(absl::string_view key) override;
  absl::StatusOr<int64_t> NumKeys() override;
  using Store::MultiGet;
  absl::StatusOr<std::vector<std::string>> MultiGet(
      absl::Span<const std::string> keys, absl::Duration timeout) override;
  absl::Status MultiSet(absl::Span<const std::string> keys,
                        absl::Span<const std::string> values) override;
  absl::Status Append(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<KeyList> ListKeys(absl::string_view prefix) override;
  // Never OUT_OF_RANGE: the file holds every revision. The watch's thread
  // polls the file. Cancel may be called from the callback; the handle must
  // not be destroyed from it.
  absl::StatusOr<std::unique_ptr<WatchHandle>> Watch(
      absl::string_view prefix, int64_t from_revision,
      WatchCallback callback) override;

 private:
  using Mutation = file_store_internal::Mutation;
  class FileWatch;
  class FileLock;

  FileStore(std::string path, int fd, const FileStoreOptions& options);

  // Locks the file, checks it is still the one at path_ and records this
  // store's open. False if the file was removed meanwhile (open it again).
  absl::StatusOr<bool> Join();
  void Leave();

  // Applies the records appended since offset_ (after checking that `file`
  // was locked).
  absl::Status SyncLocked(const FileLock& file)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Locks the file and syncs; for callers that only read.
  absl::Status Poll();
  // Appends one record and applies it. REQUIRES the file lock, synced.
  absl::Status AppendLocked(char kind, std::vector<Mutation> mutations)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ApplyLocked(char kind, std::vector<Mutation>& mutations)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<bool> PathIsOursLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends a batch of changes.
  absl::Status Commit(std::vector<Mutation> mutations);
  // Polls until all `keys` exist; their values if `values`.
  absl::StatusOr<std::vector<std::string>> Read(
      absl::Span<const std::string> keys, bool values, absl::Duration timeout);
  void Unregister(FileWatch* watch);
  // The value of `key`, or null; valid until data_ changes.
  const std::string* FindLocked(absl::string_view key) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  const int num_workers_;
  const c10d::Limits limits_;
  // The file lock belongs to the open file, shared by this store's threads,
  // so they take mu_ before it.
  absl::Mutex mu_;
  const int fd_;
  bool joined_ ABSL_GUARDED_BY(mu_) = false;
  // Bytes of the file applied to the fields below.
  int64_t offset_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, std::string, std::less<>> data_ ABSL_GUARDED_BY(mu_);
  int64_t revision_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t opens_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t closes_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<FileWatch*> watches_ ABSL_GUARDED_BY(mu_);
};

}  // namespace cohort

#endif  // COHORT_CLIENT_FILE_STORE_H_
