#include "client/file_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <deque>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/text.h"
#include "client/file_store_log.h"
#include "proto/c10d/rules.h"

namespace cohort {

using base::Quote;

namespace {

using file_store_internal::EncodeRecord;
using file_store_internal::kBatch;
using file_store_internal::kClose;
using file_store_internal::kOpen;
using file_store_internal::Mutation;
using file_store_internal::ParseRecords;
using file_store_internal::Record;

// The file starts with kMagic, then holds records (file_store_log.h).
constexpr absl::string_view kMagic = "cohort FileStore v1\n";
constexpr absl::Duration kMinPoll = absl::Milliseconds(1);
constexpr absl::Duration kMaxPoll = absl::Milliseconds(16);
constexpr int kMaxOpenAttempts = 100;

absl::Status FileError(absl::string_view what, const std::string& path) {
  return absl::ErrnoToStatus(
      errno, absl::StrCat(what, " FileStore file \"", path, "\""));
}

bool PreadAll(int fd, std::string& buf, int64_t offset) {
  for (size_t done = 0; done < buf.size();) {
    ssize_t n = ::pread(fd, &buf[done], buf.size() - done, offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += n;
  }
  return true;
}

bool PwriteAll(int fd, absl::string_view buf, int64_t offset) {
  for (size_t done = 0; done < buf.size();) {
    ssize_t n =
        ::pwrite(fd, buf.data() + done, buf.size() - done, offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += n;
  }
  return true;
}

}  // namespace

// An exclusive lock on the whole file for a scope. It is an open file
// description lock: unlike a classic fcntl lock it is not shared by every
// FileStore of the process on the file, nor dropped when one of them closes.
class FileStore::FileLock {
 public:
  FileLock(int fd, const std::string& path) : fd_(fd) {
    struct flock lock = {};
    lock.l_type = F_WRLCK;
    lock.l_whence = SEEK_SET;
    while (::fcntl(fd, F_OFD_SETLKW, &lock) != 0) {
      if (errno != EINTR) {
        status_ = FileError("cannot lock", path);
        break;
      }
    }
  }
  ~FileLock() {
    if (!status_.ok()) return;
    struct flock lock = {};
    lock.l_type = F_UNLCK;
    lock.l_whence = SEEK_SET;
    ::fcntl(fd_, F_OFD_SETLK, &lock);
  }
  const absl::Status& status() const { return status_; }

 private:
  const int fd_;
  absl::Status status_;
};

// Events reach the watch's queue whenever any thread of the store reads the
// file; the watch's thread reads it too, so that they arrive when it is idle.
class FileStore::FileWatch final : public WatchHandle {
 public:
  FileWatch(FileStore* store, absl::string_view prefix, int64_t start,
            WatchCallback callback)
      : store_(store),
        prefix_(prefix),
        start_(start),
        callback_(std::move(callback)) {}
  ~FileWatch() override { Cancel(); }

  void Start() {
    thread_ = std::thread([this] { Run(); });
  }

  void Offer(const Mutation& m, int64_t revision) {
    if (revision < start_ || !absl::StartsWith(m.key, prefix_)) return;
    WatchEvent event;
    event.type = m.is_put ? WatchEvent::Type::kPut : WatchEvent::Type::kDelete;
    event.key = m.key;
    event.value = m.value;
    event.revision = revision;
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(event));
  }

  void Cancel() override {
    store_->Unregister(this);
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
    }
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) {
      thread_.join();
    }
  }

  absl::Status Wait() override {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
    return status_;
  }

 private:
  void Run() {
    absl::Duration poll = kMinPoll;
    absl::Status status;
    for (;;) {
      std::optional<WatchEvent> event;
      {
        absl::MutexLock lock(&mu_);
        if (cancelled_) break;
        if (!queue_.empty()) {
          event = std::move(queue_.front());
          queue_.pop_front();
        }
      }
      if (event) {
        callback_(*event);
        poll = kMinPoll;
        continue;
      }
      status = store_->Poll();
      if (!status.ok()) break;
      absl::MutexLock lock(&mu_);
      if (queue_.empty()) {
        mu_.AwaitWithTimeout(absl::Condition(&cancelled_), poll);
        poll = std::min(poll * 2, kMaxPoll);
      }
    }
    if (!status.ok()) store_->Unregister(this);
    absl::MutexLock lock(&mu_);
    status_ = status;
    done_ = true;
  }

