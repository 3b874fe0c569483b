#include "store/wait_index.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace cohort::store {
namespace {

using Waiter = WaitIndex::Waiter;

// Adds a wait on `keys`, indexed under each as missing.
WaitIndex::WaitId AddWait(WaitIndex& index, std::vector<std::string> keys,
                          bool queues = false) {
  auto waiter = std::make_unique<Waiter>();
  waiter->keys = std::move(keys);
  waiter->queues = queues;
  const WaitIndex::WaitId id = index.Add(std::move(waiter));
  Waiter& w = *index.Find(id);
  for (const std::string& key : w.keys) {
    index.Index(key, w);
    ++w.missing;
  }
  return id;
}

TEST(WaitIndexTest, AWaitCompletesOnceItMissesNoKey) {
  WaitIndex index;
  const WaitIndex::WaitId id = AddWait(index, {"a", "b"});
  EXPECT_EQ(index.size(), 1u);
  std::vector<WaitIndex::WaitId> completed;
  auto complete = [&](Waiter& w) {
    completed.push_back(w.id);
    return true;
  };
  index.KeyPut("a", complete);
  EXPECT_TRUE(completed.empty());
  EXPECT_EQ(index.Find(id)->missing, 1u);
  index.KeyPut("other", complete);
  index.KeyPut("b", complete);
  EXPECT_EQ(completed, std::vector<WaitIndex::WaitId>{id});
  EXPECT_EQ(index.size(), 0u);
  EXPECT_EQ(index.Find(id), nullptr);
}

TEST(WaitIndexTest, ARegisteringWaitDoesNotComplete) {
  WaitIndex index;
  const WaitIndex::WaitId id = AddWait(index, {"a"});
  index.Find(id)->registering = true;
  int calls = 0;
  index.KeyPut("a", [&](Waiter&) { return ++calls, true; });
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(index.Find(id)->missing, 0u);
}

TEST(WaitIndexTest, AWaitThatFindsAKeyGoneIsIndexedAgain) {
  WaitIndex index;
  const WaitIndex::WaitId id = AddWait(index, {"a", "b"});
  index.KeyPut("a", [](Waiter&) { return true; });
  // "b" comes, but "a" was deleted meanwhile: the wait misses "a" again.
  index.KeyPut("b", [&](Waiter& w) {
    w.missing = 1;
    index.Index("a", w);
    return false;
  });
  ASSERT_NE(index.Find(id), nullptr);
  bool done = false;
  index.KeyPut("a", [&](Waiter&) { return done = true; });
  EXPECT_TRUE(done);
  EXPECT_EQ(index.size(), 0u);
}

TEST(WaitIndexTest, APushWakesOnlyTheOldestQueueWait) {
  WaitIndex index;
  const WaitIndex::WaitId plain = AddWait(index, {"q"});
  const WaitIndex::WaitId first = AddWait(index, {"q"}, /*queues=*/true);
  const WaitIndex::WaitId busy = AddWait(index, {"q", "x"}, /*queues=*/true);
  const WaitIndex::WaitId last = AddWait(index, {"q"}, /*queues=*/true);
  std::vector<WaitIndex::WaitId> woken;
  auto complete = [&](Waiter& w) {
    EXPECT_TRUE(w.queue_wake);
    woken.push_back(w.id);
    return true;
  };
  index.QueuePushed("q", complete);
  EXPECT_EQ(woken, std::vector<WaitIndex::WaitId>{first});
  // The next push skips the wait that still misses "x" (the queue counts
  // as present for it from now on) and wakes the one after.
  index.QueuePushed("q", complete);
  EXPECT_EQ(woken, (std::vector<WaitIndex::WaitId>{first, last}));
  EXPECT_EQ(index.Find(busy)->missing, 1u);
  EXPECT_NE(index.Find(plain), nullptr) << "a push is not a key";
  index.KeyPut("x", [&](Waiter& w) {
    EXPECT_FALSE(w.queue_wake);
    woken.push_back(w.id);
    return true;
  });
  EXPECT_EQ(woken.back(), busy);
  woken.clear();
  index.QueuePushed("q", complete);
  EXPECT_TRUE(woken.empty());
}

TEST(WaitIndexTest, RemoveDropsEveryIndexEntry) {
  WaitIndex index;
  const WaitIndex::WaitId id = AddWait(index, {"a", "q"}, /*queues=*/true);
  std::unique_ptr<Waiter> removed = index.Remove(id);
  ASSERT_NE(removed, nullptr);
  EXPECT_EQ(removed->id, id);
  EXPECT_EQ(index.Remove(id), nullptr);
  int calls = 0;
  index.KeyPut("a", [&](Waiter&) { return ++calls, true; });
  index.QueuePushed("q", [&](Waiter&) { return ++calls, true; });
  EXPECT_EQ(calls, 0);
}

TEST(WaitIndexTest, TakeLeavesTheIndexEntriesToUnindex) {
  WaitIndex index;
  const WaitIndex::WaitId id = AddWait(index, {"a", "b"});
  index.KeyPut("a", [](Waiter&) { return true; });
  std::unique_ptr<Waiter> taken = index.Take(id);
  ASSERT_NE(taken, nullptr);
  EXPECT_EQ(index.Find(id), nullptr);
  // Which keys it still missed: "b", not "a".
  EXPECT_FALSE(index.Unindex(id, "a", /*queues=*/false));
  EXPECT_TRUE(index.Unindex(id, "b", /*queues=*/false));
  EXPECT_FALSE(index.Unindex(id, "b", /*queues=*/false));
}

TEST(WaitIndexTest, TakeAllEmptiesIt) {
  WaitIndex index;
  const WaitIndex::WaitId a = AddWait(index, {"a"});
  const WaitIndex::WaitId b = AddWait(index, {"q"}, /*queues=*/true);
  auto all = index.TakeAll();
  EXPECT_EQ(all.size(), 2u);
  EXPECT_TRUE(all.contains(a) && all.contains(b));
  EXPECT_EQ(index.size(), 0u);
  int calls = 0;
  index.KeyPut("a", [&](Waiter&) { return ++calls, true; });
  index.QueuePushed("q", [&](Waiter&) { return ++calls, true; });
  EXPECT_EQ(calls, 0);
}

}  // namespace
}  // namespace cohort::store
