// KvStore's TCPStore queues on every engine: FIFO order, the key layout
// gRPC sees, one wait completed per push, hand-offs, and items kept over a
// reopen of the same RocksDB data dir.
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "store/kv_engine.h"
#include "store/kv_store.h"
#include "store/queue_keys.h"

namespace cohort::store {
namespace {

using ::testing::ElementsAre;

// A wait's outcome, once its callback ran. The callback holds its own
// reference: a wait still pending when the test ends is ended by the
// store's destructor.
class WaitOutcome {
 public:
  KvStore::ReadCallback Callback() {
    return [state = state_](absl::StatusOr<ReadResult> r) {
      absl::MutexLock lock(&state->mu);
      state->status = r.status();
    };
  }
  // Whether the callback ran, and with which status.
  std::optional<absl::Status> status() {
    absl::MutexLock lock(&state_->mu);
    return state_->status;
  }
  // Until the callback ran (callbacks run on the thread of the write that
  // completes the wait, or the timer's).
  absl::Status Await() {
    absl::MutexLock lock(&state_->mu);
    state_->mu.Await(absl::Condition(
        +[](std::optional<absl::Status>* s) { return s->has_value(); },
        &state_->status));
    return *state_->status;
  }

 private:
  struct State {
    absl::Mutex mu;
    std::optional<absl::Status> status ABSL_GUARDED_BY(mu);
  };
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

class KvStoreQueuesTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "rocksdb") {
      // The test's name ends in "/rocksdb".
      dir_ = std::filesystem::path(::testing::TempDir()) /
             absl::StrCat("kv_store_queues_test_", getpid(), "_",
                          absl::StrReplaceAll(::testing::UnitTest::GetInstance()
                                                  ->current_test_info()
                                                  ->name(),
                                              {{"/", "_"}}));
      std::filesystem::remove_all(dir_);
    }
    Reopen();
  }

  // A new store over the engine under test: the same data dir for
  // RocksDB, a fresh engine in memory.
  void Reopen() {
    store_.reset();
    if (GetParam() == "memory") {
      store_ = std::make_unique<KvStore>(NewMemoryEngine());
      return;
    }
    auto engine = OpenRocksDbEngine({.path = dir_.string()});
    ASSERT_TRUE(engine.ok()) << engine.status();
    store_ = std::make_unique<KvStore>(std::move(*engine));
  }

  // Pops `queue` until it is empty; the items, in the order popped.
  std::vector<std::string> Drain(absl::string_view queue) {
    std::vector<std::string> items;
    for (;;) {
      absl::StatusOr<QueuePopResult> r = store_->QueuePop(queue);
      EXPECT_TRUE(r.ok()) << r.status();
      if (!r.ok() || r->length == 0) return items;
      items.push_back(r->value);
    }
  }

  std::unique_ptr<KvStore> store_;
  std::filesystem::path dir_;
};

TEST_P(KvStoreQueuesTest, PushesPopInOrder) {
  EXPECT_EQ(store_->QueueLen("/never").value_or(-1), 0);
  auto empty = store_->QueuePop("/never");
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->length, 0);
  EXPECT_EQ(empty->item_key, "");
  for (const char* item : {"one", "two", "three", ""}) {
    ASSERT_TRUE(store_->QueuePush("/q", item).ok());
  }
  ASSERT_TRUE(store_->QueuePush("/other", "x").ok());
  EXPECT_EQ(store_->QueueLen("/q").value_or(-1), 4);
  auto first = store_->QueuePop("/q");
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->length, 4);  // Before the pop, as QUEUE_POP answers.
  EXPECT_EQ(first->value, "one");
  EXPECT_THAT(Drain("/q"), ElementsAre("two", "three", ""));
  EXPECT_EQ(store_->QueueLen("/q").value_or(-1), 0);
  EXPECT_EQ(store_->QueueLen("/other").value_or(-1), 1);
  const QueueStats stats = store_->queue_stats();
  EXPECT_EQ(stats.queues, 1);
  EXPECT_EQ(stats.items, 1);
  EXPECT_EQ(stats.bytes, 1u);
}

