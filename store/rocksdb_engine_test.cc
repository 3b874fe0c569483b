#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <map>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rocksdb/env.h"
#include "rocksdb/file_system.h"
#include "store/kv_engine.h"
#include "store/kv_store.h"

namespace cohort::store {
namespace {

std::string FreshDir(const std::string& name) {
  auto dir = std::filesystem::path(testing::TempDir()) / name;
  std::filesystem::remove_all(dir);
  return dir.string();
}

TEST(RocksDbEngineTest, KeysCountersAndRevisionSurviveReopen) {
  const std::string dir = FreshDir("reopen");
  int64_t revision = 0;
  {
    auto engine = OpenRocksDbEngine({.path = dir});
    ASSERT_TRUE(engine.ok()) << engine.status();
    KvStore store(std::move(*engine));
    ASSERT_TRUE(store.Set("a", "1").ok());
    ASSERT_TRUE(store.Add("n", 41).ok());
    ASSERT_TRUE(store.Add("n", 1).ok());
    ASSERT_TRUE(store.MultiSet({"b", "c"}, {"2", "3"}).ok());
    ASSERT_TRUE(store.Delete("c").ok());
    revision = store.revision();
  }
  auto engine = OpenRocksDbEngine({.path = dir});
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->revision(), revision);
  EXPECT_EQ((*engine)->NumKeys(), 3);
  EXPECT_EQ(*(*engine)->Get("n"), "42");
  EXPECT_EQ(*(*engine)->Get("a"), "1");
  EXPECT_FALSE((*engine)->Get("c")->has_value());
  // The revision keeps counting from where it stopped.
  KvStore store(std::move(*engine));
  EXPECT_EQ(*store.Set("d", "4"), revision + 1);
}

TEST(RocksDbEngineTest, StatsCountDiskBytesAndTimeSyncs) {
  const std::string dir = FreshDir("stats");
  auto engine = OpenRocksDbEngine({.path = dir, .sync_writes = true});
  ASSERT_TRUE(engine.ok()) << engine.status();
  KvStore store(std::move(*engine));
  std::atomic<int> syncs{0};
  store.SetSyncObserver([&](absl::Duration d) {
    EXPECT_GE(d, absl::ZeroDuration());
    ++syncs;
  });
  ASSERT_TRUE(store.Set("a", std::string(4096, 'x')).ok());
  ASSERT_TRUE(store.Set("b", "2").ok());
  EXPECT_EQ(syncs.load(), 2);  // One per synced write.
  ASSERT_TRUE(store.Flush().ok());
  EXPECT_EQ(syncs.load(), 3);  // And the flush's.
  StoreStats stats = store.stats();
  EXPECT_EQ(stats.keys, 2);
  EXPECT_EQ(stats.revision, 2);
  EXPECT_GT(stats.disk_bytes, 4096u);
  store.SetSyncObserver(nullptr);
  ASSERT_TRUE(store.Set("c", "3").ok());
  EXPECT_EQ(syncs.load(), 3);
}

TEST(RocksDbEngineTest, SecondOpenOfALockedDirectoryFailsClearly) {
  const std::string dir = FreshDir("locked");
  auto first = OpenRocksDbEngine({.path = dir});
  ASSERT_TRUE(first.ok());
  auto second = OpenRocksDbEngine({.path = dir});
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(), ::testing::HasSubstr(dir));
}

TEST(RocksDbEngineTest, SyncWritesPersist) {
  const std::string dir = FreshDir("sync");
  {
    auto engine = OpenRocksDbEngine({.path = dir, .sync_writes = true});
    ASSERT_TRUE(engine.ok());
    ASSERT_TRUE(
        (*engine)->Apply({Mutation{Mutation::Kind::kPut, "k", "v"}}, 1).ok());
  }
  auto engine = OpenRocksDbEngine({.path = dir});
  ASSERT_TRUE(engine.ok());
  EXPECT_EQ(*(*engine)->Get("k"), "v");
}

// A file system over the real one that can be made full: where the sandbox
// cannot mount a small disk (tests/robustness/disk_full_test does). Once Fill()
// is called, appends fail with ENOSPC beyond the room left, which starts at
// zero and grows by the size of each file deleted, as on a real disk.
class FullDiskFileSystem final : public rocksdb::FileSystemWrapper {
 public:
  FullDiskFileSystem()
      : rocksdb::FileSystemWrapper(rocksdb::FileSystem::Default()) {}
  static const char* kClassName() { return "FullDiskFileSystem"; }
  const char* Name() const override { return kClassName(); }