  FileStore* const store_;
  const std::string prefix_;
  const int64_t start_;
  const WatchCallback callback_;
  std::thread thread_;
  absl::Mutex mu_;
  std::deque<WatchEvent> queue_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<std::unique_ptr<FileStore>> FileStore::Open(
    const std::string& path, int num_workers) {
  FileStoreOptions options;
  options.num_workers = num_workers;
  return Open(path, options);
}

absl::StatusOr<std::unique_ptr<FileStore>> FileStore::Open(
    const std::string& path, const FileStoreOptions& options) {
  for (int attempt = 0; attempt < kMaxOpenAttempts; ++attempt) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return FileError("cannot open or create", path);
    std::unique_ptr<FileStore> store(new FileStore(path, fd, options));
    absl::StatusOr<bool> joined = store->Join();
    if (!joined.ok()) return joined.status();
    if (*joined) return store;
  }
  return absl::UnavailableError(absl::StrCat(
      "FileStore file \"", path, "\" was removed ", kMaxOpenAttempts,
      " times while being opened; are its users closing it in a loop?"));
}

FileStore::FileStore(std::string path, int fd, const FileStoreOptions& options)
    : path_(std::move(path)),
      num_workers_(options.num_workers),
      limits_(options.limits),
      fd_(fd) {}

FileStore::~FileStore() {
  Leave();
  ::close(fd_);
}

absl::StatusOr<bool> FileStore::PathIsOursLocked() {
  struct stat opened, named;
  if (::fstat(fd_, &opened) != 0) return FileError("cannot stat", path_);
  if (opened.st_nlink == 0) return false;
  if (::stat(path_.c_str(), &named) != 0) {
    if (errno == ENOENT) return false;
    return FileError("cannot stat", path_);
  }
  return named.st_dev == opened.st_dev && named.st_ino == opened.st_ino;
}

absl::StatusOr<bool> FileStore::Join() {
  absl::MutexLock lock(&mu_);
  FileLock file(fd_, path_);
  if (!file.status().ok()) return file.status();
  // The last user removes the file while holding its lock: if we opened it
  // just before, we must open the path again rather than join a dead file.
  absl::StatusOr<bool> ours = PathIsOursLocked();
  if (!ours.ok() || !*ours) return ours;
  struct stat st;
  if (::fstat(fd_, &st) != 0) return FileError("cannot stat", path_);
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "\"", path_, "\" is not a FileStore file: not a regular file"));
  }
  std::string head(std::min<int64_t>(st.st_size, kMagic.size()), '\0');
  if (!PreadAll(fd_, head, 0)) return FileError("cannot read", path_);
  if (head != kMagic) {
    // A new file, or one whose creator died before its header was whole.
    if (!absl::StartsWith(kMagic, head)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "\"", path_, "\" is not a FileStore file: it does not start with ",
          Quote(kMagic)));
    }
    if (::ftruncate(fd_, 0) != 0 || !PwriteAll(fd_, kMagic, 0)) {
      return FileError("cannot initialize", path_);
    }
  }
  offset_ = kMagic.size();
  if (absl::Status s = SyncLocked(file); !s.ok()) return s;
  if (absl::Status s = AppendLocked(kOpen, {}); !s.ok()) return s;
  joined_ = true;
  return true;
}

void FileStore::Leave() {
  absl::MutexLock lock(&mu_);
  if (!joined_) return;
  FileLock file(fd_, path_);
  absl::Status status = SyncLocked(file);
  if (status.ok()) status = AppendLocked(kClose, {});
  if (!status.ok()) {
    std::fprintf(stderr, "cohort::FileStore: could not record the close: %s\n",
                 status.ToString().c_str());
    return;
  }
  // c10d's rule: with num_workers set, the file goes once that many stores
  // closed and none is open. Removing it under the lock tells a store being
  // opened to open the path again (see Join).
  if (num_workers_ > 0 && closes_ >= num_workers_ && opens_ == closes_) {
    absl::StatusOr<bool> ours = PathIsOursLocked();
    if (ours.ok() && *ours) ::unlink(path_.c_str());
  }
}

absl::Status FileStore::SyncLocked(const FileLock& file) {
  if (!file.status().ok()) return file.status();
  struct stat st;
  if (::fstat(fd_, &st) != 0) return FileError("cannot stat", path_);
  if (st.st_size < offset_) {
    return absl::DataLossError(absl::StrCat(
        "FileStore file \"", path_, "\" shrank from ", offset_, " to ",
        st.st_size, " bytes: something other than FileStore wrote to it"));
  }
  if (st.st_size == offset_) return absl::OkStatus();
  std::string tail(st.st_size - offset_, '\0');
  if (!PreadAll(fd_, tail, offset_)) return FileError("cannot read", path_);
  std::vector<Record> records;
  absl::StatusOr<size_t> used = ParseRecords(tail, offset_, path_, records);
  if (!used.ok()) return used.status();
  offset_ += *used;
  for (Record& r : records) ApplyLocked(r.kind, r.mutations);
  return absl::OkStatus();
}

absl::Status FileStore::Poll() {
  absl::MutexLock lock(&mu_);
  FileLock file(fd_, path_);
  return SyncLocked(file);
}

