// RocksDB layout: user key K is stored as "d" + K; the store revision lives
// under the meta key "m" as 8 bytes big-endian. A mutation batch and its
// revision go in one WriteBatch, so they land in the WAL together.
//
// Every key is also held in memory (keys_), so existence checks, which
// waiters make once per key under the store's lock, never touch the disk.
// Values of 64 KiB and more live in blob files, so the SST blocks that
// point lookups decompress stay small whatever the values are.
#include <sys/statvfs.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "rocksdb/cache.h"
#include "rocksdb/db.h"
#include "rocksdb/env.h"
#include "rocksdb/file_system.h"
#include "rocksdb/filter_policy.h"
#include "rocksdb/options.h"
#include "rocksdb/table.h"
#include "rocksdb/write_batch.h"
#include "store/kv_engine.h"

namespace cohort::store {
namespace {

constexpr char kDataPrefix = 'd';
constexpr char kRevisionKey[] = "m";

std::string DataKey(absl::string_view key) {
  std::string out;
  out.reserve(key.size() + 1);
  out.push_back(kDataPrefix);
  out.append(key.data(), key.size());
  return out;
}

std::string EncodeRevision(int64_t revision) {
  std::string out(8, '\0');
  for (int i = 7; i >= 0; --i) {
    out[i] = static_cast<char>(revision & 0xff);
    revision >>= 8;
  }
  return out;
}

int64_t DecodeRevision(absl::string_view bytes) {
  uint64_t v = 0;
  for (unsigned char c : bytes) v = (v << 8) | c;
  return static_cast<int64_t>(v);
}

// Free bytes for an unprivileged writer on the filesystem holding `path`,
// or -1 if it cannot be read.
// A coordinator writes little: one background thread does both flushes and
// compactions (RocksDB schedules flushes on the low-priority pool when the
// high one is empty), which keeps cohortd's thread count down. Open grows
// the high pool to one thread, so this follows every open.
void FlushOnLowPool(rocksdb::Env* env) {
  env->SetBackgroundThreads(0, rocksdb::Env::Priority::HIGH);
}

// The size of the filesystem holding `path` and its bytes free for an
// unprivileged writer; -1 each if they cannot be read.
struct DiskSpace {
  int64_t total = -1;
  int64_t free = -1;
};

DiskSpace StatDisk(const std::string& path) {
  struct statvfs st;
  if (statvfs(path.c_str(), &st) != 0) return {};
  const int64_t unit = static_cast<int64_t>(st.f_frsize);
  return {.total = static_cast<int64_t>(st.f_blocks) * unit,
          .free = static_cast<int64_t>(st.f_bavail) * unit};
}

int64_t FreeBytes(const std::string& path) { return StatDisk(path).free; }

// Up to this much of the reserve is held as a file of zeros in the data dir
// (the ballast), so that another program filling the disk cannot take it.
// It is given back when RocksDB runs out of space: enough to reopen RocksDB
// (a new WAL, MANIFEST and OPTIONS file) and log about ten thousand
// deletes. Bounded, since it is written whenever it is taken.
constexpr uint64_t kMaxBallastBytes = 1 << 20;
constexpr char kBallastName[] = "cohort-reserve";

// A RocksDB status as an absl one: running out of space is
// RESOURCE_EXHAUSTED naming the data dir, anything else INTERNAL.
absl::Status RocksError(const rocksdb::Status& s, absl::string_view what,
                        const std::string& path) {
  if (s.ok()) return absl::OkStatus();
  if (s.IsNoSpace() || absl::StrContains(s.ToString(), "No space left")) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the data dir ", path, " is out of space (", FreeBytes(path),
        " bytes free): rocksdb ", what, ": ", s.ToString(),
        "; free space on that disk, or delete keys"));
  }
  return absl::InternalError(
      absl::StrCat("rocksdb ", what, ": ", s.ToString()));
}

