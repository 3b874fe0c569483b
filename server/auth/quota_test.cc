#include "server/auth/quota.h"

#include <limits>
#include <string>
#include <utility>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cohort::server {
namespace {

using ::testing::HasSubstr;

TEST(QuotasTest, TakesUpToTheLimitAndGivesBack) {
  Quotas quotas({.watch_streams = 2});
  EXPECT_TRUE(quotas.Take("token a", Quota::kWatchStreams, 1).ok());
  EXPECT_TRUE(quotas.Take("token a", Quota::kWatchStreams, 1).ok());
  EXPECT_EQ(quotas.Used("token a", Quota::kWatchStreams), 2u);
  absl::Status over = quotas.Take("token a", Quota::kWatchStreams, 1);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  // A refusal charges nothing.
  EXPECT_EQ(quotas.Used("token a", Quota::kWatchStreams), 2u);
  quotas.Give("token a", Quota::kWatchStreams, 1);
  EXPECT_EQ(quotas.Used("token a", Quota::kWatchStreams), 1u);
  EXPECT_TRUE(quotas.Take("token a", Quota::kWatchStreams, 1).ok());
}

TEST(QuotasTest, RefusalNamesQuotaFlagOwnerUseAndLimit) {
  Quotas quotas({.waited_keys = 100});
  ASSERT_TRUE(quotas.Take("token 0123456789ab", Quota::kWaitedKeys, 60).ok());
  absl::Status over = quotas.Take("token 0123456789ab", Quota::kWaitedKeys, 50);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.message(), HasSubstr("quota waited_keys"));
  EXPECT_THAT(over.message(), HasSubstr("--quota_waited_keys"));
  EXPECT_THAT(over.message(), HasSubstr("token 0123456789ab"));
  EXPECT_THAT(over.message(), HasSubstr("60 in use"));
  EXPECT_THAT(over.message(), HasSubstr("limit 100"));
}

TEST(QuotasTest, OneOwnersRefusalLeavesAnothersTakes) {
  Quotas quotas({.waits = 1});
  ASSERT_TRUE(quotas.Take("token a", Quota::kWaits, 1).ok());
  EXPECT_FALSE(quotas.Take("token a", Quota::kWaits, 1).ok());
  EXPECT_TRUE(quotas.Take("token b", Quota::kWaits, 1).ok());
  EXPECT_EQ(quotas.Used("token a", Quota::kWaits), 1u);
  EXPECT_EQ(quotas.Used("token b", Quota::kWaits), 1u);
  // And each quota is its own.
  EXPECT_TRUE(quotas.Take("token a", Quota::kWaitedKeys, 5).ok());
}

TEST(QuotasTest, CountsRefusalsByQuotaAndOwnersHolding) {
  Quotas quotas({.queue_bytes = 10, .connections = 1});
  ASSERT_TRUE(
      quotas.Take("connection ipv4:1.2.3.4:5", Quota::kConnections, 1).ok());
  EXPECT_FALSE(
      quotas.Take("connection ipv4:1.2.3.4:5", Quota::kConnections, 1).ok());
  EXPECT_FALSE(quotas.Take("token a", Quota::kQueueBytes, 11).ok());
  EXPECT_FALSE(quotas.Take("token a", Quota::kQueueBytes, 11).ok());
  QuotaStats stats = quotas.stats();
  EXPECT_EQ(stats.refused[static_cast<int>(Quota::kConnections)], 1u);
  EXPECT_EQ(stats.refused[static_cast<int>(Quota::kQueueBytes)], 2u);
  EXPECT_EQ(stats.refused[static_cast<int>(Quota::kWaits)], 0u);
  EXPECT_EQ(stats.owners, 1u);
  EXPECT_EQ(stats.used[static_cast<int>(Quota::kConnections)], 1u);
  EXPECT_EQ(stats.used[static_cast<int>(Quota::kQueueBytes)], 0u);
  quotas.Give("connection ipv4:1.2.3.4:5", Quota::kConnections, 1);
  EXPECT_EQ(quotas.stats().owners, 0u);
}

TEST(QuotasTest, AHugeAmountDoesNotWrapPastTheLimit) {
  Quotas quotas({.queue_bytes = 100});
  ASSERT_TRUE(quotas.Take("token a", Quota::kQueueBytes, 50).ok());
  EXPECT_FALSE(quotas
                   .Take("token a", Quota::kQueueBytes,
                         std::numeric_limits<uint64_t>::max() - 10)
                   .ok());
  EXPECT_EQ(quotas.Used("token a", Quota::kQueueBytes), 50u);
}

TEST(QuotasTest, AdminsAreNotCharged) {
  Quotas quotas({.waits = 0});
  EXPECT_TRUE(quotas.Take("", Quota::kWaits, 1).ok());
  EXPECT_EQ(quotas.stats().owners, 0u);
}

TEST(QuotasTest, ChargeIsAllOrNoneAndEndsWithItsHolder) {
  Quotas quotas({.waits = 10, .waited_keys = 5});
  {
    absl::StatusOr<QuotaCharge> charge =
        quotas.Charge("token a", {{Quota::kWaits, 1}, {Quota::kWaitedKeys, 4}});
    ASSERT_TRUE(charge.ok());
    EXPECT_EQ(quotas.Used("token a", Quota::kWaits), 1u);
    EXPECT_EQ(quotas.Used("token a", Quota::kWaitedKeys), 4u);
    // The second quota refuses: the first is given back too.
    absl::StatusOr<QuotaCharge> over =
        quotas.Charge("token a", {{Quota::kWaits, 1}, {Quota::kWaitedKeys, 2}});
    EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(quotas.Used("token a", Quota::kWaits), 1u);
    QuotaCharge moved = std::move(*charge);
    EXPECT_EQ(quotas.Used("token a", Quota::kWaits), 1u);
  }
  EXPECT_EQ(quotas.Used("token a", Quota::kWaits), 0u);
  EXPECT_EQ(quotas.Used("token a", Quota::kWaitedKeys), 0u);
  EXPECT_EQ(quotas.stats().owners, 0u);
}

TEST(QuotaOwnerTest, ChargesTheChainsFileTokenOrTheConnection) {
  Grant file{.role = v1::READ_WRITE,
             .prefix = "job1/",
             .digest = "aaaaaaaaaaaaaaaaaaaaaaaa",
             .root_digest = "aaaaaaaaaaaaaaaaaaaaaaaa"};
  Grant issued{.role = v1::READ_WRITE,
               .prefix = "job1/w/",
               .digest = "bbbbbbbbbbbbbbbbbbbbbbbb",
               .root_digest = "aaaaaaaaaaaaaaaaaaaaaaaa"};
  Grant admin{.role = v1::ADMIN, .prefix = "*", .digest = "cccccccccccc"};
  EXPECT_EQ(QuotaOwner(&file, "ipv4:1.2.3.4:5"), "token aaaaaaaaaaaa");
  // What a job issues shares its quota.
  EXPECT_EQ(QuotaOwner(&issued, "ipv4:1.2.3.4:6"), "token aaaaaaaaaaaa");
  EXPECT_EQ(QuotaOwner(&admin, "ipv4:1.2.3.4:5"), "");
  EXPECT_EQ(QuotaOwner(nullptr, "ipv4:1.2.3.4:5"), "connection ipv4:1.2.3.4:5");
}

}  // namespace
}  // namespace cohort::server
