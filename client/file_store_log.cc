#include "client/file_store_log.h"

#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace cohort::file_store_internal {
namespace {

constexpr char kPut = 'P', kDelete = 'D';

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}

uint32_t GetU32(absl::string_view in) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    v |= uint32_t{static_cast<uint8_t>(in[i])} << (8 * i);
  }
  return v;
}

// Takes length-prefixed bytes off the front of `in`.
bool GetBytes(absl::string_view& in, std::string& out) {
  if (in.size() < 4 || in.size() - 4 < GetU32(in)) return false;
  out.assign(in.data() + 4, GetU32(in));
  in.remove_prefix(4 + out.size());
  return true;
}

}  // namespace

absl::StatusOr<std::string> EncodeRecord(
    char kind, const std::vector<Mutation>& mutations) {
  std::string body(1, kind);
  for (const Mutation& m : mutations) {
    body.push_back(m.is_put ? kPut : kDelete);
    PutU32(body, m.key.size());
    body += m.key;
    if (!m.is_put) continue;
    PutU32(body, m.value.size());
    body += m.value;
  }
  if (body.size() > UINT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a change of ", body.size(), " bytes is over FileStore's 4 GiB limit"));
  }
  std::string record;
  PutU32(record, body.size());
  return record + body;
}

absl::StatusOr<size_t> ParseRecords(absl::string_view data, int64_t offset,
                                    const std::string& path,
                                    std::vector<Record>& out) {
  size_t used = 0;
  while (data.size() - used >= 4) {
    const uint32_t size = GetU32(data.substr(used));
    if (data.size() - used - 4 < size) break;
    absl::string_view body = data.substr(used + 4, size);
    Record record{body.empty() ? '\0' : body[0], {}};
    bool ok =
        record.kind == kBatch || record.kind == kOpen || record.kind == kClose;
    if (ok) body.remove_prefix(1);
    while (ok && !body.empty()) {
      Mutation m;
      m.is_put = body[0] == kPut;
      ok = m.is_put || body[0] == kDelete;
      body.remove_prefix(1);
      ok =
          ok && GetBytes(body, m.key) && (!m.is_put || GetBytes(body, m.value));
      record.mutations.push_back(std::move(m));
    }
    if (!ok) {
      return absl::DataLossError(
          absl::StrCat("FileStore file \"", path,
                       "\" is corrupt: bad record at byte ", offset + used));
    }
    out.push_back(std::move(record));
    used += 4 + size;
  }
  return used;
}

}  // namespace cohort::file_store_internal
