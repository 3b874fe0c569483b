// The file format of FileStore (file_store.h), apart from the file itself so
// that it can be tested and fuzzed on bytes alone.
//
// After FileStore's magic line the file holds records: a little-endian u32
// length of the rest, a kind, and for a batch each mutation as an op ('P' or
// 'D'), a u32 key length and the key, and for a put a u32 value length and
// the value. The encoding is canonical: ParseRecords followed by
// EncodeRecord gives back the bytes parsed.
#ifndef COHORT_CLIENT_FILE_STORE_LOG_H_
#define COHORT_CLIENT_FILE_STORE_LOG_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace cohort::file_store_internal {

// Record kinds. A batch is one revision; opens and closes count the stores
// using the file.
inline constexpr char kBatch = 'B', kOpen = 'O', kClose = 'C';

struct Mutation {
  std::string key;
  std::string value;  // Empty for a delete.
  bool is_put = true;

  bool operator==(const Mutation& o) const {
    return key == o.key && value == o.value && is_put == o.is_put;
  }
};

struct Record {
  char kind = kBatch;
  std::vector<Mutation> mutations;

  bool operator==(const Record& o) const {
    return kind == o.kind && mutations == o.mutations;
  }
};

// One record, length prefix included. INVALID_ARGUMENT if it would not fit
// the u32 length.
absl::StatusOr<std::string> EncodeRecord(
    char kind, const std::vector<Mutation>& mutations);

// Parses the whole records at the front of `data`, which starts at byte
// `offset` of the file at `path` (both for messages), appends them to `out`
// and returns the bytes they take, at most data.size(). A record cut short
// at the end is not an error: it is from a writer that died mid-write
// (readers hold the file lock, so no write is in progress) and is left for
// the next writer to cut off. A malformed record is DATA_LOSS naming its
// offset; `out` then holds the records before it.
absl::StatusOr<size_t> ParseRecords(absl::string_view data, int64_t offset,
                                    const std::string& path,
                                    std::vector<Record>& out);

}  // namespace cohort::file_store_internal

#endif  // COHORT_CLIENT_FILE_STORE_LOG_H_