TEST_P(KvStoreQueuesTest, ItemsAreEntriesUnderTheReservedLayout) {
  ASSERT_TRUE(store_->QueuePush("/jobs", "a").ok());
  ASSERT_TRUE(store_->QueuePush("/jobs", "b").ok());
  // A queue whose name starts with the other's: its items stay apart.
  ASSERT_TRUE(store_->QueuePush("/jobs/x", "c").ok());
  ASSERT_TRUE(store_->Set("/jobs", "a key of the same name").ok());
  auto jobs = store_->ListKeys(QueueItemPrefix("/jobs"), 0, "");
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  ASSERT_EQ(jobs->keys.size(), 2u);
  // Byte order is push order, and each value is its item.
  EXPECT_EQ(*store_->TryGet(jobs->keys[0]), std::optional<std::string>("a"));
  EXPECT_EQ(*store_->TryGet(jobs->keys[1]), std::optional<std::string>("b"));
  EXPECT_EQ(ParseQueueItemKey(jobs->keys[0])->queue, "/jobs");
  auto all = store_->ListKeys(kQueuePrefix, 0, "");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->keys.size(), 3u);
  // Queues are not keys to c10d's num_keys.
  EXPECT_EQ(store_->NumKeys()->num_keys, 1);
  EXPECT_EQ(store_->NumKeys("/")->num_keys, 1);
  EXPECT_EQ(store_->NumKeys("/jobs")->num_keys, 1);
  EXPECT_EQ(store_->NumKeys(kQueuePrefix)->num_keys, 0);
  EXPECT_EQ(store_->stats().keys, 4);  // What the engine holds.
  // A pop deletes the item's key (the key named by the pop).
  auto popped = store_->QueuePop("/jobs");
  ASSERT_TRUE(popped.ok());
  EXPECT_EQ(popped->item_key, jobs->keys[0]);
  EXPECT_EQ(*store_->TryGet(jobs->keys[0]), std::nullopt);
  EXPECT_EQ(*store_->TryGet("/jobs"),
            std::optional<std::string>("a key of the same name"));
}

TEST_P(KvStoreQueuesTest, WatchersSeePushesAndPops) {
  std::vector<Event> seen;
  absl::Mutex mu;
  auto watch = store_->Watch(
      kQueuePrefix, 0,
      [&](std::vector<Event> events) {
        absl::MutexLock lock(&mu);
        for (Event& e : events) seen.push_back(std::move(e));
      },
      [](absl::Status) {});
  ASSERT_TRUE(watch.ok());
  ASSERT_TRUE(store_->QueuePush("/q", "v").ok());
  ASSERT_TRUE(store_->QueuePop("/q").ok());
  absl::MutexLock lock(&mu);
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0].type, Event::Type::kPut);
  EXPECT_EQ(*seen[0].value, "v");
  EXPECT_EQ(seen[1].type, Event::Type::kDelete);
  EXPECT_EQ(seen[0].key, seen[1].key);
}

TEST_P(KvStoreQueuesTest, OneBatchPushesAndPopsInOrderAsOneRevision) {
  ASSERT_TRUE(store_->QueuePush("/q", "old").ok());
  const int64_t before = store_->revision();
  using Kind = Change::Kind;
  std::vector<ChangeResult> r = store_->ApplyBatch({
      {.kind = Kind::kQueuePush, .key = "/q", .value = "new1"},
      {.kind = Kind::kQueuePop, .key = "/q"},
      {.kind = Kind::kQueuePush, .key = "/q", .value = "new2"},
      {.kind = Kind::kQueuePop, .key = "/q"},
      {.kind = Kind::kQueuePop, .key = "/q"},
      {.kind = Kind::kQueuePop, .key = "/q"},
  });
  ASSERT_EQ(r.size(), 6u);
  for (const ChangeResult& c : r) {
    EXPECT_TRUE(c.status.ok()) << c.status;
    EXPECT_EQ(c.revision, before + 1);
  }
  EXPECT_EQ(r[1].number, 2);
  EXPECT_EQ(r[1].value, "old");
  EXPECT_EQ(r[3].number, 2);
  EXPECT_EQ(r[3].value, "new1");
  EXPECT_EQ(r[4].number, 1);
  EXPECT_EQ(r[4].value, "new2");
  EXPECT_EQ(r[5].number, 0);
  EXPECT_EQ(store_->QueueLen("/q").value_or(-1), 0);
  EXPECT_EQ(store_->queue_stats().items, 0);
}

TEST_P(KvStoreQueuesTest, BadNamesAndItemsAreRefused) {
  EXPECT_EQ(store_->QueuePush("", "v").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      store_
          ->QueuePush("/q",
                      std::string(store_->limits().max_value_bytes + 1, 'x'))
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->QueueLen("").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->queue_stats().items, 0);
}

