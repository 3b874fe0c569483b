#include "store/queue_keys.h"

#include <algorithm>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace cohort::store {
namespace {

TEST(QueueKeysTest, ItemKeysNameTheirQueueAndNumber) {
  EXPECT_EQ(QueueItemKey("/jobs", 42),
            "/cohort/queues/5:/jobs/00000000000000000042");
  auto name = ParseQueueItemKey("/cohort/queues/5:/jobs/00000000000000000042");
  ASSERT_TRUE(name.has_value());
  EXPECT_EQ(name->queue, "/jobs");
  EXPECT_EQ(name->seq, 42);
  // Any bytes in the name, ':' and '/' and NUL included.
  const std::string odd("a:b/\0/c", 7);
  // The name's queue is a view into the key: the key must outlive it.
  const std::string odd_key = QueueItemKey(odd, 9223372036854775807);
  name = ParseQueueItemKey(odd_key);
  ASSERT_TRUE(name.has_value());
  EXPECT_EQ(name->queue, odd);
  EXPECT_EQ(name->seq, 9223372036854775807);
}

TEST(QueueKeysTest, OtherKeysAreNotItems) {
  for (const char* key : {
           "/jobs",
           "/cohort/runs/x",
           "/cohort/queues/",
           "/cohort/queues/5:/jobs/",
           "/cohort/queues/5:/jobs/0000000000000000004",    // 19 digits.
           "/cohort/queues/5:/jobs/000000000000000000042",  // 21.
           "/cohort/queues/4:/jobs/00000000000000000042",   // Wrong length.
           "/cohort/queues/x:/jobs/00000000000000000042",
           "/cohort/queues/5:/jobs/0000000000000000004x",
           "/cohort/queues/5/jobs/00000000000000000042",
           "/cohort/queues/:/00000000000000000042",
       }) {
    EXPECT_FALSE(ParseQueueItemKey(key).has_value()) << key;
  }
}

TEST(QueueKeysTest, NoQueueHoldsAnothersItemsAndByteOrderIsPushOrder) {
  // "a" and "a/b": a listing of one's prefix never reaches the other's.
  const std::string a = QueueItemPrefix("a");
  const std::string ab_item = QueueItemKey("a/b", 1);
  EXPECT_NE(ab_item.compare(0, a.size(), a), 0);
  EXPECT_NE(QueueItemKey("a", 1).compare(0, QueueItemPrefix("a/b").size(),
                                         QueueItemPrefix("a/b")),
            0);
  std::vector<std::string> keys;
  for (int64_t seq : {1, 9, 10, 99, 100, 123456789}) {
    keys.push_back(QueueItemKey("q", seq));
  }
  EXPECT_TRUE(std::is_sorted(keys.begin(), keys.end()));
}

}  // namespace
}  // namespace cohort::store
