#include "client/file_store.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cohort {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A fresh path per test, so tests do not see each other's files.
std::string TestPath() {
  std::string path =
      ::testing::TempDir() + "/file_store_" +
      ::testing::UnitTest::GetInstance()->current_test_info()->name();
  ::unlink(path.c_str());
  return path;
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

std::unique_ptr<FileStore> MustOpen(const std::string& path,
                                    int num_workers = -1) {
  absl::StatusOr<std::unique_ptr<FileStore>> store =
      FileStore::Open(path, num_workers);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? std::move(*store) : nullptr;
}

// Runs `body` in a child process, which exits with its result.
pid_t Spawn(const std::function<int()>& body) {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(body());
  return pid;
}

int Reap(pid_t pid) {
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(FileStoreTest, SetGetCheckDeleteAndNumKeys) {
  auto store = MustOpen(TestPath());
  ASSERT_TRUE(store->Set("a", "1").ok());
  ASSERT_TRUE(store->Set("a", "2").ok());
  ASSERT_TRUE(store->Set("b", "").ok());
  EXPECT_EQ(*store->Get("a"), "2");
  EXPECT_EQ(*store->Get("b"), "");
  EXPECT_TRUE(*store->Check({"a", "b"}));
  EXPECT_FALSE(*store->Check({"a", "c"}));
  EXPECT_EQ(*store->NumKeys(), 2);
  EXPECT_TRUE(*store->DeleteKey("a"));
  EXPECT_FALSE(*store->DeleteKey("a"));
  EXPECT_EQ(*store->NumKeys(), 1);
  EXPECT_EQ(store->Get("a", absl::Milliseconds(5)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST(FileStoreTest, AddCountsMissingAsZeroAndStoresDecimal) {
  auto store = MustOpen(TestPath());
  EXPECT_EQ(*store->Add("n", 5), 5);
  EXPECT_EQ(*store->Add("n", -7), -2);
  EXPECT_EQ(*store->Get("n"), "-2");
  ASSERT_TRUE(store->Set("text", "abc").ok());
  absl::StatusOr<int64_t> bad = store->Add("text", 1);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(bad.status().message(), HasSubstr("\"abc\""));
  ASSERT_TRUE(store->Set("big", "9223372036854775807").ok());
  EXPECT_EQ(store->Add("big", 1).status().code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(*store->Get("big"), "9223372036854775807");
}

TEST(FileStoreTest, CompareSetFollowsC10dRules) {
  auto store = MustOpen(TestPath());
  // Missing key, non-empty expected: nothing written, returns expected.
  EXPECT_EQ(*store->CompareSet("k", "x", "y"), "x");
  EXPECT_FALSE(*store->Check({"k"}));
  // Missing key, empty expected: writes desired.
  EXPECT_EQ(*store->CompareSet("k", "", "v1"), "v1");
  EXPECT_EQ(*store->Get("k"), "v1");
  // Current equals expected: writes desired.
  EXPECT_EQ(*store->CompareSet("k", "v1", "v2"), "v2");
  EXPECT_EQ(*store->Get("k"), "v2");
  // Mismatch: nothing written, returns the current value.
  EXPECT_EQ(*store->CompareSet("k", "v1", "v3"), "v2");
  EXPECT_EQ(*store->Get("k"), "v2");
}

TEST(FileStoreTest, MultiSetIsOneRevisionAndListKeysIsSorted) {
  auto store = MustOpen(TestPath());
  const int64_t before = store->ListKeys("")->revision;
  ASSERT_TRUE(
      store->MultiSet({"p/b", "p/a", "q", "p/a"}, {"1", "2", "3", "4"}).ok());
  KeyList list = *store->ListKeys("p/");
  EXPECT_THAT(list.keys, ElementsAre("p/a", "p/b"));
  EXPECT_EQ(list.revision, before + 1);
  EXPECT_THAT(*store->MultiGet({"q", "p/a", "p/b"}),
              ElementsAre("3", "4", "1"));
  EXPECT_EQ(store->MultiSet({"x"}, {}).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(store->Append("q", "+").ok());
  ASSERT_TRUE(store->Append("new", "x").ok());
  EXPECT_EQ(*store->Get("q"), "3+");
  EXPECT_EQ(*store->Get("new"), "x");
  EXPECT_EQ(store->ListKeys("")->revision, before + 3);
}

TEST(FileStoreTest, EmptyKeyIsInvalid) {
  auto store = MustOpen(TestPath());
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(store->Set("", "v").code(), kInvalid);
  EXPECT_EQ(store->Get("").status().code(), kInvalid);
  EXPECT_EQ(store->Add("", 1).status().code(), kInvalid);
  EXPECT_EQ(store->CompareSet("", "", "v").status().code(), kInvalid);
  EXPECT_EQ(store->Wait({""}).code(), kInvalid);
  EXPECT_EQ(store->Check({"a", ""}).status().code(), kInvalid);
  EXPECT_EQ(store->DeleteKey("").status().code(), kInvalid);
  EXPECT_EQ(store->MultiGet({""}).status().code(), kInvalid);
  EXPECT_EQ(store->MultiSet({""}, {"v"}).code(), kInvalid);
  EXPECT_EQ(store->Append("", "v").code(), kInvalid);
  EXPECT_EQ(*store->NumKeys(), 0);
}

// The same limits, and texts, as cohortd's (store/kv_store_test.cc's
// LimitsAreEnforcedAndNamed): FileStore once enforced none.
TEST(FileStoreTest, LimitsAreEnforcedAndNamed) {
  FileStoreOptions options;
  options.limits = {
      .max_key_bytes = 8, .max_value_bytes = 16, .max_keys_per_call = 3};
  absl::StatusOr<std::unique_ptr<FileStore>> opened =
      FileStore::Open(TestPath(), options);
  ASSERT_TRUE(opened.ok()) << opened.status();
  FileStore& store = **opened;
  auto expect_invalid = [](const absl::Status& s, absl::string_view text) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(s.message(), text);
  };
  expect_invalid(store.Set("123456789", "v"),
                 "key \"123456789\" is 9 bytes, over the limit of 8 bytes "
                 "(max_key_bytes)");
  expect_invalid(store.Set("k", std::string(17, 'x')),
                 "value is 17 bytes, over the limit of 16 bytes "
                 "(max_value_bytes)");
  expect_invalid(store.CompareSet("k", "", std::string(17, 'x')).status(),
                 "value is 17 bytes, over the limit of 16 bytes "
                 "(max_value_bytes)");
  expect_invalid(store.Check({"a", "b", "c", "d"}).status(),
                 "request names 4 keys, over the limit of 3 "
                 "(max_keys_per_call)");
  expect_invalid(store.Wait({"a", "b", "c", "d"}),
                 "request names 4 keys, over the limit of 3 "
                 "(max_keys_per_call)");
  expect_invalid(store.MultiSet({"a", "b"}, {"1", std::string(17, 'x')}),
                 "key \"b\": value is 17 bytes, over the limit of 16 bytes "
                 "(max_value_bytes)");
  EXPECT_THAT(store.ListKeys("123456789").status().message(),
              HasSubstr("(max_key_bytes)"));
  ASSERT_TRUE(store.Set("k", std::string(16, 'x')).ok());
  expect_invalid(store.Append("k", "y"),
                 "append to key \"k\": value is 17 bytes, over the limit of "
                 "16 bytes (max_value_bytes)");
  EXPECT_EQ(*store.Get("k"), std::string(16, 'x'));
  EXPECT_EQ(*store.NumKeys(), 1);

  // The defaults are cohortd's.
  auto defaults = MustOpen(TestPath() + "_defaults");
  EXPECT_TRUE(defaults->Set(std::string(4096, 'k'), "v").ok());
  EXPECT_EQ(defaults->Set(std::string(4097, 'k'), "v").code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(FileStoreTest, WaitTimeoutNamesMissingKeys) {
  auto store = MustOpen(TestPath());
  ASSERT_TRUE(store->Set("c", "1").ok());
  absl::Status s = store->Wait({"a", "b", "c"}, absl::Milliseconds(50));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(s.message(),
            "timed out after 50ms waiting for 2 of 3 keys; missing: \"a\", "
            "\"b\"");
  EXPECT_TRUE(store->Wait({"c"}, absl::Milliseconds(50)).ok());
}

TEST(FileStoreTest, KeysAndValuesAreBinarySafe) {
  const std::string path = TestPath();
  const std::string key("k\0\xff\n", 4);
  std::string value;
  for (int i = 0; i < 256; ++i) value.push_back(static_cast<char>(i));
  {
    auto store = MustOpen(path);
    ASSERT_TRUE(store->Set(key, value).ok());
    EXPECT_EQ(*store->Get(key), value);
  }
  auto reopened = MustOpen(path);
  EXPECT_EQ(*reopened->Get(key), value);
  EXPECT_THAT(reopened->ListKeys("k")->keys, ElementsAre(key));
}

TEST(FileStoreTest, ReopenSeesPreviousData) {
  const std::string path = TestPath();
  {
    auto store = MustOpen(path);
    ASSERT_TRUE(store->Set("a", "1").ok());
    ASSERT_EQ(*store->Add("n", 3), 3);
    ASSERT_TRUE(*store->DeleteKey("a"));
  }
  ASSERT_TRUE(Exists(path));
  auto store = MustOpen(path);
  EXPECT_FALSE(*store->Check({"a"}));
  EXPECT_EQ(*store->Add("n", 1), 4);
  EXPECT_EQ(store->ListKeys("")->revision, 4);
}

TEST(FileStoreTest, StoresInOneProcessShareTheFile) {
  const std::string path = TestPath();
  auto a = MustOpen(path);
  auto b = MustOpen(path);
  std::thread waiter([&] { EXPECT_EQ(*b->Get("k", absl::Seconds(5)), "v"); });
  absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(a->Set("k", "v").ok());
  waiter.join();
  std::vector<std::thread> adders;
  for (FileStore* store : {a.get(), b.get(), a.get(), b.get()}) {
    adders.emplace_back([store] {
      for (int i = 0; i < 200; ++i) ASSERT_TRUE(store->Add("n", 1).ok());
    });
  }
  for (std::thread& t : adders) t.join();
  EXPECT_EQ(*a->Get("n"), "800");
}

TEST(FileStoreTest, WatchDeliversChangesInOrder) {
  const std::string path = TestPath();
  auto store = MustOpen(path);
  auto other = MustOpen(path);
  ASSERT_TRUE(store->Set("w/old", "0").ok());
  absl::Mutex mu;
  std::vector<WatchEvent> events;
  auto watch = store->Watch("w/", 0, [&](const WatchEvent& e) {
    absl::MutexLock lock(&mu);
    events.push_back(e);
  });
  ASSERT_TRUE(watch.ok()) << watch.status();
  const int64_t start = store->ListKeys("")->revision;
  ASSERT_TRUE(other->Set("w/a", "1").ok());
  ASSERT_TRUE(other->Set("elsewhere", "1").ok());
  ASSERT_TRUE(other->MultiSet({"w/b", "w/c"}, {"2", "3"}).ok());
  ASSERT_TRUE(*store->DeleteKey("w/a"));
  {
    absl::MutexLock lock(&mu);
    auto four = [&events] { return events.size() >= 4; };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&four), absl::Seconds(5)));
    ASSERT_EQ(events.size(), 4u);
    EXPECT_EQ(events[0].key, "w/a");
    EXPECT_EQ(events[0].value, "1");
    EXPECT_EQ(events[0].revision, start + 1);
    EXPECT_EQ(events[1].key, "w/b");
    EXPECT_EQ(events[2].key, "w/c");
    EXPECT_EQ(events[1].revision, start + 3);
    EXPECT_EQ(events[2].revision, start + 3);
    EXPECT_EQ(events[3].type, WatchEvent::Type::kDelete);
    EXPECT_EQ(events[3].key, "w/a");
    EXPECT_EQ(events[3].revision, start + 4);
  }
  (*watch)->Cancel();
  EXPECT_TRUE((*watch)->Wait().ok());
}

TEST(FileStoreTest, WatchReplaysFromARevision) {
  auto store = MustOpen(TestPath());
  ASSERT_TRUE(store->Set("a", "1").ok());
  ASSERT_TRUE(store->Set("b", "2").ok());
  ASSERT_TRUE(store->Set("a", "3").ok());
  absl::Mutex mu;
  std::vector<std::pair<std::string, int64_t>> seen;
  auto watch = store->Watch("a", 2, [&](const WatchEvent& e) {
    absl::MutexLock lock(&mu);
    seen.emplace_back(e.value, e.revision);
  });
  ASSERT_TRUE(watch.ok());
  ASSERT_TRUE(store->Set("a", "4").ok());
  absl::MutexLock lock(&mu);
  auto two = [&seen] { return seen.size() >= 2; };
  ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&two), absl::Seconds(5)));
  EXPECT_THAT(seen,
              ElementsAre(std::make_pair("3", 3), std::make_pair("4", 4)));
}

TEST(FileStoreTest, RejectsFilesItDidNotWrite) {
  const std::string path = TestPath();
  std::ofstream(path) << "hello, this is not a store\n";
  absl::StatusOr<std::unique_ptr<FileStore>> store = FileStore::Open(path);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(store.status().message(), HasSubstr(path));
  const std::string nowhere = ::testing::TempDir() + "/no/such/dir/store";
  store = FileStore::Open(nowhere);
  EXPECT_EQ(store.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(store.status().message(), HasSubstr(nowhere));
  store = FileStore::Open("/dev/null");
  EXPECT_EQ(store.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(store.status().message(), HasSubstr("not a regular file"));
}

TEST(FileStoreTest, AdoptsAnEmptyFileOrAHalfWrittenHeader) {
  const std::string path = TestPath();
  std::ofstream(path) << "";
  ASSERT_TRUE(MustOpen(path)->Set("a", "1").ok());
  // A creator that died while writing the header left a prefix of it.
  std::ofstream(path) << "cohort File";
  auto store = MustOpen(path);
  EXPECT_EQ(*store->NumKeys(), 0);
  ASSERT_TRUE(store->Set("b", "2").ok());
  EXPECT_EQ(*MustOpen(path)->Get("b"), "2");
}

TEST(FileStoreTest, IgnoresAndCutsOffATornRecord) {
  const std::string path = TestPath();
  {
    auto store = MustOpen(path);
    ASSERT_TRUE(store->Set("a", "1").ok());
  }
  // A writer that died mid-record: the length says 100 bytes, 3 follow.
  std::ofstream(path, std::ios::app) << std::string("\x64\0\0\0Bxy", 7);
  auto store = MustOpen(path);
  EXPECT_EQ(*store->Get("a"), "1");
  ASSERT_TRUE(store->Set("b", "2").ok());
  auto again = MustOpen(path);
  EXPECT_THAT(again->ListKeys("")->keys, ElementsAre("a", "b"));
}

TEST(FileStoreTest, LastOfNumWorkersRemovesTheFile) {
  const std::string path = TestPath();
  auto a = MustOpen(path, 2);
  MustOpen(path, 2).reset();  // One closed, one open: the file stays.
  EXPECT_TRUE(Exists(path));
  a.reset();
  EXPECT_FALSE(Exists(path));
  MustOpen(path).reset();  // num_workers = -1 never removes it.
  EXPECT_TRUE(Exists(path));
}

TEST(FileStoreTest, GetBlocksUntilAnotherProcessSets) {
  const std::string path = TestPath();
  pid_t child = Spawn([&path] {
    auto store = FileStore::Open(path);
    if (!store.ok() || !(*store)->Set("child/ready", "1").ok()) return 2;
    absl::StatusOr<std::string> v =
        (*store)->Get("from/parent", absl::Seconds(10));
    return v.ok() && *v == "hello" ? 0 : 1;
  });
  auto store = MustOpen(path);
  ASSERT_TRUE(store->Wait({"child/ready"}, absl::Seconds(10)).ok());
  absl::SleepFor(absl::Milliseconds(50));  // The child is blocked in Get.
  ASSERT_TRUE(store->Set("from/parent", "hello").ok());
  EXPECT_EQ(Reap(child), 0);
}

TEST(FileStoreTest, WatchSeesAnotherProcessAndCanCancelItself) {
  const std::string path = TestPath();
  auto store = MustOpen(path);
  absl::Mutex mu;
  std::vector<std::string> values;
  std::unique_ptr<WatchHandle> handle;
  auto watch = store->Watch("k", 0, [&](const WatchEvent& e) {
    absl::MutexLock lock(&mu);
    values.push_back(e.value);
    if (values.size() == 2) handle->Cancel();
  });
  ASSERT_TRUE(watch.ok());
  {
    absl::MutexLock lock(&mu);
    handle = std::move(*watch);
  }
  pid_t child = Spawn([&path] {
    auto store = FileStore::Open(path);
    if (!store.ok()) return 2;
    for (const char* v : {"1", "2", "3"}) {
      if (!(*store)->Set("k", v).ok()) return 1;
    }
    return 0;
  });
  EXPECT_EQ(Reap(child), 0);
  EXPECT_TRUE(handle->Wait().ok());  // Ends once the callback cancels it.
  absl::MutexLock lock(&mu);
  EXPECT_THAT(values, ElementsAre("1", "2"));
}

TEST(FileStoreTest, AddsFromFourProcessesAreAtomic) {
  const std::string path = TestPath();
  constexpr int kProcs = 4, kAdds = 500;
  // The parent is a fifth worker, so the file outlives the children.
  auto store = MustOpen(path, kProcs + 1);
  std::vector<pid_t> children;
  for (int p = 0; p < kProcs; ++p) {
    children.push_back(Spawn([&path] {
      auto store = FileStore::Open(path, kProcs + 1);
      if (!store.ok()) return 2;
      for (int i = 0; i < kAdds; ++i) {
        if (!(*store)->Add("total", 1).ok()) return 1;
      }
      return (*store)->Add("done", 1).ok() ? 0 : 1;
    }));
  }
  for (pid_t child : children) EXPECT_EQ(Reap(child), 0);
  EXPECT_EQ(*store->Get("total"), absl::StrCat(kProcs * kAdds));
  EXPECT_EQ(*store->Get("done"), absl::StrCat(kProcs));
  EXPECT_TRUE(Exists(path));
  store.reset();  // The fifth close removes the file.
  EXPECT_FALSE(Exists(path));
}

}  // namespace
}  // namespace cohort
