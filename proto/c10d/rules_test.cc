#include "proto/c10d/rules.h"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cohort::c10d {
namespace {

using ::testing::HasSubstr;

void ExpectError(const absl::Status& s, absl::StatusCode code,
                 absl::string_view text) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_EQ(s.message(), text);
}

TEST(LimitsTest, DefaultsAreCohortdsFlagDefaults) {
  const Limits limits;
  EXPECT_EQ(limits.max_key_bytes, 4096u);
  EXPECT_EQ(limits.max_value_bytes, 8u << 20);
  EXPECT_EQ(limits.max_keys_per_call, 131072u);
}

TEST(CheckKeyTest, EmptyAndLongKeysAreInvalid) {
  const Limits limits{.max_key_bytes = 3};
  EXPECT_TRUE(CheckKey(limits, "abc").ok());
  ExpectError(CheckKey(limits, ""), absl::StatusCode::kInvalidArgument,
              "key must not be empty");
  ExpectError(CheckKey(limits, "abcd"), absl::StatusCode::kInvalidArgument,
              "key \"abcd\" is 4 bytes, over the limit of 3 bytes "
              "(max_key_bytes)");
}

TEST(CheckValueTest, EmptyIsFineLongIsNot) {
  const Limits limits{.max_value_bytes = 2};
  EXPECT_TRUE(CheckValue(limits, "").ok());
  EXPECT_TRUE(CheckValue(limits, "ab").ok());
  ExpectError(CheckValue(limits, "abc"), absl::StatusCode::kInvalidArgument,
              "value is 3 bytes, over the limit of 2 bytes (max_value_bytes)");
}

TEST(CheckKeysTest, CountsThenChecksEachKey) {
  const Limits limits{.max_keys_per_call = 2};
  EXPECT_TRUE(CheckKeys(limits, {}).ok());
  EXPECT_TRUE(CheckKeys(limits, {"a", "b"}).ok());
  ExpectError(CheckKeys(limits, {"a", "b", "c"}),
              absl::StatusCode::kInvalidArgument,
              "request names 3 keys, over the limit of 2 (max_keys_per_call)");
  ExpectError(CheckKeys(limits, {"a", ""}), absl::StatusCode::kInvalidArgument,
              "key must not be empty");
}

TEST(CheckPrefixTest, MayBeEmptyButNotLongerThanAKey) {
  const Limits limits{.max_key_bytes = 2};
  EXPECT_TRUE(CheckPrefix(limits, "").ok());
  EXPECT_TRUE(CheckPrefix(limits, "ab").ok());
  EXPECT_THAT(CheckPrefix(limits, "abc").message(),
              HasSubstr("(max_key_bytes)"));
}

TEST(CheckMultiSetTest, PairsKeysAndValuesAndNamesTheKey) {
  const Limits limits{.max_value_bytes = 1};
  EXPECT_TRUE(CheckMultiSet(limits, {"a", "b"}, {"1", ""}).ok());
  ExpectError(CheckMultiSet(limits, {"a", "b"}, {"1"}),
              absl::StatusCode::kInvalidArgument,
              "multi_set got 2 keys but 1 values");
  ExpectError(CheckMultiSet(limits, {"a", ""}, {"1", "2"}),
              absl::StatusCode::kInvalidArgument, "key must not be empty");
  ExpectError(CheckMultiSet(limits, {"a", "b"}, {"1", "22"}),
              absl::StatusCode::kInvalidArgument,
              "key \"b\": value is 2 bytes, over the limit of 1 bytes "
              "(max_value_bytes)");
}

TEST(AddTest, MissingCountsAsZeroAndTheSumIsDecimal) {
  absl::StatusOr<AddOutcome> r = Add("n", nullptr, 5);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->value, 5);
  EXPECT_EQ(r->text, "5");
  const std::string current = "-7";
  r = Add("n", &current, 2);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->value, -5);
  EXPECT_EQ(r->text, "-5");
}