// RocksDB's info log, sent to cohort's log instead of a LOG file in the
// data dir: a full data disk must not be able to fail (and, in Debian's
// build with assertions, abort) a log write. Only warnings and worse.
class ForwardingLogger final : public rocksdb::Logger {
 public:
  explicit ForwardingLogger(std::function<void(absl::string_view)> sink)
      : rocksdb::Logger(rocksdb::InfoLogLevel::WARN_LEVEL),
        sink_(std::move(sink)) {}

  using rocksdb::Logger::Logv;
  void Logv(const char* format, va_list ap) override {
    char buf[1024];
    int n = std::vsnprintf(buf, sizeof(buf), format, ap);
    if (n < 0) return;
    sink_(absl::string_view(buf, std::min<size_t>(n, sizeof(buf) - 1)));
  }

 private:
  std::function<void(absl::string_view)> sink_;
};

// RocksDB's file system, but reporting free space as unknown. RocksDB then
// leaves recovery from a full disk to cohort (CheckWritable: Resume once
// space is back) instead of starting its own, which in 7.8 can get stuck
// after one failed attempt and refuse every Resume as Busy from then on.
class NoAutoRecoveryFileSystem final : public rocksdb::FileSystemWrapper {
 public:
  explicit NoAutoRecoveryFileSystem(std::shared_ptr<rocksdb::FileSystem> fs)
      : rocksdb::FileSystemWrapper(std::move(fs)) {}
  static const char* kClassName() { return "NoAutoRecoveryFileSystem"; }
  const char* Name() const override { return kClassName(); }
  rocksdb::IOStatus GetFreeSpace(const std::string&, const rocksdb::IOOptions&,
                                 uint64_t*, rocksdb::IODebugContext*) override {
    return rocksdb::IOStatus::NotSupported("cohort watches free space itself");
  }
};

class RocksDbEngine final : public KvEngine {
 public:
  RocksDbEngine(std::unique_ptr<rocksdb::Env> env, rocksdb::Options db_options,
                std::unique_ptr<rocksdb::DB> db, const RocksDbOptions& options)
      : env_(std::move(env)),
        db_options_(std::move(db_options)),
        db_(std::move(db)),
        path_(options.path),
        min_free_bytes_(options.min_free_bytes),
        ballast_path_(
            (std::filesystem::path(options.path) / kBallastName).string()),
        ballast_bytes_(
            std::min<uint64_t>(options.min_free_bytes, kMaxBallastBytes)),
        log_(options.log) {
    write_options_.sync = options.sync_writes;
  }

  ~RocksDbEngine() override {
    // Closing flushes nothing the WAL does not already hold; it only makes
    // the next open faster. After a failed write there is nothing to add.
    if (db_ == nullptr) return;
    if (failed_.ok()) db_->FlushWAL(/*sync=*/true).PermitUncheckedError();
    db_->Close().PermitUncheckedError();
  }