  void Fill(int64_t room = 0) { room_ = room; }
  void Empty() { room_ = -1; }
  bool full() const { return room_ == 0; }

  rocksdb::IOStatus NewWritableFile(
      const std::string& name, const rocksdb::FileOptions& options,
      std::unique_ptr<rocksdb::FSWritableFile>* result,
      rocksdb::IODebugContext* dbg) override {
    if (full()) return rocksdb::IOStatus::NoSpace("injected: disk full");
    rocksdb::IOStatus s = target()->NewWritableFile(name, options, result, dbg);
    if (s.ok()) result->reset(new File(std::move(*result), this));
    return s;
  }

  rocksdb::IOStatus DeleteFile(const std::string& name,
                               const rocksdb::IOOptions& options,
                               rocksdb::IODebugContext* dbg) override {
    uint64_t size = 0;
    if (!target()->GetFileSize(name, options, &size, dbg).ok()) size = 0;
    rocksdb::IOStatus s = target()->DeleteFile(name, options, dbg);
    int64_t room = room_.load();
    while (s.ok() && room >= 0 &&
           !room_.compare_exchange_weak(room, room + size)) {
    }
    return s;
  }

 private:
  // Takes `bytes` from the room, or says there is not enough.
  bool Take(size_t bytes) {
    int64_t room = room_.load();
    do {
      if (room < 0) return true;
      if (static_cast<uint64_t>(room) < bytes) return false;
    } while (!room_.compare_exchange_weak(room, room - bytes));
    return true;
  }

  class File final : public rocksdb::FSWritableFileOwnerWrapper {
   public:
    File(std::unique_ptr<rocksdb::FSWritableFile> file, FullDiskFileSystem* fs)
        : rocksdb::FSWritableFileOwnerWrapper(std::move(file)), fs_(fs) {}
    rocksdb::IOStatus Append(const rocksdb::Slice& data,
                             const rocksdb::IOOptions& options,
                             rocksdb::IODebugContext* dbg) override {
      if (!fs_->Take(data.size())) {
        return rocksdb::IOStatus::NoSpace("injected: disk full");
      }
      return target()->Append(data, options, dbg);
    }
    rocksdb::IOStatus Append(const rocksdb::Slice& data,
                             const rocksdb::IOOptions& options,
                             const rocksdb::DataVerificationInfo& info,
                             rocksdb::IODebugContext* dbg) override {
      if (!fs_->Take(data.size())) {
        return rocksdb::IOStatus::NoSpace("injected: disk full");
      }
      return target()->Append(data, options, info, dbg);
    }

   private:
    FullDiskFileSystem* const fs_;
  };

  // Bytes that may still be appended; -1: no limit.
  std::atomic<int64_t> room_{-1};
};

// Polls CheckWritable as cohortd's health check does, up to 30 s (longer
// under sanitizers, COHORT_TEST_TIME_SCALE): a busy machine can delay
// RocksDB's background work. Returns its last answer.
absl::Status AwaitWritable(KvStore& store) {
  const char* scale_env = std::getenv("COHORT_TEST_TIME_SCALE");
  const int scale =
      scale_env != nullptr ? std::max(1, std::atoi(scale_env)) : 1;
  absl::Status writable;
  for (int i = 0; i < 300 * scale; ++i) {
    writable = store.CheckWritable();
    if (writable.ok()) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return writable;
}

// Waits until `dir` holds one write-ahead log: RocksDB has flushed every
// memtable but the current one and deleted their logs. The fake disk gives
// a deleted file's bytes back to its room, so a log deleted after Fill
// would otherwise refill it at a moment of RocksDB's choosing.
bool AwaitOneLog(const std::string& dir) {
  const char* scale_env = std::getenv("COHORT_TEST_TIME_SCALE");
  const int scale =
      scale_env != nullptr ? std::max(1, std::atoi(scale_env)) : 1;
  for (int i = 0; i < 300 * scale; ++i) {
    int logs = 0;
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      if (entry.path().extension() == ".log") ++logs;
    }
    if (logs == 1) return true;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return false;
}

// Opening `dir` again finds exactly `acked`.
void ExpectHolds(const std::string& dir,
                 const std::map<std::string, std::string>& acked) {
  auto engine = OpenRocksDbEngine({.path = dir});
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->NumKeys(), static_cast<int64_t>(acked.size()));
  for (const auto& [key, value] : acked) {
    EXPECT_EQ(*(*engine)->Get(key), value) << key;
  }
}

