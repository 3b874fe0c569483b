// Sharded checkpoints (docs/checkpoints.md): every rank writes its own
// pieces of the training state to one file of a step's folder on a shared
// filesystem, in parallel; rank 0 commits the step through cohortd once
// every rank's file is durable. Any world size reads it back, each rank
// only the element ranges it holds now (resharding).
//
//   CheckpointCatalog catalog(store, CheckpointPrefix(run_id));
//   auto writer = CheckpointWriter::Create(
//       {.dir = "/shared/ckpt", .rank = r, .world_size = n,
//        .catalog = &catalog}).value();
//   writer->SaveAsync(step, {{"unit0.param", {numel}, start, shard}});
//   ... training goes on while a thread writes; the next save, Wait() or
//   the destructor waits for it ...
//
//   auto reader = CheckpointReader::OpenLatest(catalog).value();  // or null
//   reader->Read("unit0.param", my_start, my_shard);
//
// Protocol of one save of step S (every rank calls it):
//   1. the rank's shards go to <dir>/step-S/rank-<r>.bin.tmp, which is
//      fsync'd and renamed to rank-<r>.bin, and the folder fsync'd;
//   2. the rank reports its part (file, shards, CRC-32s) to the store;
//   3. rank 0 waits for every part, writes metadata.json the same way
//      (tmp, fsync, rename, fsync), and commits: the step's record is
//      created in the store by one compare_set, and the highest step
//      committed is the latest;
//   4. the other ranks wait for the record, so a save that returns OK on
//      any rank is committed.
// A crash at any point leaves the previous checkpoint the latest: the
// step is not listed until step 3's record exists.
#ifndef COHORT_WORKER_CHECKPOINT_CHECKPOINT_H_
#define COHORT_WORKER_CHECKPOINT_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/checkpoint_catalog.h"

namespace cohort {

// Elements [start, start + data.size()) of the f32 tensor `name`, whose
// global shape is `shape`, as this rank saves them. Across the ranks of a
// save, a tensor's pieces must cover it exactly once.
struct ShardToSave {
  std::string name;
  std::vector<uint64_t> shape;
  uint64_t start = 0;
  absl::Span<const float> data;
};

struct CheckpointOptions {
  std::string dir;  // Step folders go here; the same path on every rank.
  int rank = 0;
  int world_size = 1;
  CheckpointCatalog* catalog = nullptr;  // Must outlive the writer.
  // Which attempt at the job this is (cohortrun's round): parts reported by
  // an earlier attempt that died mid-save are never mistaken for this one's.
  std::string attempt = "0";
  // How long rank 0 waits for every part, and the others for the commit.
  absl::Duration commit_timeout = absl::Minutes(5);
};

class CheckpointWriter {
 public:
  // INVALID_ARGUMENT for a missing dir or catalog or a rank outside the
  // world; the folder is created if missing (error naming it otherwise).
  static absl::StatusOr<std::unique_ptr<CheckpointWriter>> Create(
      const CheckpointOptions& options);
  // Waits for a save in flight (its error is lost; call Wait() first).
  ~CheckpointWriter();

  // Saves and commits step `step` (see the protocol above); returns once it
  // is committed. `attributes` (rank 0's) are kept in metadata.json.
  // ALREADY_EXISTS if the step is already committed; the store's or the
  // filesystem's error, naming the file, otherwise.
  absl::Status Save(int64_t step, const std::vector<ShardToSave>& shards,
                    const std::map<std::string, std::string>& attributes = {});

  // The same, asynchronously: copies the shards into one buffer (the
  // file's image) and returns; a thread of the writer writes and commits.
  // Waits for the previous save first and returns its error if it failed.
  absl::Status SaveAsync(
      int64_t step, const std::vector<ShardToSave>& shards,
      const std::map<std::string, std::string>& attributes = {});

  // Waits for the save in flight, if any; its status.
  absl::Status Wait();

  // Bytes of this rank's data files written so far, and the seconds spent
  // writing and committing them (in the background for SaveAsync).
  uint64_t bytes_written() const;
  double seconds_writing() const;

 private:
  struct State;
  explicit CheckpointWriter(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

class CheckpointReader {
 public:
  // Opens a checkpoint's folder by its metadata.json (INVALID_ARGUMENT or
  // NOT_FOUND naming the file). Does not ask whether it was committed.
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> Open(
      const std::string& folder);
  // The catalog's latest committed checkpoint; null when there is none.
  static absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenLatest(
      CheckpointCatalog& catalog);

  const v1::CheckpointMetadata& metadata() const { return metadata_; }
  int64_t step() const { return metadata_.step(); }
  int world_size() const { return metadata_.world_size(); }
  const std::string& folder() const { return folder_; }

  bool Has(absl::string_view name) const;
  // Elements of tensor `name` (NOT_FOUND if it has none).
  absl::StatusOr<uint64_t> Numel(absl::string_view name) const;

  // Elements [start, start + out.size()) of tensor `name` into `out`, from
  // whichever shards hold them, whatever the world size that wrote them.
  // Every shard read is checked against its CRC-32: DATA_LOSS naming the
  // file and tensor. NOT_FOUND for an unknown tensor, OUT_OF_RANGE for a
  // range past its end.
  absl::Status Read(absl::string_view name, uint64_t start,
                    absl::Span<float> out) const;

  // Reads every shard and checks its CRC-32.
  absl::Status Verify() const;

 private:
  CheckpointReader(std::string folder, v1::CheckpointMetadata metadata);
  // Reads `shard` into `out` (its size) and checks its CRC-32.
  absl::Status ReadShard(const v1::CheckpointTensor& tensor,
                         const v1::CheckpointShard& shard,
                         absl::Span<float> out) const;

  std::string folder_;
  v1::CheckpointMetadata metadata_;
  std::map<std::string, int, std::less<>> by_name_;
};

// [start, start + count) of a tensor of `numel` elements split as FSDP
// splits a flat unit: padded to a multiple of `world`, rank r holding
// ceil(numel / world) elements from r times that, clipped to numel.
struct ElementRange {
  uint64_t start = 0;
  uint64_t count = 0;
};
ElementRange EvenShard(uint64_t numel, int rank, int world);

// The pieces of tensors of `sizes`, laid end to end (an FSDP flat unit),
// that elements [start, start + count) of the concatenation cover: for
// each, the tensor, the first element in it, where the piece begins
// relative to `start`, and its length. Empty tensors yield no piece.
struct FlatPiece {
  int tensor = 0;
  uint64_t start = 0;
  uint64_t offset = 0;
  uint64_t count = 0;
};
std::vector<FlatPiece> SplitFlatRange(const std::vector<size_t>& sizes,
                                      uint64_t start, uint64_t count);

}  // namespace cohort

#endif  // COHORT_WORKER_CHECKPOINT_CHECKPOINT_H_
