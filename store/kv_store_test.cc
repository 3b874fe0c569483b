#include "store/kv_store.h"

#include <atomic>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "base/deadline_timer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cohort::store {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Runs the same semantics tests on every engine.
class KvStoreTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { store_ = Open(StoreLimits{}); }

  std::unique_ptr<KvStore> Open(StoreLimits limits) {
    store_.reset();
    return std::make_unique<KvStore>(NewEngine(), limits);
  }

  // A new engine of the kind under test.
  std::unique_ptr<KvEngine> NewEngine() {
    if (GetParam() == "memory") return NewMemoryEngine();
    dir_ = std::filesystem::path(testing::TempDir()) /
           absl::StrCat("kv_store_test_", getpid(), "_", counter_++);
    std::filesystem::remove_all(dir_);
    auto engine = OpenRocksDbEngine({.path = dir_.string()});
    EXPECT_TRUE(engine.ok()) << engine.status();
    return std::move(*engine);
  }

  // The blocking Get/MultiGet/Wait a client sees.
  absl::StatusOr<ReadResult> Read(std::vector<std::string> keys,
                                  absl::Duration timeout = absl::Seconds(10),
                                  bool read_values = true) {
    absl::Notification done;
    absl::StatusOr<ReadResult> result;
    store_->WaitForKeys(std::move(keys), read_values, timeout,
                        [&](absl::StatusOr<ReadResult> r) {
                          result = std::move(r);
                          done.Notify();
                        });
    done.WaitForNotification();
    return result;
  }

  absl::StatusOr<std::string> Get(const std::string& key,
                                  absl::Duration timeout = absl::Seconds(10)) {
    absl::StatusOr<ReadResult> r = Read({key}, timeout);
    if (!r.ok()) return r.status();
    return r->values.at(0);
  }

  std::unique_ptr<KvStore> store_;
  std::filesystem::path dir_;
  int counter_ = 0;
};

TEST_P(KvStoreTest, SetThenGet) {
  ASSERT_TRUE(store_->Set("k", "v1").ok());
  EXPECT_EQ(*Get("k"), "v1");
  ASSERT_TRUE(store_->Set("k", "v2").ok());
  EXPECT_EQ(*Get("k"), "v2");
  ASSERT_TRUE(store_->Set("empty", "").ok());
  EXPECT_EQ(*Get("empty"), "");
}

TEST_P(KvStoreTest, StatsCountKeysWaitersAndWatches) {
  ASSERT_TRUE(store_->Set("a", "1").ok());
  StoreStats stats = store_->stats();
  EXPECT_EQ(stats.keys, 1);
  EXPECT_EQ(stats.revision, 1);
  EXPECT_EQ(stats.waiters, 0u);
  EXPECT_EQ(stats.watches, 0u);
  KvStore::WaitId wait = store_->WaitForKeys(
      {"missing"}, false, absl::Seconds(10), [](absl::StatusOr<ReadResult>) {});
  auto watch = store_->Watch("", 0, [](std::vector<Event>) {},
                             [](absl::Status) {});
  ASSERT_TRUE(watch.ok());
  stats = store_->stats();
  EXPECT_EQ(stats.waiters, 1u);
  EXPECT_EQ(stats.watches, 1u);
  store_->CancelWait(wait);
  store_->CancelWatch(watch->id);
  stats = store_->stats();
  EXPECT_EQ(stats.waiters, 0u);
  EXPECT_EQ(stats.watches, 0u);
  EXPECT_EQ(stats.disk_bytes > 0, GetParam() == "rocksdb");
}

TEST_P(KvStoreTest, BinaryKeysAndValues) {
  const std::string key("a\0b\xff", 4), value("\0\1\2", 3);
  ASSERT_TRUE(store_->Set(key, value).ok());
  EXPECT_EQ(*Get(key), value);
}

TEST_P(KvStoreTest, EveryMutationAdvancesTheRevision) {
  const int64_t r0 = store_->revision();
  EXPECT_EQ(*store_->Set("a", "1"), r0 + 1);
  EXPECT_EQ(store_->Add("n", 2)->revision, r0 + 2);
  EXPECT_EQ(store_->CompareSet("a", "1", "2")->revision, r0 + 3);
  EXPECT_EQ(*store_->Append("a", "x"), r0 + 4);
  EXPECT_EQ(*store_->MultiSet({"b", "c"}, {"1", "2"}), r0 + 5);
  EXPECT_EQ(store_->Delete("b")->revision, r0 + 6);
  // Calls that change nothing report the current revision.
  EXPECT_EQ(store_->CompareSet("a", "nope", "3")->revision, r0 + 6);
  EXPECT_EQ(store_->Delete("missing")->revision, r0 + 6);
  EXPECT_EQ(store_->revision(), r0 + 6);
}