TEST(RocksDbEngineTest, FullDiskIsResourceExhaustedAndWritesResumeAfter) {
  const std::string dir = FreshDir("injected_full");
  auto fs = std::make_shared<FullDiskFileSystem>();
  std::unique_ptr<rocksdb::Env> env = rocksdb::NewCompositeEnv(fs);
  std::vector<std::string> logged;
  std::map<std::string, std::string> acked;
  {
    auto engine = OpenRocksDbEngine(
        {.path = dir,
         .min_free_bytes = 0,
         .log = [&](absl::string_view line) { logged.emplace_back(line); },
         .env = env.get()});
    ASSERT_TRUE(engine.ok()) << engine.status();
    KvStore store(std::move(*engine));
    for (int i = 0; i < 100; ++i) {
      const std::string key = absl::StrCat("k", i);
      ASSERT_TRUE(store.Set(key, std::string(1000, 'a' + i % 26)).ok());
      acked[key] = std::string(1000, 'a' + i % 26);
    }
    fs->Fill();
    for (int i = 0; i < 20; ++i) {
      absl::StatusOr<int64_t> refused = store.Set("late", "x");
      EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted)
          << refused.status();
      EXPECT_THAT(refused.status().message(), ::testing::HasSubstr(dir));
    }
    EXPECT_EQ(store.CheckWritable().code(),
              absl::StatusCode::kResourceExhausted);
    // Reads go on.
    EXPECT_EQ(*store.TryGet("k7"), acked["k7"]);
    fs->Empty();
    // Space is back: the engine resumes (RocksDB's own recovery may be
    // running) and takes writes.
    absl::Status writable = AwaitWritable(store);
    EXPECT_TRUE(writable.ok()) << writable;
    ASSERT_TRUE(store.Set("after", "space").ok());
    acked["after"] = "space";
    ASSERT_TRUE(store.Delete("k0").ok());
    acked.erase("k0");
  }
  // Nothing went to a LOG file in the data dir; warnings came to the sink.
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(dir) / "LOG"));
  EXPECT_FALSE(logged.empty());
  ExpectHolds(dir, acked);
}

// Issue 24: once RocksDB itself hit ENOSPC (something else filled the
// disk), deletes failed with the write's error, though they are how a job
// cleans up. The reserve's ballast file is given back for them.
TEST(RocksDbEngineTest, DeletesGoThroughOnAFullDiskOnTheReservesBallast) {
  const std::string dir = FreshDir("deletes_on_full");
  const std::filesystem::path ballast =
      std::filesystem::path(dir) / "cohort-reserve";
  auto fs = std::make_shared<FullDiskFileSystem>();
  std::unique_ptr<rocksdb::Env> env = rocksdb::NewCompositeEnv(fs);
  std::vector<std::string> logged;
  std::map<std::string, std::string> acked;
  {
    auto engine = OpenRocksDbEngine(
        {.path = dir,
         .min_free_bytes = 4 << 20,
         .log = [&](absl::string_view line) { logged.emplace_back(line); },
         .env = env.get()});
    ASSERT_TRUE(engine.ok()) << engine.status();
    std::error_code ec;
    EXPECT_EQ(std::filesystem::file_size(ballast, ec), 1u << 20) << ec;
    KvStore store(std::move(*engine));
    for (int i = 0; i < 100; ++i) {
      const std::string key = absl::StrCat("k", i);
      ASSERT_TRUE(store.Set(key, std::string(1000, 'a' + i % 26)).ok());
      acked[key] = std::string(1000, 'a' + i % 26);
    }
    fs->Fill();
    absl::StatusOr<int64_t> refused = store.Set("late", "x");
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted)
        << refused.status();
    for (int i = 0; i < 50; ++i) {
      const std::string key = absl::StrCat("k", i);
      absl::StatusOr<DeleteResult> deleted = store.Delete(key);
      ASSERT_TRUE(deleted.ok()) << key << ": " << deleted.status();
      EXPECT_TRUE(deleted->deleted) << key;
      acked.erase(key);
    }
    EXPECT_FALSE(std::filesystem::exists(ballast));
    EXPECT_THAT(logged, ::testing::Contains(::testing::HasSubstr(
                            "gave back the reserve's 1048576-byte ballast")));
    EXPECT_EQ(*store.TryGet("k0"), std::nullopt);
    EXPECT_EQ(*store.TryGet("k50"), acked["k50"]);

    // Space is back: so are writes, and the ballast.
    fs->Empty();
    absl::Status writable = AwaitWritable(store);
    EXPECT_TRUE(writable.ok()) << writable;
    EXPECT_TRUE(std::filesystem::exists(ballast));
    ASSERT_TRUE(store.Set("after", "space").ok());
    acked["after"] = "space";
  }
  ExpectHolds(dir, acked);
}