TEST_P(KvStoreQueuesTest, APushCompletesOneWaitTheOldest) {
  WaitOutcome first, second;
  store_->WaitForKeysOrQueues({"/q"}, absl::InfiniteDuration(),
                              first.Callback());
  store_->WaitForKeysOrQueues({"/q"}, absl::InfiniteDuration(),
                              second.Callback());
  EXPECT_FALSE(first.status().has_value());
  ASSERT_TRUE(store_->QueuePush("/q", "job1").ok());
  // Completed within the push (a write runs the callbacks it readies
  // before it returns): the oldest wait only.
  ASSERT_TRUE(first.status().has_value());
  EXPECT_TRUE(first.status()->ok());
  EXPECT_FALSE(second.status().has_value());
  // A pop ends nothing; the next push ends the other wait.
  ASSERT_TRUE(store_->QueuePop("/q").ok());
  EXPECT_FALSE(second.status().has_value());
  ASSERT_TRUE(store_->QueuePush("/q", "job2").ok());
  ASSERT_TRUE(second.status().has_value());
  EXPECT_TRUE(second.status()->ok());
  EXPECT_EQ(store_->stats().waiters, 0u);
}

TEST_P(KvStoreQueuesTest, QueuesCountAsPresentOnlyForQueueWaitsAndChecks) {
  ASSERT_TRUE(store_->QueuePush("/q", "v").ok());
  EXPECT_TRUE(store_->CheckKeysOrQueues({"/q"})->all_exist);
  EXPECT_FALSE(store_->Check({"/q"})->all_exist);
  EXPECT_FALSE(store_->CheckKeysOrQueues({"/q", "/k"})->all_exist);
  // A wait on a queue that holds items ends at once, and takes no push's
  // wake-up: the next push still ends the next wait.
  WaitOutcome now, plain, next;
  store_->WaitForKeysOrQueues({"/q"}, absl::InfiniteDuration(), now.Callback());
  ASSERT_TRUE(now.status().has_value());
  // gRPC's waits do not see queues.
  store_->WaitForKeys({"/q"}, false, absl::InfiniteDuration(),
                      plain.Callback());
  ASSERT_TRUE(store_->QueuePop("/q").ok());
  store_->WaitForKeysOrQueues({"/q"}, absl::InfiniteDuration(),
                              next.Callback());
  ASSERT_TRUE(store_->QueuePush("/q", "w").ok());
  ASSERT_TRUE(next.status().has_value());
  EXPECT_FALSE(plain.status().has_value());
  // Setting the key of the same name ends every wait on it, as torch's
  // server's SET does.
  WaitOutcome a, b;
  ASSERT_TRUE(store_->QueuePop("/q").ok());
  store_->WaitForKeysOrQueues({"/q"}, absl::InfiniteDuration(), a.Callback());
  store_->WaitForKeysOrQueues({"/q"}, absl::InfiniteDuration(), b.Callback());
  ASSERT_TRUE(store_->Set("/q", "key").ok());
  EXPECT_TRUE(a.status().has_value());
  EXPECT_TRUE(b.status().has_value());
  EXPECT_TRUE(plain.status().has_value());
}

TEST_P(KvStoreQueuesTest, AWaitThatMissesOtherKeysLetsThePushGoToTheNext) {
  WaitOutcome both, queue_only;
  store_->WaitForKeysOrQueues({"/q", "/k"}, absl::InfiniteDuration(),
                              both.Callback());
  store_->WaitForKeysOrQueues({"/q"}, absl::InfiniteDuration(),
                              queue_only.Callback());
  ASSERT_TRUE(store_->QueuePush("/q", "v").ok());
  EXPECT_FALSE(both.status().has_value());
  ASSERT_TRUE(queue_only.status().has_value());
  ASSERT_TRUE(store_->Set("/k", "v").ok());
  ASSERT_TRUE(both.status().has_value());
  // Had the queue been emptied meanwhile, the first would wait again.
  WaitOutcome again;
  store_->WaitForKeysOrQueues({"/q", "/k2"}, absl::InfiniteDuration(),
                              again.Callback());
  ASSERT_TRUE(store_->QueuePush("/q", "w").ok());
  ASSERT_EQ(store_->QueuePop("/q")->length, 2);
  ASSERT_EQ(store_->QueuePop("/q")->length, 1);
  ASSERT_TRUE(store_->Set("/k2", "v").ok());
  EXPECT_FALSE(again.status().has_value());
  ASSERT_TRUE(store_->QueuePush("/q", "x").ok());
  EXPECT_TRUE(again.status().has_value());
}