TEST_P(KvStoreTest, AddCountsFromZeroAndStoresDecimal) {
  EXPECT_EQ(store_->Add("n", 5)->value, 5);
  EXPECT_EQ(store_->Add("n", 2)->value, 7);
  EXPECT_EQ(*Get("n"), "7");
  EXPECT_EQ(store_->Add("n", -10)->value, -3);
  EXPECT_EQ(*Get("n"), "-3");
  EXPECT_EQ(store_->Add("n", 0)->value, -3);
  ASSERT_TRUE(store_->Set("m", "40").ok());
  EXPECT_EQ(store_->Add("m", 2)->value, 42);
}

TEST_P(KvStoreTest, AddOnNonIntegerIsAClearError) {
  ASSERT_TRUE(store_->Set("s", "hello").ok());
  absl::StatusOr<AddResult> r = store_->Add("s", 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("not a decimal int64"));
  EXPECT_THAT(r.status().message(), HasSubstr("\"s\""));
  EXPECT_EQ(*Get("s"), "hello");
}

TEST_P(KvStoreTest, AddOverflowIsOutOfRange) {
  ASSERT_TRUE(store_->Add("n", INT64_MAX).ok());
  EXPECT_EQ(store_->Add("n", 1).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(*Get("n"), absl::StrCat(INT64_MAX));
}

TEST_P(KvStoreTest, CompareSetFollowsC10dTable) {
  // Missing key, empty expected: writes desired and returns it.
  auto r = store_->CompareSet("a", "", "first");
  EXPECT_EQ(r->value, "first");
  EXPECT_TRUE(r->swapped);
  EXPECT_EQ(*Get("a"), "first");

  // Missing key, non-empty expected: writes nothing, returns expected.
  r = store_->CompareSet("b", "guess", "x");
  EXPECT_EQ(r->value, "guess");
  EXPECT_FALSE(r->swapped);
  EXPECT_FALSE(store_->Check({"b"})->all_exist);

  // Current == expected: writes desired, returns it.
  r = store_->CompareSet("a", "first", "second");
  EXPECT_EQ(r->value, "second");
  EXPECT_TRUE(r->swapped);
  EXPECT_EQ(*Get("a"), "second");

  // Otherwise: writes nothing, returns the current value.
  r = store_->CompareSet("a", "stale", "third");
  EXPECT_EQ(r->value, "second");
  EXPECT_FALSE(r->swapped);
  EXPECT_EQ(*Get("a"), "second");

  // An existing empty value matches an empty expected.
  ASSERT_TRUE(store_->Set("e", "").ok());
  r = store_->CompareSet("e", "", "filled");
  EXPECT_TRUE(r->swapped);
  EXPECT_EQ(*Get("e"), "filled");
}

TEST_P(KvStoreTest, ApplyBatchIsOneCommitWhereEachChangeSeesTheOnesBefore) {
  ASSERT_TRUE(store_->Set("text", "not a number").ok());
  ASSERT_TRUE(store_->Set("gone", "x").ok());
  const int64_t before = store_->revision();
  absl::Notification woken;
  store_->WaitForKeys({"n", "c"}, false, absl::Seconds(10),
                      [&](absl::StatusOr<ReadResult> r) {
                        EXPECT_TRUE(r.ok()) << r.status();
                        woken.Notify();
                      });
  using K = Change::Kind;
  std::vector<Change> changes = {
      {.kind = K::kAdd, .key = "n", .delta = 2},
      {.kind = K::kAdd, .key = "n", .delta = 3},     // sees 2
      {.kind = K::kAdd, .key = "text", .delta = 1},  // fails alone
      {.kind = K::kCompareSet, .key = "c", .value = "v1", .expected = ""},
      {.kind = K::kCompareSet, .key = "c", .value = "v2", .expected = "no"},
      {.kind = K::kAppend, .key = "c", .value = "+"},  // sees v1
      {.kind = K::kDelete, .key = "gone"},
      {.kind = K::kDelete, .key = "gone"},         // already deleted
      {.kind = K::kSet, .key = "", .value = "x"},  // bad key
      {.kind = K::kSet, .key = "s", .value = "set"},
      {.kind = K::kDelete, .key = "s"},  // sees the set
  };
  std::vector<ChangeResult> r = store_->ApplyBatch(changes);
  ASSERT_EQ(r.size(), changes.size());
  EXPECT_EQ(r[0].number, 2);
  EXPECT_EQ(r[1].number, 5);
  EXPECT_EQ(r[2].status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(r[3].value, "v1");
  EXPECT_EQ(r[4].value, "v1");
  EXPECT_TRUE(r[5].status.ok());
  EXPECT_EQ(r[6].number, 1);
  EXPECT_EQ(r[7].number, 0);
  EXPECT_EQ(r[8].status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r[10].number, 1);
  // One revision for the whole batch.
  EXPECT_EQ(store_->revision(), before + 1);
  for (const ChangeResult& c : r) EXPECT_EQ(c.revision, before + 1);
  EXPECT_TRUE(woken.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(*Get("n"), "5");
  EXPECT_EQ(*Get("c"), "v1+");
  EXPECT_EQ(*store_->TryGet("text"),
            std::optional<std::string>("not a number"));
  EXPECT_EQ(*store_->TryGet("gone"), std::nullopt);
  EXPECT_EQ(*store_->TryGet("s"), std::nullopt);
  // A batch that writes nothing makes no revision.
  r = store_->ApplyBatch({{.kind = K::kDelete, .key = "absent"}});
  EXPECT_EQ(r[0].number, 0);
  EXPECT_EQ(store_->revision(), before + 1);
}

TEST_P(KvStoreTest, CheckDeleteAndNumKeys) {
  EXPECT_EQ(store_->NumKeys()->num_keys, 0);
  ASSERT_TRUE(store_->Set("a", "1").ok());
  ASSERT_TRUE(store_->Set("b", "2").ok());
  ASSERT_TRUE(store_->Set("a", "3").ok());
  EXPECT_EQ(store_->NumKeys()->num_keys, 2);
  EXPECT_TRUE(store_->Check({"a", "b"})->all_exist);
  EXPECT_FALSE(store_->Check({"a", "c"})->all_exist);
  EXPECT_TRUE(store_->Check({})->all_exist);

  EXPECT_TRUE(store_->Delete("a")->deleted);
  EXPECT_FALSE(store_->Delete("a")->deleted);
  EXPECT_FALSE(store_->Check({"a"})->all_exist);
  EXPECT_EQ(store_->NumKeys()->num_keys, 1);
}

// Counting under a prefix visits only the prefix's keys, and sees deletes
// and keys that merely share bytes with it (the TCPStore listener's
// namespaces count their keys this way).
TEST_P(KvStoreTest, NumKeysUnderAPrefix) {
  for (const char* key : {"/job/a/x", "/job/a/y", "/job/a/y/z", "/job/ab",
                          "/job/b/x", "/job/a"}) {
    ASSERT_TRUE(store_->Set(key, "v").ok());
  }
  EXPECT_EQ(store_->NumKeys("/job/a/")->num_keys, 3);
  EXPECT_EQ(store_->NumKeys("/job/a")->num_keys, 5);
  EXPECT_EQ(store_->NumKeys("/job/")->num_keys, 6);
  EXPECT_EQ(store_->NumKeys("/job/c/")->num_keys, 0);
  EXPECT_EQ(store_->NumKeys("")->num_keys, 6);
  ASSERT_TRUE(store_->Delete("/job/a/y").ok());
  EXPECT_EQ(store_->NumKeys("/job/a/")->num_keys, 2);
  EXPECT_EQ(store_->NumKeys(std::string(5000, 'p')).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(KvStoreTest, MultiSetIsOneRevisionAndMultiGetReadsInOrder) {
  const int64_t before = store_->revision();
  ASSERT_TRUE(
      store_->MultiSet({"x", "y", "z", "x"}, {"1", "2", "3", "4"}).ok());
  EXPECT_EQ(store_->revision(), before + 1);
  EXPECT_EQ(store_->NumKeys()->num_keys, 3);
  absl::StatusOr<ReadResult> r = Read({"z", "x", "y"});
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(r->values, ElementsAre("3", "4", "2"));

  EXPECT_EQ(store_->MultiSet({"a"}, {"1", "2"}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(KvStoreTest, AppendConcatenates) {
  ASSERT_TRUE(store_->Append("log", "ab").ok());
  ASSERT_TRUE(store_->Append("log", "cd").ok());
  EXPECT_EQ(*Get("log"), "abcd");
}

TEST_P(KvStoreTest, ListKeysPagesThroughAPrefix) {
  for (int i = 0; i < 25; ++i) {
    ASSERT_TRUE(store_->Set(absl::StrCat("job/", 100 + i), "v").ok());
  }
  ASSERT_TRUE(store_->Set("jo", "outside").ok());
  ASSERT_TRUE(store_->Set("jobz", "outside").ok());
  ASSERT_TRUE(store_->Set("k", "outside").ok());

  std::vector<std::string> all;
  std::string token;
  int pages = 0;
  do {
    absl::StatusOr<ListResult> page = store_->ListKeys("job/", 10, token);
    ASSERT_TRUE(page.ok()) << page.status();
    all.insert(all.end(), page->keys.begin(), page->keys.end());
    token = page->next_page_token;
    ++pages;
  } while (!token.empty());
  EXPECT_EQ(pages, 3);
  ASSERT_EQ(all.size(), 25u);
  EXPECT_EQ(all.front(), "job/100");
  EXPECT_EQ(all.back(), "job/124");
  EXPECT_TRUE(std::is_sorted(all.begin(), all.end()));

  EXPECT_EQ(store_->ListKeys("", 0, "")->keys.size(), 28u);
  EXPECT_EQ(store_->ListKeys("job/", 0, "other").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->ListKeys("job/", 1 << 20, "").status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Found by kv_store_fuzz: a page token equal to the prefix listed the prefix
// key again, so pages of one key under "a" = {"a", "ab"} looped forever.
TEST_P(KvStoreTest, ListKeysPagesPastAKeyEqualToThePrefix) {
  ASSERT_TRUE(store_->Set("a", "1").ok());
  ASSERT_TRUE(store_->Set("ab", "2").ok());
  std::vector<std::string> listed;
  std::string token;
  for (int page = 0; page < 5; ++page) {
    absl::StatusOr<ListResult> r = store_->ListKeys("a", 1, token);
    ASSERT_TRUE(r.ok()) << r.status();
    listed.insert(listed.end(), r->keys.begin(), r->keys.end());
    token = r->next_page_token;
    if (token.empty()) break;
  }
  EXPECT_THAT(listed, ElementsAre("a", "ab"));
}

TEST_P(KvStoreTest, BlockedGetIsReleasedBySetFromAnotherThread) {
  absl::Notification done;
  absl::StatusOr<ReadResult> result;
  store_->WaitForKeys({"later"}, true, absl::Seconds(10),
                      [&](absl::StatusOr<ReadResult> r) {
                        result = std::move(r);
                        done.Notify();
                      });
  EXPECT_FALSE(done.HasBeenNotified());
  std::thread writer([&] { ASSERT_TRUE(store_->Set("later", "here").ok()); });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  writer.join();
  ASSERT_TRUE(result.ok());
  EXPECT_THAT(result->values, ElementsAre("here"));
}

TEST_P(KvStoreTest, WaitTimeoutNamesTheMissingKeys) {
  ASSERT_TRUE(store_->Set("present", "1").ok());
  absl::StatusOr<ReadResult> r =
      Read({"present", "absent1", "absent2"}, absl::Milliseconds(50));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(r.status().message(), HasSubstr("2 of 3 keys"));
  EXPECT_THAT(r.status().message(), HasSubstr("\"absent1\""));
  EXPECT_THAT(r.status().message(), HasSubstr("\"absent2\""));
  EXPECT_THAT(r.status().message(), ::testing::Not(HasSubstr("\"present\"")));
}

TEST_P(KvStoreTest, WaitOnExistingKeysReturnsAtOnce) {
  ASSERT_TRUE(store_->MultiSet({"a", "b"}, {"1", "2"}).ok());
  EXPECT_TRUE(Read({"a", "b"}, absl::Milliseconds(1), false).ok());
  EXPECT_TRUE(Read({}, absl::Milliseconds(1), false).ok());
}

TEST_P(KvStoreTest, WaitSeesAllKeysPresentTogether) {
  absl::Notification done;
  store_->WaitForKeys({"a", "b"}, false, absl::Seconds(10),
                      [&](absl::StatusOr<ReadResult>) { done.Notify(); });
  ASSERT_TRUE(store_->Set("a", "1").ok());
  ASSERT_TRUE(store_->Delete("a").ok());
  ASSERT_TRUE(store_->Set("b", "1").ok());
  // "a" came and went: the waiter must still be waiting for it.
  EXPECT_FALSE(done.WaitForNotificationWithTimeout(absl::Milliseconds(30)));
  ASSERT_TRUE(store_->Set("a", "2").ok());
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
}

TEST_P(KvStoreTest, CancelledWaitNeverCompletes) {
  std::atomic<bool> called{false};
  KvStore::WaitId id =
      store_->WaitForKeys({"k"}, true, absl::Milliseconds(30),
                          [&](absl::StatusOr<ReadResult>) { called = true; });
  ASSERT_NE(id, 0u);
  store_->CancelWait(id);
  // A set completes a wait on this thread, before it returns.
  ASSERT_TRUE(store_->Set("k", "v").ok());
  // The wait's timeout would run on the thread every DeadlineTimer shares,
  // in deadline order: once a later deadline's callback has run, so would
  // it have.
  base::DeadlineTimer timer;
  absl::Notification later;
  timer.Schedule(absl::Now() + absl::Milliseconds(60), [&] { later.Notify(); });
  later.WaitForNotification();
  EXPECT_FALSE(called);
}

TEST_P(KvStoreTest, ShutdownEndsWaitersAndWatchers) {
  absl::Notification waited, closed;
  absl::Status wait_status, close_status;
  store_->WaitForKeys({"never"}, true, absl::Seconds(60),
                      [&](absl::StatusOr<ReadResult> r) {
                        wait_status = r.status();
                        waited.Notify();
                      });
  ASSERT_TRUE(store_
                  ->Watch(
                      "", 0, [](std::vector<Event>) {},
                      [&](absl::Status s) {
                        close_status = s;
                        closed.Notify();
                      })
                  .ok());
  store_->Shutdown(absl::UnavailableError("draining"));
  ASSERT_TRUE(waited.HasBeenNotified());
  ASSERT_TRUE(closed.HasBeenNotified());
  EXPECT_EQ(wait_status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(close_status.code(), absl::StatusCode::kUnavailable);
  // New blocking calls fail at once; plain ones still work.
  EXPECT_EQ(Read({"never"}).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(store_->Set("k", "v").ok());
}

TEST_P(KvStoreTest, EightThreadsAddExactly) {
  constexpr int kThreads = 8, kAdds = 1000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kAdds; ++i) ASSERT_TRUE(store_->Add("n", 1).ok());
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(*Get("n"), absl::StrCat(kThreads * kAdds));
}

TEST_P(KvStoreTest, LimitsAreEnforcedAndNamed) {
  store_ =
      Open({.max_key_bytes = 8, .max_value_bytes = 16, .max_keys_per_call = 3});
  auto expect_invalid = [](absl::Status s, absl::string_view needle) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(needle));
  };
  expect_invalid(store_->Set("", "v").status(), "must not be empty");
  expect_invalid(store_->Set("123456789", "v").status(), "max_key_bytes");
  expect_invalid(store_->Set("k", std::string(17, 'x')).status(),
                 "max_value_bytes");
  expect_invalid(store_->Check({"a", "b", "c", "d"}).status(),
                 "max_keys_per_call");
  expect_invalid(store_->Add("", 1).status(), "must not be empty");
  expect_invalid(Read({"a", ""}).status(), "must not be empty");
  ASSERT_TRUE(store_->Set("k", std::string(16, 'x')).ok());
  expect_invalid(store_->Append("k", "y").status(), "max_value_bytes");
  EXPECT_EQ(*Get("k"), std::string(16, 'x'));
}

TEST_P(KvStoreTest, WatchStreamsMatchingChangesInOrder) {
  absl::Mutex mu;
  std::vector<Event> seen;
  auto start = store_->Watch(
      "job/", 0,
      [&](std::vector<Event> events) {
        absl::MutexLock l(&mu);
        for (auto& e : events) seen.push_back(std::move(e));
      },
      [](absl::Status) {});
  ASSERT_TRUE(start.ok());
  EXPECT_EQ(start->start_revision, store_->revision() + 1);
  ASSERT_TRUE(store_->Set("job/a", "1").ok());
  ASSERT_TRUE(store_->Set("other", "x").ok());
  ASSERT_TRUE(store_->Add("job/n", 3).ok());
  ASSERT_TRUE(store_->Delete("job/a").ok());
  store_->CancelWatch(start->id);
  ASSERT_TRUE(store_->Set("job/late", "unseen").ok());

  absl::MutexLock l(&mu);
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[0].key, "job/a");
  EXPECT_EQ(*seen[0].value, "1");
  EXPECT_EQ(seen[1].key, "job/n");
  EXPECT_EQ(*seen[1].value, "3");
  EXPECT_EQ(seen[2].type, Event::Type::kDelete);
  EXPECT_LT(seen[0].revision, seen[1].revision);
  EXPECT_LT(seen[1].revision, seen[2].revision);
}

TEST_P(KvStoreTest, WatchResumesFromARevision) {
  ASSERT_TRUE(store_->Set("a", "1").ok());
  const int64_t from = *store_->Set("a", "2");
  ASSERT_TRUE(store_->Set("a", "3").ok());
  std::vector<std::string> values;
  auto start = store_->Watch(
      "a", from,
      [&](std::vector<Event> events) {
        for (auto& e : events) values.push_back(*e.value);
      },
      [](absl::Status) {});
  ASSERT_TRUE(start.ok());
  ASSERT_TRUE(store_->Set("a", "4").ok());
  EXPECT_THAT(values, ElementsAre("2", "3", "4"));
}

// A watch from a revision not reached yet once got every change after now.
TEST_P(KvStoreTest, WatchFromAFutureRevisionStartsThere) {
  const int64_t now = *store_->Set("a", "1");
  std::vector<int64_t> revisions;
  auto start = store_->Watch(
      "", now + 3,
      [&](std::vector<Event> events) {
        for (auto& e : events) revisions.push_back(e.revision);
      },
      [](absl::Status) {});
  ASSERT_TRUE(start.ok());
  EXPECT_EQ(start->start_revision, now + 3);
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(store_->Set("a", "x").ok());
  EXPECT_THAT(revisions, ElementsAre(now + 3, now + 4));
  auto far = store_->Watch(
      "", int64_t{1} << 62, [&](std::vector<Event>) { ADD_FAILURE(); },
      [](absl::Status) {});
  ASSERT_TRUE(far.ok());
  ASSERT_TRUE(store_->Set("a", "y").ok());
}

// Forwards every call to `engine`, and tells `observe` which call it is
// ("Contains", "Get", ...) and about which key (the first, for several).
class ObservedEngine final : public KvEngine {
 public:
  using Observer =
      std::function<void(absl::string_view call, absl::string_view key)>;
  ObservedEngine(std::unique_ptr<KvEngine> engine, Observer observe)
      : engine_(std::move(engine)), observe_(std::move(observe)) {}

  absl::string_view name() const override { return engine_->name(); }
  absl::StatusOr<std::optional<std::string>> Get(
      absl::string_view key) const override {
    observe_("Get", key);
    return engine_->Get(key);
  }
  bool Contains(absl::string_view key) const override {
    observe_("Contains", key);
    return engine_->Contains(key);
  }
  std::unique_ptr<PreparedRead> PrepareRead(
      std::vector<std::string> keys) const override {
    observe_("PrepareRead", keys.empty() ? "" : keys[0]);
    return engine_->PrepareRead(std::move(keys));
  }
  absl::Status Apply(absl::Span<const Mutation> mutations,
                     int64_t revision) override {
    return engine_->Apply(mutations, revision);
  }
  int64_t revision() const override { return engine_->revision(); }
  int64_t NumKeys() const override { return engine_->NumKeys(); }
  absl::StatusOr<int64_t> CountKeys(absl::string_view prefix) const override {
    observe_("CountKeys", prefix);
    return engine_->CountKeys(prefix);
  }
  absl::StatusOr<std::vector<std::string>> ListKeys(
      absl::string_view prefix, absl::string_view start_after,
      size_t limit) const override {
    observe_("ListKeys", prefix);
    return engine_->ListKeys(prefix, start_after, limit);
  }
  absl::Status Flush() override { return engine_->Flush(); }

 private:
  const std::unique_ptr<KvEngine> engine_;
  const Observer observe_;
};

// Existence checks are answered from memory (KvEngine::Contains) and long
// waits are indexed in slices: a 131,072-key wait against a store whose
// 8 MiB values were flushed to disk once read the engine under the lock
// and held it for minutes. Here the wait asks the engine about its keys
// only through Contains, a set made meanwhile completes, and the wait times
// out naming every key. (bench/store_bench --mode=big_wait says how long it
// takes; how soon the set gets the lock is the mutex's choice.)
TEST_P(KvStoreTest, HugeWaitOnlyAsksWhetherKeysExistThenTimesOut) {
  constexpr int kKeys = 131072;
  absl::Mutex mu;
  std::map<std::string, int> calls;  // On the wait's keys, by call.
  absl::Notification indexing;
  store_.reset();
  store_ = std::make_unique<KvStore>(
      std::make_unique<ObservedEngine>(
          NewEngine(),
          [&](absl::string_view call, absl::string_view key) {
            if (!absl::StartsWith(key, "missing/")) return;
            if (key == "missing/0" && !indexing.HasBeenNotified()) {
              indexing.Notify();
            }
            absl::MutexLock lock(&mu);
            ++calls[std::string(call)];
          }),
      StoreLimits{});
  const std::string big(8 << 20, 'v');
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(store_->Set(absl::StrCat("big/", i), big).ok());
  }
  ASSERT_TRUE(store_->Flush().ok());
  std::vector<std::string> keys;
  for (int i = 0; i < kKeys; ++i) keys.push_back(absl::StrCat("missing/", i));
  std::thread setter([&] {
    indexing.WaitForNotification();
    EXPECT_TRUE(store_->Set("s/during", "x").ok());
  });
  absl::StatusOr<ReadResult> r =
      Read(std::move(keys), absl::Seconds(1), /*read_values=*/false);
  setter.join();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(r.status().message(), HasSubstr("131072 of 131072 keys"));
  EXPECT_EQ(*store_->TryGet("s/during"), std::optional<std::string>("x"));
  absl::MutexLock lock(&mu);
  EXPECT_GE(calls["Contains"], kKeys);
  calls.erase("Contains");
  EXPECT_THAT(calls, ::testing::IsEmpty())
      << "the wait read its keys from the engine, which may go to disk";
}

TEST_P(KvStoreTest, WatchFromCompactedRevisionIsOutOfRange) {
  store_ = Open({.history_events = 4});
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(store_->Set("k", "v").ok());
  auto start = store_->Watch(
      "", 1, [](std::vector<Event>) {}, [](absl::Status) {});
  EXPECT_EQ(start.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(start.status().message(), HasSubstr("list the keys"));
  EXPECT_TRUE(store_
                  ->Watch(
                      "", store_->revision() - 2, [](std::vector<Event>) {},
                      [](absl::Status) {})
                  .ok());
}

Share JobShare(const std::string& prefix) {
  return {.name = "token " + prefix,
          .roots = {prefix, "/cohortrun/" + prefix, "runs/" + prefix}};
}

TEST_P(KvStoreTest, SharesBoundKeysAndDeletesAlwaysPass) {
  store_ = Open({.quota_keys = 3});
  ASSERT_TRUE(store_->Set("job1/a", "x").ok());
  ASSERT_TRUE(store_->SetShares({JobShare("job1/")}).ok());
  // The scan counted what was there.
  ASSERT_TRUE(store_->share_usage("token job1/").has_value());
  EXPECT_EQ(store_->share_usage("token job1/")->keys, 1u);
  EXPECT_EQ(store_->share_usage("token job1/")->bytes, 7u);
  ASSERT_TRUE(store_->Set("runs/job1/b", "y").ok());
  ASSERT_TRUE(store_->Set("/cohortrun/job1/c", "z").ok());
  absl::StatusOr<int64_t> over = store_->Set("job1/d", "w");
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(), HasSubstr("token job1/"));
  EXPECT_THAT(over.status().message(), HasSubstr("--quota_keys"));
  EXPECT_THAT(over.status().message(), HasSubstr("hold 3 keys"));
  EXPECT_THAT(over.status().message(), HasSubstr("limit of 3"));
  EXPECT_FALSE(store_->TryGet("job1/d")->has_value());
  EXPECT_EQ(store_->Add("job1/n", 1).status().code(),
            absl::StatusCode::kResourceExhausted);
  // Rewriting a key adds none; other jobs' keys and the sibling job1x/ are
  // not this share's.
  EXPECT_TRUE(store_->Set("job1/a", "v").ok());
  EXPECT_TRUE(store_->Set("job1x/a", "v").ok());
  EXPECT_TRUE(store_->Set("job2/a", "v").ok());
  ASSERT_TRUE(store_->Delete("job1/a").ok());
  EXPECT_EQ(store_->share_usage("token job1/")->keys, 2u);
  EXPECT_TRUE(store_->Set("job1/d", "w").ok());
  EXPECT_EQ(store_->stats().share_refused_keys, 2u);
}

TEST_P(KvStoreTest, SharesBoundBytesForEveryKindOfWrite) {
  // Room for "job1/k" (6 bytes) with a 14-byte value.
  store_ = Open({.quota_bytes = 20});
  ASSERT_TRUE(store_->SetShares({JobShare("job1/")}).ok());
  ASSERT_TRUE(store_->Set("job1/k", "0123456789").ok());
  EXPECT_EQ(store_->share_usage("token job1/")->bytes, 16u);
  absl::StatusOr<int64_t> append = store_->Append("job1/k", "abcde");
  EXPECT_EQ(append.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(append.status().message(), HasSubstr("--quota_bytes"));
  EXPECT_TRUE(store_->Append("job1/k", "abcd").ok());
  EXPECT_EQ(store_->CompareSet("job1/k", "0123456789abcd", "0123456789abcdX")
                .status()
                .code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(*store_->TryGet("job1/k"), "0123456789abcd");
  EXPECT_EQ(store_->MultiSet({"job2/a", "job1/b"}, {"1", "2"}).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(store_->TryGet("job2/a")->has_value()) << "all or nothing";
  // A smaller value passes, and so does a batch's change that fits beside
  // one that does not.
  EXPECT_TRUE(store_->Set("job1/k", "01").ok());
  std::vector<ChangeResult> batch = store_->ApplyBatch(
      {{.kind = Change::Kind::kSet, .key = "job1/big", .value = "0123456789"},
       {.kind = Change::Kind::kSet, .key = "job1/s", .value = "1"}});
  EXPECT_EQ(batch[0].status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(batch[1].status.ok());
  EXPECT_EQ(store_->share_usage("token job1/")->bytes, 8u + 7u);
  EXPECT_EQ(store_->stats().share_refused_bytes, 4u);
}

TEST_P(KvStoreTest, ShareCountSpansSlicesAndSurvivesSetSharesAgain) {
  store_ = Open({.quota_keys = 5000});
  std::vector<std::string> keys, values;
  for (int i = 0; i < 4999; ++i) {
    keys.push_back(absl::StrCat("job1/", i));
    values.push_back("v");
  }
  ASSERT_TRUE(store_->MultiSet(keys, values).ok());
  ASSERT_TRUE(store_->SetShares({JobShare("job1/")}).ok());
  EXPECT_EQ(store_->share_usage("token job1/")->keys, 4999u);
  ASSERT_TRUE(store_->Set("job1/last", "v").ok());
  ASSERT_TRUE(store_->SetShares({JobShare("job2/"), JobShare("job1/")}).ok());
  EXPECT_EQ(store_->share_usage("token job1/")->keys, 5000u);
  EXPECT_FALSE(store_->Set("job1/more", "v").ok());
  // A share no longer set bounds nothing.
  ASSERT_TRUE(store_->SetShares({JobShare("job2/")}).ok());
  EXPECT_FALSE(store_->share_usage("token job1/").has_value());
  EXPECT_TRUE(store_->Set("job1/more", "v").ok());
}

TEST_P(KvStoreTest, ShareCountHoldsAcrossRestarts) {
  if (GetParam() != "rocksdb") GTEST_SKIP() << "memory keeps nothing";
  store_ = Open({.quota_keys = 2});
  ASSERT_TRUE(store_->SetShares({JobShare("job1/")}).ok());
  ASSERT_TRUE(store_->Set("job1/a", "1").ok());
  ASSERT_TRUE(store_->Set("runs/job1/b", "2").ok());
  store_.reset();
  auto engine = OpenRocksDbEngine({.path = dir_.string()});
  ASSERT_TRUE(engine.ok()) << engine.status();
  store_ = std::make_unique<KvStore>(std::move(*engine),
                                     StoreLimits{.quota_keys = 2});
  ASSERT_TRUE(store_->SetShares({JobShare("job1/")}).ok());
  EXPECT_EQ(store_->share_usage("token job1/")->keys, 2u);
  EXPECT_EQ(store_->Set("job1/c", "3").status().code(),
            absl::StatusCode::kResourceExhausted);
}

INSTANTIATE_TEST_SUITE_P(Engines, KvStoreTest,
                         ::testing::Values("memory", "rocksdb"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace cohort::store