TEST(AddTest, NonIntegersFailWithAHint) {
  const std::string current = "abc";
  ExpectError(Add("n", &current, 1).status(),
              absl::StatusCode::kFailedPrecondition,
              "cannot add to key \"n\": its value \"abc\" is not a decimal "
              "int64 (was it written by set rather than add?)");
  const std::string too_big = "9223372036854775808";
  EXPECT_EQ(Add("n", &too_big, 0).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(AddTest, OverflowIsOutOfRange) {
  const std::string max = absl::StrCat(std::numeric_limits<int64_t>::max());
  ExpectError(
      Add("n", &max, 1).status(), absl::StatusCode::kOutOfRange,
      absl::StrCat("adding 1 to key \"n\" (value ", max, ") overflows int64"));
  const std::string min = absl::StrCat(std::numeric_limits<int64_t>::min());
  EXPECT_EQ(Add("n", &min, -1).status().code(), absl::StatusCode::kOutOfRange);
  absl::StatusOr<AddOutcome> r = Add("n", &max, 0);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->text, max);
}

TEST(CompareSetTest, FollowsC10dsTable) {
  const std::string current = "old";
  CompareSetOutcome r = CompareSet(nullptr, "", "new");
  EXPECT_TRUE(r.write);
  EXPECT_EQ(r.result, "new");
  r = CompareSet(nullptr, "x", "new");
  EXPECT_FALSE(r.write);
  EXPECT_EQ(r.result, "x");
  r = CompareSet(&current, "old", "new");
  EXPECT_TRUE(r.write);
  EXPECT_EQ(r.result, "new");
  r = CompareSet(&current, "other", "new");
  EXPECT_FALSE(r.write);
  EXPECT_EQ(r.result, "old");
  // An existing empty value is matched by an empty `expected`.
  const std::string empty;
  r = CompareSet(&empty, "", "new");
  EXPECT_TRUE(r.write);
}

TEST(AppendTest, ConcatenatesWithinTheValueLimit) {
  const Limits limits{.max_value_bytes = 4};
  absl::StatusOr<std::string> r = Append(limits, "k", nullptr, "ab");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, "ab");
  r = Append(limits, "k", &*r, "cd");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, "abcd");
  const std::string full = "abcd";
  ExpectError(Append(limits, "k", &full, "e").status(),
              absl::StatusCode::kInvalidArgument,
              "append to key \"k\": value is 5 bytes, over the limit of 4 "
              "bytes (max_value_bytes)");
}

TEST(WaitTimeoutTest, NamesTheMissingKeys) {
  ExpectError(WaitTimeout(absl::Seconds(5), 3, {"a", "b"}),
              absl::StatusCode::kDeadlineExceeded,
              "timed out after 5s waiting for 2 of 3 keys; missing: \"a\", "
              "\"b\"");
  EXPECT_THAT(WaitTimeout(absl::Milliseconds(10), 1, {"k"}).message(),
              HasSubstr("waiting for 1 of 1 key;"));
}

TEST(CheckClientWriteTest, RefusesOnlyTheReservedNamespace) {
  EXPECT_TRUE(CheckClientWrite("runs/x").ok());
  EXPECT_TRUE(CheckClientWrite("cohort/runs/x").ok());
  EXPECT_TRUE(CheckClientWrite("/cohortx/runs").ok());
  EXPECT_TRUE(CheckClientWrite("//cohort/runs/x").ok());
  ExpectError(CheckClientWrite("/cohort/runs/x"),
              absl::StatusCode::kPermissionDenied,
              "key \"/cohort/runs/x\" is in cohortd's reserved namespace "
              "\"/cohort/\": its coordination records are written only by "
              "cohortd; use the Rendezvous and Membership RPCs");
  EXPECT_EQ(CheckClientWrite("/cohort/").code(),
            absl::StatusCode::kPermissionDenied);
}

}  // namespace
}  // namespace cohort::c10d
