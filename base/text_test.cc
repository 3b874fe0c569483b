#include "base/text.h"

#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace cohort::base {
namespace {

TEST(QuoteTest, EscapesAndCuts) {
  EXPECT_EQ(Quote("a\nb"), "\"a\\nb\"");
  EXPECT_EQ(Quote(std::string(70, 'k')),
            absl::StrCat("\"", std::string(64, 'k'), "...\""));
}

TEST(EscapeTest, EscapesControlBytesAndCuts) {
  EXPECT_EQ(Escape("node-1"), "node-1");
  EXPECT_EQ(Escape("a\nb\r\x1b[2K'\"\x7f"), "a\\nb\\r\\x1b[2K\\'\\\"\\x7f");
  EXPECT_EQ(Escape(std::string(10, 'k'), 4), "kkkk...");
  EXPECT_EQ(Escape("kkkk", 4), "kkkk");
}

TEST(ListSomeTest, ShortListsAreWhole) {
  EXPECT_EQ(ListSome({}), "");
  EXPECT_EQ(ListSome({"a", "b"}), "a, b");
}

TEST(ListSomeTest, LongListsNameHowManyMore) {
  std::vector<std::string> names;
  for (int i = 0; i < 20; ++i) names.push_back(absl::StrCat("n", i));
  const std::string text = ListSome(names);
  EXPECT_TRUE(absl::StartsWith(text, "n0, n1, ")) << text;
  EXPECT_TRUE(absl::EndsWith(text, "n15 and 4 more")) << text;
}

TEST(QuoteListTest, QuotesTheFirstEight) {
  std::vector<absl::string_view> keys(10, "k");
  EXPECT_EQ(
      QuoteList(keys),
      "\"k\", \"k\", \"k\", \"k\", \"k\", \"k\", \"k\", \"k\" and 2 more");
}

TEST(FirstFewTest, FormatsMapEntries) {
  std::map<std::string, int> m = {{"a", 1}, {"b", 2}, {"c", 3}};
  EXPECT_EQ(
      FirstFew(m.begin(), m.end(), 2, [](const auto& kv) { return kv.first; }),
      "a, b and 1 more");
}

}  // namespace
}  // namespace cohort::base
