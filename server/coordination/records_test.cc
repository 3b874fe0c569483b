#include "server/coordination/records.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cohort/v1/coordination.pb.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "store/kv_engine.h"

namespace cohort::server {
namespace {

using ::testing::ElementsAre;
using ::testing::Pair;

TEST(LoadRecordsTest, ReadsEveryPageUnderThePrefixAndSkipsJunk) {
  store::StoreLimits limits;
  limits.max_list_page = 2;  // Five records take three pages.
  store::KvStore store(store::NewMemoryEngine(), limits);
  for (int i = 0; i < 5; ++i) {
    v1::RunState record;
    record.set_round(i);
    ASSERT_TRUE(
        store.Set(absl::StrCat("/records/run", i), record.SerializeAsString())
            .ok());
  }
  ASSERT_TRUE(store.Set("/records/run2x", "\xff not a proto").ok());
  ASSERT_TRUE(store.Set("/recordz", "outside the prefix").ok());

  std::vector<std::pair<std::string, int64_t>> loaded;
  LoadRecords<v1::RunState>(store, "/records/",
                            [&](absl::string_view name, v1::RunState& r) {
                              loaded.emplace_back(name, r.round());
                            });
  EXPECT_THAT(loaded,
              ElementsAre(Pair("run0", 0), Pair("run1", 1), Pair("run2", 2),
                          Pair("run3", 3), Pair("run4", 4)));

  std::vector<std::string> names;
  ForEachRecord(store, "/records/",
                [&](absl::string_view name, const std::string&) {
                  names.emplace_back(name);
                });
  EXPECT_EQ(names.size(), 6u);
}

}  // namespace
}  // namespace cohort::server
