// ShmSegment: the shared memory of one ShmGroup (shm_group.h), mapped by
// every local rank of the group.
//
// Its life. The group's local rank 0 creates it (shm_open, name
// "/cohort.<pid>.<random>", reserved with posix_fallocate so that a full
// /dev/shm fails here and not with SIGBUS later), publishes the name in the
// store under the key it is given, and removes the name as soon as every
// local rank has mapped it: from then on the memory lives exactly as long
// as the mappings, so a rank killed with -9 leaves nothing in /dev/shm. A
// name whose creator died before that point is removed by the next group
// created on the host (RemoveStaleSegments).
//
// The layout: a header (the group's size and slot size, how many ranks
// have attached, and the group's failure), then per rank a Control block
// (its barrier words, futex_barrier.h, and what it publishes for the op at
// hand) and two data slots of slot_bytes, used alternately by consecutive
// rounds so that a rank may fill the next round's slot while a slower peer
// still reads the last one.
#ifndef COHORT_WORKER_COLLECTIVE_GLOO_SHM_SEGMENT_H_
#define COHORT_WORKER_COLLECTIVE_GLOO_SHM_SEGMENT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/store.h"
#include "worker/collective/gloo/shm/futex_barrier.h"

namespace cohort {

struct ShmSegmentOptions {
  // Bounds the creation (and, in a ShmGroup, every op).
  absl::Duration timeout = absl::Seconds(300);
  // Bytes per slot (each rank has two); a multiple of 4096, at least 4096.
  // A round moves at most this much per rank, so larger slots mean fewer
  // barriers per byte.
  size_t slot_bytes = size_t{1} << 20;
  // The number of each local rank in the enclosing group, for messages
  // ("rank 5 (pid 123) exited"). Empty: local ranks are the group's ranks.
  std::vector<int> group_ranks;
};

class ShmSegment {
 public:
  // The longest op check (with its NUL) and leader's note a rank publishes.
  static constexpr size_t kCheckBytes = 128;
  // The header's page; the control blocks follow it, and the slots follow
  // them on a page boundary.
  static constexpr size_t kPage = 4096;

  // One local rank's block: its barrier words and, per op (alternating
  // between two, so that a rank may publish the next op's while a slow
  // peer still reads the last one's), what it publishes before the op's
  // first barrier.
  struct alignas(64) Control {
    BarrierWords barrier;
    uint64_t aux[2];
    int32_t status_code[2];
    char note[2][kCheckBytes];
    char check[2][kCheckBytes];
  };

  // Local rank 0 creates the segment and publishes its name in `store`
  // under `key`; the others open it. Returns once all `size` local ranks
  // have mapped it. INVALID_ARGUMENT for a bad rank or options;
  // DEADLINE_EXCEEDED naming the ranks that did not come within the
  // timeout; UNAVAILABLE if the segment cannot be created (the message
  // says why; the other ranks get the same error, IsSetupFailure) or a rank
  // cannot map it (local rank 0 is told at once and names it).
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Create(
      Store& store, absl::string_view key, int rank, int size,
      const ShmSegmentOptions& options);

  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const ShmSegmentOptions& options() const { return options_; }

  // Inline: the algorithms call these in every round.
  Control& control(int rank) const {
    return reinterpret_cast<Control*>(static_cast<char*>(base_) + kPage)[rank];
  }
  // Local rank `rank`'s slot for data round `round` (slots alternate).
  char* slot(int rank, uint32_t round) const {
    return static_cast<char*>(base_) + data_offset_ +
           (2 * static_cast<size_t>(rank) + (round & 1)) * options_.slot_bytes;
  }
  // Local rank `local`'s number in the enclosing group.
  int GroupRank(int local) const;

  // Marks the group failed with `status` (the first failure is kept) and
  // wakes every rank sleeping in a barrier.
  void Fail(const absl::Status& status);
  // OK while no rank has failed the group; else the first failure's code
  // with "the shared-memory group failed<when>: <why>".
  absl::Status FailedStatus(absl::string_view when) const;

  // Whether `status` (from Create) says the segment could not be set up on
  // this host at all (no /dev/shm, full, not permitted), as all local ranks
  // learn alike: they may then fall back to another transport together.
  static bool IsSetupFailure(const absl::Status& status);

  // Removes /dev/shm/cohort.<pid>.* names whose creator no longer exists
  // and that are older than a minute; returns how many.
  static int RemoveStaleSegments();

 private:
  struct Header;

  ShmSegment(int rank, int size, const ShmSegmentOptions& options, void* base,
             size_t bytes);

  // Local rank 0's part of Create, then the others'.
  static absl::StatusOr<std::unique_ptr<ShmSegment>> CreateAsLeader(
      Store& store, absl::string_view key, int size,
      const ShmSegmentOptions& options, absl::Time deadline);
  static absl::StatusOr<std::unique_ptr<ShmSegment>> OpenAsPeer(
      Store& store, absl::string_view key, int rank, int size,
      const ShmSegmentOptions& options, absl::Time deadline);
  // Maps local rank 0's segment `name` and checks that it is this group's.
  static absl::StatusOr<std::unique_ptr<ShmSegment>> Map(
      const std::string& name, int rank, int size,
      const ShmSegmentOptions& options);

  // Local rank 0: waits until every rank has attached, or one said under
  // `key`/failed that it cannot, or the deadline.
  absl::Status AwaitPeersAttached(Store& store, absl::string_view key,
                                  const std::string& name, absl::Time deadline);
  // The others: attaches, and waits until every rank has, or local rank 0
  // gave up, or the deadline.
  absl::Status AttachAndAwaitPeers(absl::Time deadline);

  Header& header() const;

  const int rank_;
  const int size_;
  const ShmSegmentOptions options_;
  void* const base_;
  const size_t bytes_;
  const size_t data_offset_;  // Where the slots begin.
};

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_GLOO_SHM_SEGMENT_H_
