#include "client/checkpoint_catalog.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/util/json_util.h"

namespace cohort {
namespace {

constexpr absl::string_view kFormat = "cohort-checkpoint/1";

std::string StepKey(int64_t step) { return absl::StrFormat("%012d", step); }

absl::StatusOr<v1::CheckpointRecord> ParseRecord(absl::string_view key,
                                                 const std::string& value) {
  v1::CheckpointRecord record;
  if (!record.ParseFromString(value)) {
    return absl::DataLossError(
        absl::StrCat("checkpoint record at ", key, " does not parse"));
  }
  return record;
}

// Checks that `shards` (sorted by start) cover [0, numel) exactly.
absl::Status CheckCoverage(const v1::CheckpointTensor& t) {
  const uint64_t numel = CheckpointNumel(t);
  uint64_t next = 0;
  for (const v1::CheckpointShard& s : t.shards()) {
    if (s.start() != next) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name(), "': ",
          s.start() < next ? "shards overlap" : "a gap between shards",
          " at element ", std::min<uint64_t>(s.start(), next), " (shard of ",
          s.file(), " starts at ", s.start(), ", expected ", next, ")"));
    }
    if (s.count() == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name(), "': an empty shard in ", s.file()));
    }
    next += s.count();
  }
  if (next != numel) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", t.name(), "': shards cover ", next, " of its ",
                     numel, " elements"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string CheckpointPrefix(absl::string_view run_id) {
  return absl::StrCat("runs/", run_id, "/checkpoints/");
}

std::string CheckpointFolderName(int64_t step) {
  return absl::StrCat("step-", StepKey(step));
}

uint64_t CheckpointNumel(const v1::CheckpointTensor& tensor) {
  uint64_t numel = 1;
  for (uint64_t d : tensor.shape()) numel *= d;
  return numel;
}

CheckpointCatalog::CheckpointCatalog(Store* store, std::string prefix)
    : store_(store), prefix_(std::move(prefix)) {}

std::string CheckpointCatalog::PartsPrefix(int64_t step) const {
  return absl::StrCat(prefix_, "parts/", StepKey(step), "/");
}

std::string CheckpointCatalog::CommittedKey(int64_t step) const {
  return absl::StrCat(prefix_, "committed/", StepKey(step));
}

absl::Status CheckpointCatalog::ReportPart(int64_t step,
                                           absl::string_view attempt,
                                           const v1::CheckpointPart& part) {
  return store_->Set(
      absl::StrCat(PartsPrefix(step), attempt, "/", part.rank()),
      part.SerializeAsString());
}

absl::StatusOr<std::vector<v1::CheckpointPart>> CheckpointCatalog::WaitForParts(
    int64_t step, absl::string_view attempt, int world_size,
    absl::Duration timeout) {
  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r) {
    keys.push_back(absl::StrCat(PartsPrefix(step), attempt, "/", r));
  }
  absl::Status all = store_->Wait(keys, timeout);
  if (absl::IsDeadlineExceeded(all)) {
    std::vector<int> missing;
    for (int r = 0; r < world_size; ++r) {
      absl::StatusOr<bool> there = store_->Check({keys[r]});
      if (there.ok() && !*there) missing.push_back(r);
    }
    return absl::DeadlineExceededError(absl::StrCat(
        "checkpoint of step ", step, ": after ", absl::FormatDuration(timeout),
        ", rank", missing.size() == 1 ? " " : "s ",
        absl::StrJoin(missing, ", "), " of ", world_size,
        " had not reported their files written"));
  }
  if (!all.ok()) return all;
  absl::StatusOr<std::vector<std::string>> values =
      store_->MultiGet(keys, timeout);
  if (!values.ok()) return values.status();
  std::vector<v1::CheckpointPart> parts(world_size);
  for (int r = 0; r < world_size; ++r) {
    if (!parts[r].ParseFromString((*values)[r]) || parts[r].rank() != r) {
      return absl::DataLossError(absl::StrCat(
          "checkpoint of step ", step, ": the part at ", keys[r],
          " does not parse as rank ", r, "'s"));
    }
  }
  return parts;
}

absl::StatusOr<bool> CheckpointCatalog::IsCommitted(int64_t step) {
  return store_->Check({CommittedKey(step)});
}

absl::Status CheckpointCatalog::WaitCommitted(int64_t step,
                                              absl::Duration timeout) {
  absl::Status s = store_->Wait({CommittedKey(step)}, timeout);
  if (absl::IsDeadlineExceeded(s)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "checkpoint of step ", step, ": not committed after ",
        absl::FormatDuration(timeout),
        " (rank 0 commits once every rank has reported its file)"));
  }
  return s;
}

