#include "client/prefix_store.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/in_process_store.h"

namespace cohort {
namespace {

using ::testing::ElementsAre;

TEST(PrefixStoreTest, NamespacesKeysInTheBaseStore) {
  auto base = std::make_shared<InProcessStore>();
  PrefixStore a("job/a", base), b("job/b", base);
  ASSERT_TRUE(a.Set("rank", "0").ok());
  ASSERT_TRUE(b.Set("rank", "1").ok());
  EXPECT_EQ(*a.Get("rank"), "0");
  EXPECT_EQ(*b.Get("rank"), "1");
  EXPECT_EQ(*base->Get("job/a/rank"), "0");
  EXPECT_EQ(*a.Add("n", 2), 2);
  EXPECT_EQ(*base->Get("job/a/n"), "2");
  EXPECT_TRUE(*a.Check({"rank", "n"}));
  EXPECT_FALSE(*b.Check({"n"}));
  EXPECT_EQ(*a.CompareSet("rank", "0", "5"), "5");
  EXPECT_TRUE(*a.DeleteKey("rank"));
  EXPECT_FALSE(*base->Check({"job/a/rank"}));
}

TEST(PrefixStoreTest, MultiOpsListAndWaitUseThePrefix) {
  auto base = std::make_shared<InProcessStore>();
  PrefixStore store("p", base);
  ASSERT_TRUE(store.MultiSet({"x", "y"}, {"1", "2"}).ok());
  EXPECT_THAT(*store.MultiGet({"y", "x"}), ElementsAre("2", "1"));
  ASSERT_TRUE(store.Append("x", "+").ok());
  EXPECT_EQ(*store.Get("x"), "1+");
  ASSERT_TRUE(base->Set("other", "v").ok());
  EXPECT_THAT(store.ListKeys("")->keys, ElementsAre("x", "y"));
  EXPECT_TRUE(store.Wait({"x", "y"}, absl::Milliseconds(10)).ok());
  absl::Status missing = store.Wait({"z"}, absl::Milliseconds(10));
  EXPECT_EQ(missing.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(missing.message(), ::testing::HasSubstr("\"p/z\""));
}

TEST(PrefixStoreTest, NestedPrefixesCompose) {
  auto base = std::make_shared<InProcessStore>();
  auto outer = std::make_shared<PrefixStore>("run", base);
  PrefixStore inner("round1", outer);
  ASSERT_TRUE(inner.Set("k", "v").ok());
  EXPECT_EQ(*base->Get("run/round1/k"), "v");
}

TEST(PrefixStoreTest, WatchStripsThePrefix) {
  auto base = std::make_shared<InProcessStore>();
  PrefixStore store("p", base);
  absl::Mutex mu;
  std::vector<std::string> keys;
  auto watch = store.Watch("", 0, [&](const WatchEvent& e) {
    absl::MutexLock l(&mu);
    keys.push_back(e.key);
  });
  ASSERT_TRUE(watch.ok());
  ASSERT_TRUE(base->Set("elsewhere", "1").ok());
  ASSERT_TRUE(store.Set("mine", "1").ok());
  absl::MutexLock l(&mu);
  mu.AwaitWithTimeout(
      absl::Condition(
          +[](std::vector<std::string>* k) { return !k->empty(); }, &keys),
      absl::Seconds(5));
  EXPECT_THAT(keys, ElementsAre("mine"));
}

}  // namespace
}  // namespace cohort