TEST_P(KvStoreQueuesTest, AWakeUpNotUsedIsPassedOn) {
  WaitOutcome first, second, third;
  store_->WaitForKeysOrQueues({"/q"}, absl::InfiniteDuration(),
                              first.Callback());
  store_->WaitForKeysOrQueues({"/q"}, absl::InfiniteDuration(),
                              second.Callback());
  ASSERT_TRUE(store_->QueuePush("/q", "job").ok());
  ASSERT_TRUE(first.status().has_value());
  EXPECT_FALSE(second.status().has_value());
  // The first one's client is gone: the item is still queued, and the
  // wake-up goes to the next wait.
  store_->PassQueueWakes({"/other", "/q"});
  ASSERT_TRUE(second.status().has_value());
  EXPECT_EQ(store_->QueueLen("/q").value_or(-1), 1);
  // Once it is popped, there is nothing to pass on.
  ASSERT_EQ(store_->QueuePop("/q")->value, "job");
  store_->WaitForKeysOrQueues({"/q"}, absl::InfiniteDuration(),
                              third.Callback());
  store_->PassQueueWakes({"/q"});
  EXPECT_FALSE(third.status().has_value());
}

TEST_P(KvStoreQueuesTest, CancelledAndTimedOutWaitsTakeNoWakeUp) {
  WaitOutcome cancelled, timed_out, live;
  const KvStore::WaitId id = store_->WaitForKeysOrQueues(
      {"/q"}, absl::InfiniteDuration(), cancelled.Callback());
  store_->WaitForKeysOrQueues({"/q"}, absl::Milliseconds(1),
                              timed_out.Callback());
  EXPECT_EQ(timed_out.Await().code(), absl::StatusCode::kDeadlineExceeded);
  store_->CancelWait(id);
  store_->WaitForKeysOrQueues({"/q"}, absl::InfiniteDuration(),
                              live.Callback());
  ASSERT_TRUE(store_->QueuePush("/q", "v").ok());
  EXPECT_TRUE(live.status().has_value());
  EXPECT_FALSE(cancelled.status().has_value());
  EXPECT_EQ(store_->stats().waiters, 0u);
}

TEST_P(KvStoreQueuesTest, ItemsSurviveAReopenInPushOrder) {
  if (GetParam() != "rocksdb") GTEST_SKIP() << "memory keeps nothing";
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(store_->QueuePush("/q", absl::StrCat("item", i)).ok());
  }
  ASSERT_TRUE(store_->QueuePush("/r", "other").ok());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(store_->QueuePop("/q").ok());
  Reopen();
  EXPECT_EQ(store_->QueueLen("/q").value_or(-1), 15);
  EXPECT_EQ(store_->QueueLen("/r").value_or(-1), 1);
  const QueueStats stats = store_->queue_stats();
  EXPECT_EQ(stats.items, 16);
  EXPECT_EQ(stats.bytes, 5 * 5 + 10 * 6 + 5u);
  // A push after the reopen goes behind what was kept; a wait sees the
  // kept items.
  ASSERT_TRUE(store_->QueuePush("/q", "after").ok());
  WaitOutcome w;
  store_->WaitForKeysOrQueues({"/r"}, absl::InfiniteDuration(), w.Callback());
  EXPECT_TRUE(w.status().has_value());
  std::vector<std::string> want;
  for (int i = 5; i < 20; ++i) want.push_back(absl::StrCat("item", i));
  want.push_back("after");
  auto before = store_->ListKeys(QueueItemPrefix("/q"), 0, "");
  ASSERT_TRUE(before.ok());
  ASSERT_FALSE(before->keys.empty());
  const int64_t last_seq = ParseQueueItemKey(before->keys.back())->seq;
  EXPECT_EQ(Drain("/q"), want);
  // Emptied, reopened: a new item does not reuse an old one's key (a
  // watcher of the layout would take it for the old item).
  Reopen();
  ASSERT_TRUE(store_->QueuePush("/q", "fresh").ok());
  auto keys = store_->ListKeys(QueueItemPrefix("/q"), 0, "");
  ASSERT_TRUE(keys.ok());
  ASSERT_EQ(keys->keys.size(), 1u);
  EXPECT_GT(ParseQueueItemKey(keys->keys[0])->seq, last_seq);
}

INSTANTIATE_TEST_SUITE_P(Engines, KvStoreQueuesTest,
                         ::testing::Values("memory", "rocksdb"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace cohort::store