// The case: a memtable flush (of blob files) ran out of space.
// Reopening replays the whole WAL, more than a memtable holds, which must
// not need a flush either.
TEST(RocksDbEngineTest, DeletesGoThroughAfterAFlushRanOutOfSpace) {
  const std::string dir = FreshDir("deletes_after_flush");
  auto fs = std::make_shared<FullDiskFileSystem>();
  std::unique_ptr<rocksdb::Env> env = rocksdb::NewCompositeEnv(fs);
  std::map<std::string, std::string> acked;
  {
    auto engine = OpenRocksDbEngine({.path = dir,
                                     .min_free_bytes = 4 << 20,
                                     .log = [](absl::string_view) {},
                                     .env = env.get()});
    ASSERT_TRUE(engine.ok()) << engine.status();
    KvStore store(std::move(*engine));
    // 40 MiB of 128 KiB values: past the 32 MiB memtable, whose flush
    // finds no room left after the first 36 MiB.
    const std::string value(128 << 10, 'v');
    for (int i = 0; i < 320; ++i) {
      if (i == 288) {
        // The first memtable (keys up to about k255) is flushed while there
        // is room; the second one's flush is the one that runs out.
        ASSERT_TRUE(AwaitOneLog(dir)) << "the first memtable's log remains";
        fs->Fill(1 << 20);
      }
      const std::string key = absl::StrCat("k", i);
      if (!store.Set(key, value).ok()) break;
      acked[key] = value;
    }
    EXPECT_EQ(store.Flush().code(), absl::StatusCode::kResourceExhausted);
    ASSERT_GT(acked.size(), 256u);
    for (int i = 0; i < 100; ++i) {
      const std::string key = absl::StrCat("k", i);
      absl::StatusOr<DeleteResult> deleted = store.Delete(key);
      ASSERT_TRUE(deleted.ok()) << key << ": " << deleted.status();
      acked.erase(key);
    }
    EXPECT_EQ(*store.TryGet("k0"), std::nullopt);
    EXPECT_EQ(*store.TryGet("k100"), value);

    fs->Empty();
    absl::Status writable = AwaitWritable(store);
    EXPECT_TRUE(writable.ok()) << writable;
    ASSERT_TRUE(store.Set("after", "space").ok());
    acked["after"] = "space";
    ASSERT_TRUE(store.Flush().ok());
  }
  ExpectHolds(dir, acked);
}

// Issue 24: with a reserve larger than the disk, every write is refused,
// yet health said SERVING until the first one was.
TEST(RocksDbEngineTest, ReserveTheDiskCannotHoldIsNotWritableFromTheStart) {
  const std::string dir = FreshDir("reserve_too_large");
  const uint64_t reserve = uint64_t{1} << 62;
  auto engine = OpenRocksDbEngine({.path = dir, .min_free_bytes = reserve});
  ASSERT_TRUE(engine.ok()) << engine.status();
  const absl::Status writable = (*engine)->CheckWritable();
  EXPECT_EQ(writable.code(), absl::StatusCode::kResourceExhausted) << writable;
  EXPECT_THAT(writable.message(), ::testing::HasSubstr(dir));
  EXPECT_THAT(writable.message(), ::testing::HasSubstr("is on a disk of "));
  EXPECT_THAT(writable.message(),
              ::testing::HasSubstr(absl::StrCat(reserve, " bytes")));
  EXPECT_THAT(writable.message(), ::testing::HasSubstr("--min_free_bytes"));
  EXPECT_THAT(writable.message(),
              ::testing::HasSubstr("lowered below the disk's size"));
  // Puts are refused; deletes still work.
  KvStore store(std::move(*engine));
  EXPECT_EQ(store.Set("k", "v").status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(store.Delete("k").ok());
}

TEST(RocksDbEngineTest, BallastIsPartOfTheReserveAndGoesWithIt) {
  const std::string dir = FreshDir("ballast");
  const std::filesystem::path ballast =
      std::filesystem::path(dir) / "cohort-reserve";
  {
    auto engine = OpenRocksDbEngine({.path = dir, .min_free_bytes = 4096});
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_EQ(std::filesystem::file_size(ballast), 4096u);
    EXPECT_TRUE((*engine)->CheckWritable().ok());
  }
  {
    auto engine = OpenRocksDbEngine({.path = dir});
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_EQ(std::filesystem::file_size(ballast), 1u << 20);
  }
  auto engine = OpenRocksDbEngine({.path = dir, .min_free_bytes = 0});
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_FALSE(std::filesystem::exists(ballast));
}

}  // namespace
}  // namespace cohort::store
