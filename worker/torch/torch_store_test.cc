#include "worker/torch/torch_store.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "torch/csrc/api/include/torch/version.h"
#include "torch/csrc/distributed/c10d/HashStore.hpp"

namespace cohort {
namespace {

class TorchStoreTest : public ::testing::Test {
 protected:
  c10::intrusive_ptr<c10d::HashStore> torch_ =
      c10::make_intrusive<c10d::HashStore>();
  TorchStore store_{torch_};
};

TEST_F(TorchStoreTest, SetGetAddAndCompareSetReachTheTorchStore) {
  ASSERT_TRUE(store_.Set("a", std::string("x\0y", 3)).ok());
  std::vector<uint8_t> raw = torch_->get("a");
  EXPECT_EQ(std::string(raw.begin(), raw.end()), std::string("x\0y", 3));
  EXPECT_EQ(*store_.Get("a", absl::Seconds(1)), std::string("x\0y", 3));

  EXPECT_EQ(*store_.Add("n", 5), 5);
  EXPECT_EQ(*store_.Add("n", -2), 3);

  EXPECT_EQ(*store_.CompareSet("c", "", "v1"), "v1");
  EXPECT_EQ(*store_.CompareSet("c", "wrong", "v2"), "v1");
  EXPECT_EQ(*store_.CompareSet("c", "v1", "v2"), "v2");
}

TEST_F(TorchStoreTest, WaitCheckDeleteNumKeysAndMultiGet) {
  ASSERT_TRUE(store_.Set("k1", "1").ok());
  ASSERT_TRUE(store_.Set("k2", "2").ok());
  EXPECT_TRUE(store_.Wait({"k1", "k2"}, absl::Seconds(1)).ok());
  EXPECT_TRUE(*store_.Check({"k1", "k2"}));
  EXPECT_FALSE(*store_.Check({"k1", "k3"}));
  EXPECT_EQ(*store_.MultiGet({"k2", "k1"}, absl::Seconds(1)),
            (std::vector<std::string>{"2", "1"}));
  EXPECT_EQ(*store_.NumKeys(), 2);
  EXPECT_TRUE(*store_.DeleteKey("k1"));
  EXPECT_FALSE(*store_.DeleteKey("k1"));
  EXPECT_EQ(*store_.NumKeys(), 1);
}

TEST_F(TorchStoreTest, TimeoutsAreDeadlineExceededNamingTheKey) {
  absl::StatusOr<std::string> got =
      store_.Get("missing", absl::Milliseconds(50));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDeadlineExceeded)
      << got.status();
  EXPECT_NE(got.status().message().find("\"missing\""), std::string::npos)
      << got.status();
  absl::Status waited = store_.Wait({"gone"}, absl::Milliseconds(50));
  EXPECT_EQ(waited.code(), absl::StatusCode::kDeadlineExceeded) << waited;
}

#if TORCH_VERSION_MAJOR >= 2
TEST_F(TorchStoreTest, MultiSetAndAppendUseTorch2sCalls) {
  ASSERT_TRUE(store_.MultiSet({"a", "b"}, {"1", "2"}).ok());
  ASSERT_TRUE(store_.Append("a", "+").ok());
  EXPECT_EQ(*store_.MultiGet({"b", "a"}, absl::Seconds(1)),
            (std::vector<std::string>{"2", "1+"}));
}
#else
TEST_F(TorchStoreTest, MultiSetAndAppendAreUnimplementedIn113) {
  EXPECT_EQ(store_.Append("a", "b").code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(store_.MultiSet({"a"}, {"b"}).code(),
            absl::StatusCode::kUnimplemented);
}
#endif

TEST_F(TorchStoreTest, WhatC10dLacksIsUnimplemented) {
  absl::StatusOr<KeyList> listed = store_.ListKeys("");
  EXPECT_EQ(listed.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(listed.status().message().find("list_keys"), std::string::npos);
  EXPECT_EQ(store_.Watch("", 0, [](const WatchEvent&) {}).status().code(),
            absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace cohort
