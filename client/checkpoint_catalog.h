// The store's side of cohort's sharded checkpoints (docs/checkpoints.md):
// each rank's report of what it durably wrote, the commit that makes a
// checkpoint the run's latest, and the list of committed checkpoints that
// `cohortctl checkpoints` prints. The files themselves are written and read
// by worker/checkpoint.
//
// Keys, under a run's prefix (CheckpointPrefix(run)):
//   parts/<step>/<attempt>/<rank>
//                         a CheckpointPart, set by the rank once its data
//                         file is on disk, fsync included (<attempt> keeps
//                         an earlier try at the step, which died, apart);
//   committed/<step>      a CheckpointRecord, created by the committer with
//                         one compare_set once every part is reported and
//                         metadata.json is durable: that single atomic
//                         write is the commit, and the checkpoint exists
//                         from then on.
// <step> is 12 decimal digits, so keys list in step order, and the latest
// checkpoint is the last key under committed/. Values are binary protobuf
// (proto/cohort/v1/checkpoint.proto).
//
// A crash anywhere before the compare_set leaves the previous checkpoint
// the latest; a folder on disk without its record is not a checkpoint,
// whatever files it holds.
#ifndef COHORT_CLIENT_CHECKPOINT_CATALOG_H_
#define COHORT_CLIENT_CHECKPOINT_CATALOG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/store.h"
#include "cohort/v1/checkpoint.pb.h"

namespace cohort {

// "runs/<run>/checkpoints/": covered by the token cohortrun mints its
// workers for the run.
std::string CheckpointPrefix(absl::string_view run_id);

// "step-000000000120": a checkpoint's folder name.
std::string CheckpointFolderName(int64_t step);

class CheckpointCatalog {
 public:
  // `store` must outlive the catalog.
  CheckpointCatalog(Store* store, std::string prefix);

  const std::string& prefix() const { return prefix_; }

  absl::Status ReportPart(int64_t step, absl::string_view attempt,
                          const v1::CheckpointPart& part);

  // Blocks until all `world_size` parts of `step` are reported; returns
  // them by rank. DEADLINE_EXCEEDED naming the ranks that never reported;
  // DATA_LOSS for a part that does not parse or names another rank.
  absl::StatusOr<std::vector<v1::CheckpointPart>> WaitForParts(
      int64_t step, absl::string_view attempt, int world_size,
      absl::Duration timeout);

  // Whether `step` is committed; and blocking until it is
  // (DEADLINE_EXCEEDED saying so).
  absl::StatusOr<bool> IsCommitted(int64_t step);
  absl::Status WaitCommitted(int64_t step, absl::Duration timeout);

  // Commits `record`: creates committed/<step> with one compare_set.
  // ALREADY_EXISTS if the step was committed with another record (a
  // commit of the same record again is OK).
  absl::Status Commit(const v1::CheckpointRecord& record);

  // The committed checkpoint of the highest step; nullopt when there is
  // none.
  absl::StatusOr<std::optional<v1::CheckpointRecord>> Latest();

  // Every committed checkpoint, oldest step first.
  absl::StatusOr<std::vector<v1::CheckpointRecord>> List();

  // Drops the parts reported for `step` by every attempt (after its
  // commit); its record, if committed, stays.
  absl::Status ForgetParts(int64_t step);

 private:
  std::string PartsPrefix(int64_t step) const;
  std::string CommittedKey(int64_t step) const;

  Store* const store_;
  const std::string prefix_;
};

// metadata.json's contents from every rank's part: the tensors' shards
// merged and sorted by start. INVALID_ARGUMENT, naming the tensor and the
// ranks, if the parts disagree on a tensor's dtype or shape, or its
// shards overlap or leave a gap.
absl::StatusOr<v1::CheckpointMetadata> MergeCheckpointParts(
    int64_t step, int world_size, std::vector<v1::CheckpointPart> parts,
    absl::Time created);

// Checks a metadata's own consistency (format, shards covering each tensor
// exactly, files named), as MergeCheckpointParts leaves it.
absl::Status ValidateCheckpointMetadata(const v1::CheckpointMetadata& m);

// protobuf's JSON mapping, indented; and back (INVALID_ARGUMENT with the
// parser's message, or what ValidateCheckpointMetadata finds).
std::string CheckpointMetadataToJson(const v1::CheckpointMetadata& metadata);
absl::StatusOr<v1::CheckpointMetadata> CheckpointMetadataFromJson(
    absl::string_view json);

// The product of the shape (1 for a scalar).
uint64_t CheckpointNumel(const v1::CheckpointTensor& tensor);

}  // namespace cohort

#endif  // COHORT_CLIENT_CHECKPOINT_CATALOG_H_