absl::Status FileStore::AppendLocked(char kind,
                                     std::vector<Mutation> mutations) {
  absl::StatusOr<std::string> record = EncodeRecord(kind, mutations);
  if (!record.ok()) return record.status();
  // Bytes past offset_ are a record cut short by a dead writer: cut them off.
  struct stat st;
  if (::fstat(fd_, &st) != 0) return FileError("cannot stat", path_);
  if (st.st_size > offset_ && ::ftruncate(fd_, offset_) != 0) {
    return FileError("cannot truncate", path_);
  }
  if (!PwriteAll(fd_, *record, offset_)) {
    return FileError("cannot write", path_);
  }
  offset_ += record->size();
  ApplyLocked(kind, mutations);
  return absl::OkStatus();
}

void FileStore::ApplyLocked(char kind, std::vector<Mutation>& mutations) {
  if (kind == kOpen) ++opens_;
  if (kind == kClose) ++closes_;
  if (kind != kBatch) return;
  ++revision_;
  for (Mutation& m : mutations) {
    for (FileWatch* watch : watches_) watch->Offer(m, revision_);
    if (m.is_put) {
      data_[m.key] = std::move(m.value);
    } else {
      data_.erase(m.key);
    }
  }
}

absl::Status FileStore::Commit(std::vector<Mutation> mutations) {
  absl::MutexLock lock(&mu_);
  FileLock file(fd_, path_);
  if (absl::Status s = SyncLocked(file); !s.ok()) return s;
  return AppendLocked(kBatch, std::move(mutations));
}

absl::StatusOr<std::vector<std::string>> FileStore::Read(
    absl::Span<const std::string> keys, bool values, absl::Duration timeout) {
  if (absl::Status s = c10d::CheckKeys(limits_, keys); !s.ok()) return s;
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration poll = kMinPoll;
  for (;;) {
    std::vector<absl::string_view> missing;
    std::vector<std::string> out;
    {
      absl::MutexLock lock(&mu_);
      FileLock file(fd_, path_);
      if (absl::Status s = SyncLocked(file); !s.ok()) return s;
      std::set<absl::string_view> seen;
      for (const std::string& key : keys) {
        auto it = data_.find(key);
        if (it == data_.end()) {
          if (seen.insert(key).second) missing.push_back(key);
        } else if (values) {
          out.push_back(it->second);
        }
      }
    }
    if (missing.empty()) return out;
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return c10d::WaitTimeout(timeout, keys.size(), missing);
    }
    absl::SleepFor(std::min(poll, deadline - now));
    poll = std::min(poll * 2, kMaxPoll);
  }
}

absl::Status FileStore::Set(absl::string_view key, absl::string_view value) {
  if (absl::Status s = c10d::CheckKey(limits_, key); !s.ok()) return s;
  if (absl::Status s = c10d::CheckValue(limits_, value); !s.ok()) return s;
  return Commit({{std::string(key), std::string(value)}});
}

absl::StatusOr<std::string> FileStore::Get(absl::string_view key,
                                           absl::Duration timeout) {
  absl::StatusOr<std::vector<std::string>> values =
      Read({std::string(key)}, true, timeout);
  if (!values.ok()) return values.status();
  return std::move(values->front());
}

