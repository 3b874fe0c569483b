#include "worker/collective/gloo/gloo_store.h"

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gloo/common/error.h"
#include "gtest/gtest.h"
#include "tests/testing/in_process_store.h"

namespace cohort {
namespace {

TEST(GlooStoreTest, SetThenGet) {
  auto store = std::make_shared<InProcessStore>();
  GlooStore gloo_store(store, absl::Seconds(5));
  const std::vector<char> value = {'a', '\0', 'b'};
  gloo_store.set("k", value);
  EXPECT_EQ(gloo_store.get("k"), value);
  EXPECT_EQ(*store->Get("k"), std::string("a\0b", 3));
  EXPECT_TRUE(gloo_store.TakeError().ok());
}

TEST(GlooStoreTest, GetBlocksUntilSet) {
  auto store = std::make_shared<InProcessStore>();
  // A timeout that outlasts the test: only the set can end the get.
  GlooStore gloo_store(store, absl::Minutes(10));
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_TRUE(store->Set("late", "v").ok());
  });
  EXPECT_EQ(gloo_store.get("late"), std::vector<char>{'v'});
  gloo_store.wait({"late"}, std::chrono::milliseconds(10));
  setter.join();
}

TEST(GlooStoreTest, TimeoutThrowsAndKeepsTheStatus) {
  auto store = std::make_shared<InProcessStore>();
  GlooStore gloo_store(store, absl::Milliseconds(50));
  EXPECT_THROW(gloo_store.get("missing"), gloo::IoException);
  absl::Status error = gloo_store.TakeError();
  EXPECT_EQ(error.code(), absl::StatusCode::kDeadlineExceeded) << error;
  EXPECT_TRUE(gloo_store.TakeError().ok());  // Taken.

  EXPECT_THROW(gloo_store.wait({"a", "b"}, std::chrono::milliseconds(20)),
               gloo::IoException);
  EXPECT_EQ(gloo_store.TakeError().code(), absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace cohort