  absl::Status Load() {
    std::string value;
    rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), kRevisionKey, &value);
    if (s.ok()) {
      revision_ = DecodeRevision(value);
    } else if (!s.IsNotFound()) {
      return FromRocks(s, "reading the revision");
    }
    rocksdb::ReadOptions keys_only;
    keys_only.fill_cache = false;
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(keys_only));
    for (it->Seek(std::string(1, kDataPrefix));
         it->Valid() && it->key()[0] == kDataPrefix; it->Next()) {
      keys_.emplace(it->key().data() + 1, it->key().size() - 1);
    }
    return FromRocks(it->status(), "loading the keys");
  }

  absl::string_view name() const override { return "rocksdb"; }

  absl::StatusOr<std::optional<std::string>> Get(
      absl::string_view key) const override {
    if (!keys_.contains(key)) return std::nullopt;
    if (db_ == nullptr) return failed_;
    std::string value;
    rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), DataKey(key), &value);
    if (s.IsNotFound()) return std::nullopt;
    if (!s.ok()) return FromRocks(s, "get");
    return value;
  }

  bool Contains(absl::string_view key) const override {
    return keys_.contains(key);
  }

  std::unique_ptr<PreparedRead> PrepareRead(
      std::vector<std::string> keys) const override {
    class AtSnapshot final : public PreparedRead {
     public:
      AtSnapshot(rocksdb::DB* db, std::vector<std::string> keys,
                 std::shared_ptr<std::atomic<int>> out)
          : db_(db),
            snapshot_(db->GetSnapshot()),
            keys_(std::move(keys)),
            out_(std::move(out)) {
        ++*out_;
      }
      ~AtSnapshot() override {
        db_->ReleaseSnapshot(snapshot_);
        --*out_;
      }

      absl::StatusOr<std::vector<std::string>> Read() override {
        rocksdb::ReadOptions options;
        options.snapshot = snapshot_;
        std::vector<std::string> values(keys_.size());
        for (size_t i = 0; i < keys_.size(); ++i) {
          rocksdb::Status s = db_->Get(options, DataKey(keys_[i]), &values[i]);
          if (!s.ok()) return RocksError(s, "get", "");
        }
        return values;
      }

     private:
      rocksdb::DB* const db_;
      const rocksdb::Snapshot* const snapshot_;
      const std::vector<std::string> keys_;
      const std::shared_ptr<std::atomic<int>> out_;
    };
    if (db_ == nullptr) {
      class Failed final : public PreparedRead {
       public:
        explicit Failed(absl::Status s) : status_(std::move(s)) {}
        absl::StatusOr<std::vector<std::string>> Read() override {
          return status_;
        }

       private:
        absl::Status status_;
      };
      return std::make_unique<Failed>(failed_);
    }
    return std::make_unique<AtSnapshot>(db_.get(), std::move(keys), reads_out_);
  }

  absl::Status Apply(absl::Span<const Mutation> mutations,
                     int64_t revision) override {
    rocksdb::WriteBatch batch;
    size_t put_bytes = 0;
    for (const Mutation& m : mutations) {
      if (m.kind == Mutation::Kind::kPut) {
        batch.Put(DataKey(m.key), m.value);
        put_bytes += m.key.size() + m.value.size();
      } else {
        batch.Delete(DataKey(m.key));
      }
    }
    batch.Put(kRevisionKey, EncodeRevision(revision));
    // Deletes pass the reserve, and may spend its ballast: they are how
    // space is given back, and how a job cleans up on a full disk.
    const bool deletes_only = put_bytes == 0;
    // After a failed write RocksDB takes no more until it resumes, which is
    // tried once the space is back.
    if (!failed_.ok()) {
      absl::Status s = ResumeIfSpace();
      if (absl::IsResourceExhausted(s) && deletes_only) s = ReopenOnBallast();
      if (!s.ok()) return s;
    }
    if (!deletes_only) {
      if (absl::Status s = Admit(put_bytes); !s.ok()) return s;
    }
    rocksdb::Status written = Write(batch);
    if (!written.ok()) {
      failed_ = FromRocks(written, "write");
      if (!absl::IsResourceExhausted(failed_)) return failed_;
      needed_free_ = std::max(needed_free_, min_free_bytes_ + kResumeFreeBytes);
      if (!deletes_only || !ReopenOnBallast().ok()) return failed_;
      written = Write(batch);
      if (!written.ok()) {
        failed_ = FromRocks(written, "write");
        return failed_;
      }
    }
    for (const Mutation& m : mutations) {
      if (m.kind == Mutation::Kind::kPut) {
        keys_.emplace(m.key);
      } else {
        keys_.erase(m.key);
      }
    }
    revision_ = revision;
    return absl::OkStatus();
  }

  int64_t revision() const override { return revision_; }

  int64_t NumKeys() const override { return keys_.size(); }

  absl::StatusOr<int64_t> CountKeys(absl::string_view prefix) const override {
    if (prefix.empty()) return NumKeys();
    if (db_ == nullptr) return failed_;
    rocksdb::ReadOptions keys_only;
    keys_only.fill_cache = false;
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(keys_only));
    const std::string data_prefix = DataKey(prefix);
    int64_t n = 0;
    for (it->Seek(data_prefix); it->Valid(); it->Next()) {
      absl::string_view k(it->key().data(), it->key().size());
      if (!absl::StartsWith(k, data_prefix)) break;
      ++n;
    }
    if (absl::Status s = FromRocks(it->status(), "count"); !s.ok()) return s;
    return n;
  }

  absl::StatusOr<std::vector<std::string>> ListKeys(
      absl::string_view prefix, absl::string_view start_after,
      size_t limit) const override {
    if (db_ == nullptr) return failed_;
    std::vector<std::string> keys;
    rocksdb::ReadOptions keys_only;
    keys_only.fill_cache = false;
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(keys_only));
    const std::string data_prefix = DataKey(prefix);
    if (!start_after.empty()) {
      it->Seek(DataKey(start_after));
      if (it->Valid() &&
          absl::string_view(it->key().data(), it->key().size()).substr(1) ==
              start_after) {
        it->Next();
      }
    } else {
      it->Seek(data_prefix);
    }
    for (; it->Valid() && keys.size() < limit; it->Next()) {
      absl::string_view k(it->key().data(), it->key().size());
      if (!absl::StartsWith(k, data_prefix)) break;
      keys.emplace_back(k.substr(1));
    }
    if (absl::Status s = FromRocks(it->status(), "list"); !s.ok()) return s;
    return keys;
  }

  absl::Status Flush() override {
    if (absl::Status s = ResumeIfSpace(); !s.ok()) return s;
    if (db_ == nullptr) return failed_;
    const absl::Time started = absl::Now();
    if (absl::Status s = FromRocks(db_->FlushWAL(/*sync=*/true), "flush wal");
        !s.ok()) {
      return s;
    }
    if (on_sync_) on_sync_(absl::Now() - started);
    return FromRocks(db_->Flush(rocksdb::FlushOptions()), "flush");
  }

  uint64_t DiskBytes() const override {
    namespace fs = std::filesystem;
    uint64_t total = 0;
    std::error_code ec;
    // A file removed mid-scan (compaction) is skipped, not an error.
    for (fs::recursive_directory_iterator it(path_, ec), end; !ec && it != end;
         it.increment(ec)) {
      std::error_code size_ec;
      if (!it->is_regular_file(size_ec)) continue;
      const uintmax_t size = it->file_size(size_ec);
      if (!size_ec) total += size;
    }
    return total;
  }

  void SetSyncObserver(std::function<void(absl::Duration)> observe) override {
    on_sync_ = std::move(observe);
  }

  absl::Status CheckWritable() override {
    DiskSpace disk = StatDisk(path_);
    if (!ballast_held_ && disk.free >= 0 &&
        static_cast<uint64_t>(disk.free) >= ballast_bytes_ + kResumeFreeBytes &&
        HoldBallast()) {
      disk.free -= ballast_bytes_;
    }
    if (absl::Status s = ResumeIfSpace(); !s.ok()) return s;
    if (disk.free < 0) return absl::OkStatus();
    const uint64_t held = ballast_held_ ? ballast_bytes_ : 0;
    if (memtable_grown_ && static_cast<uint64_t>(disk.free) + held >=
                               min_free_bytes_ + UnflushedBytes()) {
      // The disk can hold the grown memtables' flush (puts are admitted
      // only then, too).
      memtable_grown_ =
          !db_->SetOptions({{"write_buffer_size",
                             absl::StrCat(db_options_.write_buffer_size)}})
               .ok();
    }
    return CheckReserve(disk);
  }

  // Takes the ballast out of the disk's free space, or finds it still
  // there from the last run. Returns whether it is held.
  bool HoldBallast() {
    if (ballast_held_ || ballast_bytes_ == 0) return ballast_held_;
    rocksdb::FileSystem* fs = db_options_.env->GetFileSystem().get();
    const rocksdb::IOOptions io;
    uint64_t size = 0;
    if (fs->GetFileSize(ballast_path_, io, &size, nullptr).ok() &&
        size == ballast_bytes_) {
      ballast_held_ = true;
      return true;
    }
    // Zeros written and synced, not fallocated: every filesystem then
    // counts the blocks as used.
    rocksdb::FileOptions file_options;
    file_options.allow_fallocate = false;
    std::unique_ptr<rocksdb::FSWritableFile> file;
    rocksdb::IOStatus s =
        fs->NewWritableFile(ballast_path_, file_options, &file, nullptr);
    const std::string zeros(64 << 10, '\0');
    for (uint64_t written = 0; s.ok() && written < ballast_bytes_;) {
      const size_t n =
          std::min<uint64_t>(zeros.size(), ballast_bytes_ - written);
      s = file->Append(rocksdb::Slice(zeros.data(), n), io, nullptr);
      written += n;
    }
    if (s.ok()) s = file->Sync(io, nullptr);
    if (file != nullptr) {
      rocksdb::IOStatus closed = file->Close(io, nullptr);
      if (s.ok()) s = closed;
    }
    if (!s.ok()) {
      fs->DeleteFile(ballast_path_, io, nullptr).PermitUncheckedError();
      return false;
    }
    ballast_held_ = true;
    free_checked_ = -1;
    return true;
  }

  // A data dir left without a reserve (--min_free_bytes=0) keeps no
  // ballast from an earlier run either.
  void DropStaleBallast() {
    if (ballast_bytes_ != 0) return;
    db_options_.env->GetFileSystem()
        ->DeleteFile(ballast_path_, rocksdb::IOOptions(), nullptr)
        .PermitUncheckedError();
  }

 private:
  // Free space, beyond the reserve, that must come back before RocksDB is
  // asked to resume after running out of it.
  static constexpr uint64_t kResumeFreeBytes = 4 << 20;
  // How much larger than configured a reopened database's memtables are.
  static constexpr int kReopenMemtableFactor = 4;

  // Once a failed write's cause may be gone (needed_free_ is free), lets
  // RocksDB go on. Says nothing of the reserve.
  absl::Status ResumeIfSpace() {
    if (needed_free_ > 0) {
      const int64_t free = FreeBytes(path_);
      if (free >= 0 && static_cast<uint64_t>(free) < needed_free_) {
        if (!failed_.ok()) return failed_;
        return absl::ResourceExhaustedError(
            absl::StrCat("the data dir ", path_, " has ", free,
                         " bytes free; writes "
                         "resume once ",
                         needed_free_,
                         " are (the last refused write plus "
                         "the reserve, --min_free_bytes)"));
      }
      needed_free_ = 0;
    }
    return Resume();
  }

  // RESOURCE_EXHAUSTED while the disk cannot hold the reserve, so health is
  // NOT_SERVING from the start on a disk too small for it, not only after
  // the first refused write. `disk` is the data dir's, just read.
  absl::Status CheckReserve(const DiskSpace& disk) const {
    const uint64_t held = ballast_held_ ? ballast_bytes_ : 0;
    if (static_cast<uint64_t>(disk.free) + held >= min_free_bytes_) {
      return absl::OkStatus();
    }
    const bool too_small =
        disk.total >= 0 && static_cast<uint64_t>(disk.total) < min_free_bytes_;
    return absl::ResourceExhaustedError(absl::StrCat(
        "the data dir ", path_, " is on a disk of ", disk.total, " bytes with ",
        disk.free + held, " free for cohortd, less than the ", min_free_bytes_,
        " bytes it keeps in reserve (--min_free_bytes): every write is "
        "refused until ",
        too_small ? "--min_free_bytes is lowered below the disk's size or the "
                    "data dir moves to a larger disk"
                  : "space is freed on that disk (or --min_free_bytes lowered)",
        "; reads and deletes work"));
  }

  // For deletes on a disk that something else filled: gives the ballast
  // back and reopens RocksDB in that room, so the delete can be logged.
  // Reopening replays the WAL without a flush, where a resume would flush
  // the memtables, which may need far more than the ballast. Puts stay
  // refused (Admit no longer counts the ballast) until space is back.
  absl::Status ReopenOnBallast() {
    if (!ballast_held_ || *reads_out_ > 0) return failed_;
    const rocksdb::IOStatus removed =
        db_options_.env->GetFileSystem()->DeleteFile(
            ballast_path_, rocksdb::IOOptions(), nullptr);
    if (!removed.ok()) return failed_;
    ballast_held_ = false;
    free_checked_ = -1;
    if (log_) {
      log_(absl::StrCat("the data dir ", path_,
                        " is full: gave back the reserve's ", ballast_bytes_,
                        "-byte ballast file to let deletes through; it is "
                        "taken again once ",
                        ballast_bytes_ + kResumeFreeBytes, " bytes are free"));
    }
    last_reopen_ = absl::Now();
    rocksdb::Status s = Reopen();
    if (!s.ok()) {
      absl::Status reopened = FromRocks(s, "reopen");
      if (!absl::IsResourceExhausted(reopened)) failed_ = reopened;
      return failed_;
    }
    failed_ = absl::OkStatus();
    return failed_;
  }

  rocksdb::Status Write(rocksdb::WriteBatch& batch) {
    const absl::Time started = absl::Now();
    rocksdb::Status written = db_->Write(write_options_, &batch);
    if (write_options_.sync && on_sync_ && written.ok()) {
      on_sync_(absl::Now() - started);
    }
    return written;
  }

  // RocksDB stops writing after a failed write; once the cause may be gone,
  // this lets it start a new WAL and go on. While RocksDB's own recovery
  // runs (Busy) or space is still short, the original error stands.
  absl::Status Resume() {
    if (failed_.ok()) return failed_;
    const bool writable = db_ != nullptr && !read_only_;
    // Busy: RocksDB is recovering by itself, or nothing was tried.
    rocksdb::Status s = writable ? db_->Resume() : rocksdb::Status::Busy();
    // RocksDB 7.8 cannot always resume after a failed WAL write; reopening
    // replays the WAL, which holds every acknowledged write. At most once a
    // second, and not while a read holds a snapshot.
    const absl::Time now = absl::Now();
    if (!s.ok() && (!s.IsBusy() || !writable) && *reads_out_ == 0 &&
        now - last_reopen_ >= absl::Seconds(1)) {
      last_reopen_ = now;
      s = Reopen();
    }
    if (s.ok()) {
      failed_ = absl::OkStatus();
    } else if (!s.IsBusy()) {
      // Still out of space: the original error stands; anything else
      // replaces it.
      absl::Status resumed = FromRocks(s, "resume");
      if (!absl::IsResourceExhausted(resumed)) failed_ = resumed;
    }
    return failed_;
  }

  // Closes and opens the database again, reloading keys and revision.
  // REQUIRES: no PreparedRead is out.
  rocksdb::Status Reopen() {
    if (db_ != nullptr) db_->Close().PermitUncheckedError();
    db_.reset();
    // Replaying the WAL flushes a memtable that fills, and after a failed
    // flush the WAL holds up to two memtables' worth: a flush the disk may
    // have no room for. Larger memtables hold it all until it has.
    rocksdb::Options options = db_options_;
    options.write_buffer_size *= kReopenMemtableFactor;
    rocksdb::DB* raw = nullptr;
    rocksdb::Status s = rocksdb::DB::Open(options, path_, &raw);
    if (s.ok()) FlushOnLowPool(db_options_.env);
    if (!s.ok()) {
      // Reads go on from a read-only instance until a later Reopen works.
      rocksdb::DB* read_only = nullptr;
      if (rocksdb::DB::OpenForReadOnly(options, path_, &read_only).ok()) {
        db_.reset(read_only);
        read_only_ = true;
      }
      return s;
    }
    read_only_ = false;
    memtable_grown_ = true;
    db_.reset(raw);
    keys_.clear();
    if (absl::Status loaded = Load(); !loaded.ok()) {
      return rocksdb::Status::IOError(std::string(loaded.message()));
    }
    return s;
  }

  // The memtables' size, about what their flush will need on disk.
  uint64_t UnflushedBytes() const {
    uint64_t unflushed = 0;
    if (db_ != nullptr) {
      db_->GetIntProperty(rocksdb::DB::Properties::kCurSizeAllMemTables,
                          &unflushed);
    }
    return unflushed;
  }

  absl::Status FromRocks(const rocksdb::Status& s,
                         absl::string_view what) const {
    return RocksError(s, what, path_);
  }

  // Refuses a write of `bytes` that would leave less than the reserve once
  // the memtables (whose flush will need about their size on disk) are
  // flushed.
  //
  // statvfs costs as much as the write itself, so the free space is asked
  // again only every kFreeSpaceRecheck, or sooner once the writes since
  // could have used half of the margin it showed.
  absl::Status Admit(size_t bytes) {
    const uint64_t unflushed = UnflushedBytes();
    const uint64_t needed = min_free_bytes_ + unflushed + bytes;
    const absl::Time now = absl::Now();
    admitted_since_check_ += bytes;
    if (free_checked_ >= 0 && now - free_checked_at_ < kFreeSpaceRecheck &&
        static_cast<uint64_t>(free_checked_) >= needed &&
        2 * admitted_since_check_ <
            static_cast<uint64_t>(free_checked_) - needed) {
      return absl::OkStatus();
    }
    const int64_t free = FreeBytes(path_);
    admitted_since_check_ = 0;
    free_checked_at_ = now;
    if (free < 0) {
      free_checked_ = -1;
      return absl::OkStatus();  // Unknown: let RocksDB decide.
    }
    // The ballast is reserve that the disk already counts as used.
    const uint64_t held = ballast_held_ ? ballast_bytes_ : 0;
    free_checked_ = free + held;
    if (static_cast<uint64_t>(free_checked_) >= needed) return absl::OkStatus();
    free_checked_ = -1;  // Ask again next time.
    needed_free_ = std::max(needed_free_, needed - std::min(needed, held));
    return absl::ResourceExhaustedError(absl::StrCat(
        "the data dir ", path_, " has ", free, " bytes free",
        held > 0
            ? absl::StrCat(" (plus the reserve's ", held, "-byte ballast file)")
            : std::string(),
        ", and cohortd keeps ", min_free_bytes_,
        " bytes in reserve (--min_free_bytes) "
        "plus ",
        unflushed, " for flushing the memtables",
        bytes > 0 ? absl::StrCat(" after this write of ", bytes, " bytes")
                  : std::string(),
        ": writes are refused until space is freed on that disk (deleting "
        "keys still works)"));
  }

  // The DB's Env: declared first so that it outlives the DB.
  std::unique_ptr<rocksdb::Env> env_;
  const rocksdb::Options db_options_;
  std::unique_ptr<rocksdb::DB> db_;
  // PreparedReads not yet destroyed: each holds a snapshot of db_, so db_
  // is not reopened while any is out.
  std::shared_ptr<std::atomic<int>> reads_out_ =
      std::make_shared<std::atomic<int>>(0);
  const std::string path_;
  const uint64_t min_free_bytes_;
  rocksdb::WriteOptions write_options_;
  std::function<void(absl::Duration)> on_sync_;
  absl::flat_hash_set<std::string> keys_;
  int64_t revision_ = 0;
  // The error of the last failed write; RocksDB refuses writes after it
  // until Resume().
  absl::Status failed_;
  // Set while db_ is a read-only instance, after a reopen failed.
  bool read_only_ = false;
  // The ballast: ballast_bytes_ of the reserve held as a file, while
  // ballast_held_.
  const std::string ballast_path_;
  const uint64_t ballast_bytes_;
  bool ballast_held_ = false;
  // Set from a Reopen until the disk can hold the grown memtables' flush.
  bool memtable_grown_ = false;
  const std::function<void(absl::string_view)> log_;
  absl::Time last_reopen_ = absl::InfinitePast();
  // While nonzero, writes are known not to fit: health stays NOT_SERVING
  // until this many bytes are free.
  uint64_t needed_free_ = 0;
  // Admit's cached view of the disk: free bytes at free_checked_at_ (-1:
  // unknown) and bytes admitted since.
  static constexpr absl::Duration kFreeSpaceRecheck = absl::Milliseconds(100);
  int64_t free_checked_ = -1;
  absl::Time free_checked_at_;
  uint64_t admitted_since_check_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvEngine>> OpenRocksDbEngine(
    const RocksDbOptions& options) {
  rocksdb::Options db_options;
  db_options.create_if_missing = true;
  rocksdb::Env* base =
      options.env != nullptr ? options.env : rocksdb::Env::Default();
  std::unique_ptr<rocksdb::Env> env = rocksdb::NewCompositeEnv(
      std::make_shared<NoAutoRecoveryFileSystem>(base->GetFileSystem()));
  db_options.env = env.get();
  db_options.info_log = std::make_shared<ForwardingLogger>(
      options.log ? options.log : [](absl::string_view line) {
        std::fprintf(stderr, "rocksdb: %.*s\n", static_cast<int>(line.size()),
                     line.data());
      });
  db_options.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  // A coordinator's data is small and hot: keep the footprint modest.
  db_options.max_background_jobs = 2;
  db_options.write_buffer_size = 32 << 20;
  // Replaying the WAL at start must not need room for a flush: a cohortd
  // stopped on a full disk can start again once a little space is free.
  db_options.avoid_flush_during_recovery = true;
  // No file grows by preallocated chunks (a new WAL would take 35 MiB at
  // once), so the free space the reserve is checked against is what the
  // files really use.
  db_options.allow_fallocate = false;
  // Large values go to blob files, so SST blocks stay a few KiB and a point
  // lookup never decompresses a multi-MiB block.
  db_options.enable_blob_files = true;
  db_options.min_blob_size = 64 << 10;
  db_options.enable_blob_garbage_collection = true;
  rocksdb::BlockBasedTableOptions table;
  table.block_cache = rocksdb::NewLRUCache(64 << 20);
  table.filter_policy.reset(rocksdb::NewBloomFilterPolicy(10));
  db_options.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));

  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(db_options, options.path, &raw);
  if (s.ok()) FlushOnLowPool(db_options.env);
  if (!s.ok()) {
    const int64_t free = FreeBytes(options.path);
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot open RocksDB at '", options.path, "': ", s.ToString(),
        s.IsNoSpace() || absl::StrContains(s.ToString(), "No space left")
            ? absl::StrCat(" (", free,
                           " bytes free on its disk: free space "
                           "there and start cohortd again)")
            : std::string()));
  }
  auto engine = std::make_unique<RocksDbEngine>(
      std::move(env), db_options, std::unique_ptr<rocksdb::DB>(raw), options);
  if (absl::Status st = engine->Load(); !st.ok()) return st;
  engine->DropStaleBallast();
  engine->HoldBallast();
  return engine;
}

}  // namespace cohort::store
