#include "client/file_store_log.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace cohort::file_store_internal {
namespace {

std::string Encode(char kind, const std::vector<Mutation>& mutations) {
  absl::StatusOr<std::string> record = EncodeRecord(kind, mutations);
  EXPECT_TRUE(record.ok()) << record.status();
  return record.value_or("");
}

TEST(FileStoreLogTest, RecordsRoundTrip) {
  const std::vector<Record> written = {
      {kOpen, {}},
      {kBatch, {{"a", "1"}, {"b", "", false}, {std::string("\0k", 2), ""}}},
      {kClose, {}},
  };
  std::string log;
  for (const Record& r : written) log += Encode(r.kind, r.mutations);

  std::vector<Record> read;
  absl::StatusOr<size_t> used = ParseRecords(log, 20, "f", read);
  ASSERT_TRUE(used.ok()) << used.status();
  EXPECT_EQ(*used, log.size());
  EXPECT_EQ(read, written);
}

TEST(FileStoreLogTest, RecordCutShortIsLeftUnread) {
  const std::string first = Encode(kBatch, {{"key", "value"}});
  const std::string second = Encode(kBatch, {{"k2", "v2"}});
  const std::string log = first + second;
  for (size_t cut = first.size(); cut < log.size(); ++cut) {
    std::vector<Record> read;
    absl::StatusOr<size_t> used =
        ParseRecords(log.substr(0, cut), 0, "f", read);
    ASSERT_TRUE(used.ok()) << used.status();
    EXPECT_EQ(*used, first.size());
    EXPECT_EQ(read.size(), 1);
  }
}

TEST(FileStoreLogTest, CorruptRecordIsDataLossAtItsOffset) {
  const std::string good = Encode(kBatch, {{"a", "1"}});
  std::string bad = Encode(kBatch, {{"b", "2"}});
  bad[5] = 'X';  // The first mutation's op.
  std::vector<Record> read;
  absl::StatusOr<size_t> used = ParseRecords(good + bad, 100, "/p", read);
  EXPECT_EQ(used.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(used.status().message().find(absl::StrCat(
                "\"/p\" is corrupt: bad record at byte ", 100 + good.size())),
            absl::string_view::npos)
      << used.status();
  EXPECT_EQ(read.size(), 1);
}

TEST(FileStoreLogTest, LengthsPastTheRecordAreCorrupt) {
  // A key length that runs past the end of its record's body.
  std::string record = Encode(kBatch, {{"abc", "v"}});
  record[6] = 100;
  std::vector<Record> read;
  EXPECT_EQ(ParseRecords(record, 0, "f", read).status().code(),
            absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace cohort::file_store_internal
