#include <filesystem>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
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
    ASSERT_TRUE((*engine)->Apply({Mutation{Mutation::Kind::kPut, "k", "v"}}, 1)
                    .ok());
  }
  auto engine = OpenRocksDbEngine({.path = dir});
  ASSERT_TRUE(engine.ok());
  EXPECT_EQ(*(*engine)->Get("k"), "v");
}

}  // namespace
}  // namespace cohort::store