absl::Status CheckpointCatalog::Commit(const v1::CheckpointRecord& record) {
  const std::string value = record.SerializeAsString();
  const std::string key = CommittedKey(record.step());
  absl::StatusOr<std::string> now = store_->CompareSet(key, "", value);
  if (!now.ok()) return now.status();
  if (*now != value) {
    return absl::AlreadyExistsError(absl::StrCat(
        "checkpoint of step ", record.step(), " is already committed in ",
        prefix_, " with another record"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<v1::CheckpointRecord>>
CheckpointCatalog::Latest() {
  absl::StatusOr<KeyList> keys =
      store_->ListKeys(absl::StrCat(prefix_, "committed/"));
  if (!keys.ok()) return keys.status();
  if (keys->keys.empty()) return std::optional<v1::CheckpointRecord>();
  // Committed records are never deleted by cohort; one an operator deletes
  // between the listing and the read times out rather than blocking.
  absl::StatusOr<std::string> value =
      store_->Get(keys->keys.back(), absl::Seconds(10));
  if (!value.ok()) return value.status();
  absl::StatusOr<v1::CheckpointRecord> record =
      ParseRecord(keys->keys.back(), *value);
  if (!record.ok()) return record.status();
  return std::optional<v1::CheckpointRecord>(*std::move(record));
}

absl::StatusOr<std::vector<v1::CheckpointRecord>> CheckpointCatalog::List() {
  absl::StatusOr<KeyList> keys =
      store_->ListKeys(absl::StrCat(prefix_, "committed/"));
  if (!keys.ok()) return keys.status();
  std::vector<v1::CheckpointRecord> records;
  if (keys->keys.empty()) return records;
  // Deleted between the listing and the read: c10d's get would block.
  absl::StatusOr<std::vector<std::string>> values =
      store_->MultiGet(keys->keys, absl::Seconds(10));
  if (!values.ok()) return values.status();
  for (size_t i = 0; i < keys->keys.size(); ++i) {
    absl::StatusOr<v1::CheckpointRecord> record =
        ParseRecord(keys->keys[i], (*values)[i]);
    if (!record.ok()) return record.status();
    records.push_back(*std::move(record));
  }
  return records;
}

absl::Status CheckpointCatalog::ForgetParts(int64_t step) {
  absl::StatusOr<KeyList> keys = store_->ListKeys(PartsPrefix(step));
  if (!keys.ok()) return keys.status();
  for (const std::string& key : keys->keys) {
    absl::StatusOr<bool> deleted = store_->DeleteKey(key);
    if (!deleted.ok()) return deleted.status();
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::CheckpointMetadata> MergeCheckpointParts(
    int64_t step, int world_size, std::vector<v1::CheckpointPart> parts,
    absl::Time created) {
  v1::CheckpointMetadata m;
  m.set_format(std::string(kFormat));
  m.set_step(step);
  m.set_world_size(world_size);
  m.set_created_unix_ms(absl::ToUnixMillis(created));
  std::map<std::string, v1::CheckpointTensor> tensors;
  std::map<std::string, int> first_rank;  // Who described each tensor first.
  for (v1::CheckpointPart& part : parts) {
    *m.add_files() = part.file();
    for (const auto& [key, value] : part.attributes()) {
      (*m.mutable_attributes())[key] = value;
    }
    for (v1::CheckpointTensor& t : *part.mutable_tensors()) {
      auto [it, fresh] = tensors.try_emplace(t.name());
      v1::CheckpointTensor& merged = it->second;
      if (fresh) {
        merged.set_name(t.name());
        merged.set_dtype(t.dtype());
        *merged.mutable_shape() = t.shape();
        first_rank[t.name()] = part.rank();
      } else if (merged.dtype() != t.dtype() ||
                 !std::equal(merged.shape().begin(), merged.shape().end(),
                             t.shape().begin(), t.shape().end())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "checkpoint of step ", step, ": ranks ", first_rank[t.name()],
            " and ", part.rank(), " disagree on tensor '", t.name(),
            "''s dtype or shape"));
      }
      for (v1::CheckpointShard& s : *t.mutable_shards()) {
        *merged.add_shards() = std::move(s);
      }
    }
  }
  for (auto& [name, t] : tensors) {
    std::sort(t.mutable_shards()->begin(), t.mutable_shards()->end(),
              [](const v1::CheckpointShard& a, const v1::CheckpointShard& b) {
                return a.start() < b.start();
              });
    *m.add_tensors() = std::move(t);
  }
  if (absl::Status s = ValidateCheckpointMetadata(m); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("checkpoint of step ", step,
                                               ": ", s.message()));
  }
  return m;
}

absl::Status ValidateCheckpointMetadata(const v1::CheckpointMetadata& m) {
  if (m.format() != kFormat) {
    return absl::InvalidArgumentError(absl::StrCat(
        "format '", m.format(), "' is not ", kFormat, " (written by a newer cohort?)"));
  }
  if (m.world_size() < 1 || m.files_size() != m.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("world size ", m.world_size(), " with ", m.files_size(),
                     " data files; expected one per rank"));
  }
  std::map<std::string, uint64_t> file_bytes;
  for (const v1::CheckpointFile& f : m.files()) file_bytes[f.name()] = f.bytes();
  for (const v1::CheckpointTensor& t : m.tensors()) {
    if (t.dtype() != "f32") {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name(), "' has dtype '", t.dtype(), "'; only f32 is known"));
    }
    if (absl::Status s = CheckCoverage(t); !s.ok()) return s;
    for (const v1::CheckpointShard& s : t.shards()) {
      auto f = file_bytes.find(s.file());
      if (f == file_bytes.end() ||
          s.offset() + s.count() * sizeof(float) > f->second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", t.name(), "': a shard at bytes ", s.offset(), "+",
            s.count() * sizeof(float), " of '", s.file(),
            "', which is not a data file of this checkpoint or is shorter"));
      }
    }
  }
  return absl::OkStatus();
}

std::string CheckpointMetadataToJson(const v1::CheckpointMetadata& metadata) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = false;
  // Cannot fail: the message is ours and has no Any fields.
  auto printed =
      google::protobuf::util::MessageToJsonString(metadata, &json, options);
  (void)printed;
  return json;
}

absl::StatusOr<v1::CheckpointMetadata> CheckpointMetadataFromJson(
    absl::string_view json) {
  v1::CheckpointMetadata m;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;  // A newer writer's additions.
  auto parsed = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), &m, options);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata.json does not parse: ", parsed.message().ToString()));
  }
  if (absl::Status s = ValidateCheckpointMetadata(m); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata.json: ", s.message()));
  }
  return m;
}

}  // namespace cohort
