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

// A file system whose writes fail with ENOSPC while `full` is set: a full
// disk where the sandbox cannot mount one (tests/disk_full_test does).
class FullDiskFileSystem final : public rocksdb::FileSystemWrapper {
 public:
  FullDiskFileSystem()
      : rocksdb::FileSystemWrapper(rocksdb::FileSystem::Default()) {}
  static const char* kClassName() { return "FullDiskFileSystem"; }
  const char* Name() const override { return kClassName(); }

  rocksdb::IOStatus NewWritableFile(
      const std::string& name, const rocksdb::FileOptions& options,
      std::unique_ptr<rocksdb::FSWritableFile>* result,
      rocksdb::IODebugContext* dbg) override {
    if (full) return rocksdb::IOStatus::NoSpace("injected: disk full");
    rocksdb::IOStatus s = target()->NewWritableFile(name, options, result, dbg);
    if (s.ok()) result->reset(new File(std::move(*result), &full));
    return s;
  }

  std::atomic<bool> full{false};

 private:
  class File final : public rocksdb::FSWritableFileOwnerWrapper {
   public:
    File(std::unique_ptr<rocksdb::FSWritableFile> file,
         const std::atomic<bool>* full)
        : rocksdb::FSWritableFileOwnerWrapper(std::move(file)), full_(full) {}
    rocksdb::IOStatus Append(const rocksdb::Slice& data,
                             const rocksdb::IOOptions& options,
                             rocksdb::IODebugContext* dbg) override {
      if (*full_) return rocksdb::IOStatus::NoSpace("injected: disk full");
      return target()->Append(data, options, dbg);
    }
    rocksdb::IOStatus Append(const rocksdb::Slice& data,
                             const rocksdb::IOOptions& options,
                             const rocksdb::DataVerificationInfo& info,
                             rocksdb::IODebugContext* dbg) override {
      if (*full_) return rocksdb::IOStatus::NoSpace("injected: disk full");
      return target()->Append(data, options, info, dbg);
    }

   private:
    const std::atomic<bool>* full_;
  };
};

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
    fs->full = true;
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
    fs->full = false;
    // Space is back: the engine resumes (RocksDB's own recovery may be
    // running; cohortd's health check polls like this) and takes writes.
    // Up to 30 s (longer under sanitizers, COHORT_TEST_TIME_SCALE): a busy
    // machine can delay RocksDB's background work.
    const char* scale_env = std::getenv("COHORT_TEST_TIME_SCALE");
    const int scale =
        scale_env != nullptr ? std::max(1, std::atoi(scale_env)) : 1;
    absl::Status writable;
    for (int i = 0; i < 300 * scale; ++i) {
      writable = store.CheckWritable();

      if (writable.ok()) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
    EXPECT_TRUE(writable.ok()) << writable;
    ASSERT_TRUE(store.Set("after", "space").ok());
    acked["after"] = "space";
    ASSERT_TRUE(store.Delete("k0").ok());
    acked.erase("k0");
  }
  // Nothing went to a LOG file in the data dir; warnings came to the sink.
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(dir) / "LOG"));
  EXPECT_FALSE(logged.empty());
  auto engine = OpenRocksDbEngine({.path = dir});
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ((*engine)->NumKeys(), static_cast<int64_t>(acked.size()));
  for (const auto& [key, value] : acked) {
    EXPECT_EQ(*(*engine)->Get(key), value) << key;
  }
}

}  // namespace
}  // namespace cohort::store