absl::StatusOr<int64_t> FileStore::Add(absl::string_view key, int64_t delta) {
  if (absl::Status s = c10d::CheckKey(limits_, key); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  FileLock file(fd_, path_);
  if (absl::Status s = SyncLocked(file); !s.ok()) return s;
  absl::StatusOr<c10d::AddOutcome> sum = c10d::Add(key, FindLocked(key), delta);
  if (!sum.ok()) return sum.status();
  absl::Status s =
      AppendLocked(kBatch, {{std::string(key), std::move(sum->text)}});
  if (!s.ok()) return s;
  return sum->value;
}

absl::StatusOr<std::string> FileStore::CompareSet(absl::string_view key,
                                                  absl::string_view expected,
                                                  absl::string_view desired) {
  if (absl::Status s = c10d::CheckKey(limits_, key); !s.ok()) return s;
  if (absl::Status s = c10d::CheckValue(limits_, desired); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  FileLock file(fd_, path_);
  if (absl::Status s = SyncLocked(file); !s.ok()) return s;
  const c10d::CompareSetOutcome cas =
      c10d::CompareSet(FindLocked(key), expected, desired);
  std::string result(cas.result);
  if (!cas.write) return result;
  absl::Status s =
      AppendLocked(kBatch, {{std::string(key), std::string(desired)}});
  if (!s.ok()) return s;
  return result;
}

absl::Status FileStore::Wait(absl::Span<const std::string> keys,
                             absl::Duration timeout) {
  return Read(keys, false, timeout).status();
}

absl::StatusOr<bool> FileStore::Check(absl::Span<const std::string> keys) {
  if (absl::Status s = c10d::CheckKeys(limits_, keys); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  FileLock file(fd_, path_);
  if (absl::Status s = SyncLocked(file); !s.ok()) return s;
  for (const std::string& key : keys) {
    if (data_.count(key) == 0) return false;
  }
  return true;
}

absl::StatusOr<bool> FileStore::DeleteKey(absl::string_view key) {
  if (absl::Status s = c10d::CheckKey(limits_, key); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  FileLock file(fd_, path_);
  if (absl::Status s = SyncLocked(file); !s.ok()) return s;
  if (data_.count(key) == 0) return false;
  Mutation m;
  m.key = std::string(key);
  m.is_put = false;
  if (absl::Status s = AppendLocked(kBatch, {std::move(m)}); !s.ok()) return s;
  return true;
}

absl::StatusOr<int64_t> FileStore::NumKeys() {
  absl::MutexLock lock(&mu_);
  FileLock file(fd_, path_);
  if (absl::Status s = SyncLocked(file); !s.ok()) return s;
  return static_cast<int64_t>(data_.size());
}

absl::StatusOr<std::vector<std::string>> FileStore::MultiGet(
    absl::Span<const std::string> keys, absl::Duration timeout) {
  return Read(keys, true, timeout);
}

absl::Status FileStore::MultiSet(absl::Span<const std::string> keys,
                                 absl::Span<const std::string> values) {
  if (absl::Status s = c10d::CheckMultiSet(limits_, keys, values); !s.ok()) {
    return s;
  }
  if (keys.empty()) return absl::OkStatus();
  std::vector<Mutation> batch(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    batch[i].key = keys[i];
    batch[i].value = values[i];
  }
  return Commit(std::move(batch));
}

absl::Status FileStore::Append(absl::string_view key, absl::string_view value) {
  if (absl::Status s = c10d::CheckKey(limits_, key); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  FileLock file(fd_, path_);
  if (absl::Status s = SyncLocked(file); !s.ok()) return s;
  absl::StatusOr<std::string> appended =
      c10d::Append(limits_, key, FindLocked(key), value);
  if (!appended.ok()) return appended.status();
  return AppendLocked(kBatch, {{std::string(key), std::move(*appended)}});
}

absl::StatusOr<KeyList> FileStore::ListKeys(absl::string_view prefix) {
  if (absl::Status s = c10d::CheckPrefix(limits_, prefix); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  FileLock file(fd_, path_);
  if (absl::Status s = SyncLocked(file); !s.ok()) return s;
  KeyList list;
  list.revision = revision_;
  for (auto it = data_.lower_bound(prefix);
       it != data_.end() && absl::StartsWith(it->first, prefix); ++it) {
    list.keys.push_back(it->first);
  }
  return list;
}

absl::StatusOr<std::unique_ptr<WatchHandle>> FileStore::Watch(
    absl::string_view prefix, int64_t from_revision, WatchCallback callback) {
  if (absl::Status s = c10d::CheckPrefix(limits_, prefix); !s.ok()) return s;
  if (from_revision < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("from_revision must be >= 0, got ", from_revision));
  }
  std::unique_ptr<FileWatch> watch;
  {
    absl::MutexLock lock(&mu_);
    FileLock file(fd_, path_);
    if (absl::Status s = SyncLocked(file); !s.ok()) return s;
    const int64_t start = from_revision > 0 ? from_revision : revision_ + 1;
    watch =
        std::make_unique<FileWatch>(this, prefix, start, std::move(callback));
    if (start <= revision_) {
      // Replay the log up to what this store has applied; later records
      // reach the watch through ApplyLocked once it is registered.
      std::string log(offset_ - kMagic.size(), '\0');
      if (!PreadAll(fd_, log, kMagic.size())) {
        return FileError("cannot read", path_);
      }
      std::vector<Record> records;
      absl::StatusOr<size_t> used =
          ParseRecords(log, kMagic.size(), path_, records);
      if (!used.ok()) return used.status();
      int64_t revision = 0;
      for (const Record& r : records) {
        if (r.kind != kBatch) continue;
        ++revision;
        for (const Mutation& m : r.mutations) watch->Offer(m, revision);
      }
    }
    watches_.push_back(watch.get());
  }
  watch->Start();
  return std::unique_ptr<WatchHandle>(std::move(watch));
}

const std::string* FileStore::FindLocked(absl::string_view key) const {
  auto it = data_.find(key);
  return it == data_.end() ? nullptr : &it->second;
}

void FileStore::Unregister(FileWatch* watch) {
  absl::MutexLock lock(&mu_);
  watches_.erase(std::remove(watches_.begin(), watches_.end(), watch),
                 watches_.end());
}

}  // namespace cohort
