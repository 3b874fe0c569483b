// ShmGroup: collectives among the ranks of one host over one shared-memory
// segment, at memory speed: no socket, no syscall while peers keep up.
//
// The segment. The group's local rank 0 creates it (shm_open, name
// "/cohort.<pid>.<random>", reserved with posix_fallocate so that a full
// /dev/shm fails here and not with SIGBUS later), publishes the name in the
// store under the key it is given, and removes the name as soon as every
// local rank has mapped it: from then on the memory lives exactly as long as
// the mappings, so a rank killed with -9 leaves nothing in /dev/shm. A name
// whose creator died before that point is removed by the next group created
// on the host (RemoveStaleSegments).
//
// The layout: a header, then per rank a control block (its barrier counter,
// which is also the futex its peers sleep on, its pid, and the op check it
// publishes) and two data slots of slot_bytes, used alternately by
// consecutive rounds so that a rank may fill the next round's slot while a
// slower peer still reads the last one.
//
// A round. Each rank writes its share of the round into its own slot,
// arrives at a barrier, and then reads what it needs straight from its
// peers' slots: reductions read every rank's chunk in place and write the
// result to the caller's buffer (ReduceScatter) or to the reducing rank's
// own slot (AllReduce, Reduce), from which the others copy it. Every result
// element is combined by one rank, in one fixed order, so all ranks get the
// same bits.
//
// Waiting. A barrier spins for a bounded time (when the ranks of the group
// fit on the host's CPUs; otherwise it yields at once), then sleeps on the
// peer's counter with futex(2) in slices of at most 20 ms, checking between
// slices whether the peer's process still exists, whether any rank marked
// the group failed, and the op's deadline. So a dead peer is seen within a
// slice, a stuck one within the timeout, and 4 ranks on 2 cores progress.
//
// Checks. With a non-empty `check` (the op engine's OpRun::check), every
// rank publishes it before the op's first barrier and compares the others'
// right after it, before any output is written: no exchange is spent on it.
//
// Thread-compatible: one op at a time, in the same order on every rank.
#ifndef COHORT_WORKER_COLLECTIVE_SHM_SHM_GROUP_H_
#define COHORT_WORKER_COLLECTIVE_SHM_SHM_GROUP_H_

#include <sys/types.h>

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
#include "worker/collective/collective_op.h"

namespace cohort {

struct ShmGroupOptions {
  // Bounds every op and the creation.
  absl::Duration timeout = absl::Seconds(300);
  // Bytes per slot (each rank has two); a multiple of 4096, at least 4096.
  // A round moves at most this much per rank, so larger slots mean fewer
  // barriers per byte.
  size_t slot_bytes = size_t{1} << 20;
  // How long a barrier spins before it sleeps. Negative: $COHORT_SHM_SPIN_US
  // if set, else 50 us when the group's ranks fit on the CPUs this process
  // may run on, else none.
  absl::Duration spin = absl::Microseconds(-1);
  // The number of each local rank in the enclosing group, for messages
  // ("rank 5 (pid 123) exited"). Empty: local ranks are the group's ranks.
  std::vector<int> group_ranks;
};

class ShmGroup {
 public:
  // Local rank 0 creates the segment and publishes its name in `store`
  // under `key`; the others open it. Returns once all `size` local ranks
  // have mapped it. DEADLINE_EXCEEDED naming the ranks that did not come
  // within the timeout; UNAVAILABLE if the segment cannot be created (the
  // message says why; the other ranks get the same error).
  static absl::StatusOr<std::unique_ptr<ShmGroup>> Create(
      Store& store, absl::string_view key, int rank, int size,
      const ShmGroupOptions& options);

  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }

  // Runs `op` (checked, with more than one rank, host buffers; kAvg
  // combines as kSum) among the local ranks, which are the op's whole
  // group. `check`: see above. OK, INVALID_ARGUMENT when the ranks' checks
  // differ, or DEADLINE_EXCEEDED / UNAVAILABLE (then the group is failed
  // for every rank).
  absl::Status Run(const CollectiveOp& op, absl::string_view check);

  // The two halves of a hierarchical all-reduce. ReduceToLeader leaves the
  // `op` of every local rank's `data` in local rank 0's `data` (the others'
  // is untouched). BroadcastFromLeader copies local rank 0's `data` to the
  // others, or, when `leader_status` (local rank 0's) is not OK, fails
  // every rank with it and writes nothing.
  absl::Status ReduceToLeader(const BufferView& data, ReduceOp op,
                              absl::string_view check);
  absl::Status BroadcastFromLeader(const BufferView& data,
                                   const absl::Status& leader_status);

  // Marks the group failed with `status`: peers waiting in a barrier return
  // UNAVAILABLE quoting it within a slice. Later ops fail at once.
  void Fail(const absl::Status& status);

  // Whether `status` (from Create) says the segment could not be set up on
  // this host at all (no /dev/shm, full, not permitted), as all local ranks
  // learn alike: they may then fall back to another transport together.
  static bool IsSetupFailure(const absl::Status& status);

  // Removes /dev/shm/cohort.<pid>.* names whose creator no longer exists
  // and that are older than a minute; returns how many.
  static int RemoveStaleSegments();

 private:
  struct Header;
  struct Control;

  ShmGroup(int rank, int size, const ShmGroupOptions& options, void* base,
           size_t bytes);

  Header& header() const;
  Control& control(int rank) const;
  char* slot(int rank, uint32_t round) const;
  int GroupRank(int local) const;
  // Once every local rank has mapped the segment: records pid_visible_.
  void NotePeers();

  // Starts an op: publishes `check` (and `aux`) for this op.
  void BeginOp(absl::string_view check, uint64_t aux);
  // Arrives at the next barrier and waits for every peer. After the op's
  // first barrier it compares the published checks.
  absl::Status Barrier();
  absl::Status AwaitPeer(int peer, uint32_t generation);
  absl::Status CompareChecks();
  // The status an op gets once the group has failed.
  absl::Status FailedStatus(absl::string_view when) const;
  // The largest aux any rank published for this op (after its first
  // barrier).
  uint64_t MaxAux() const;
  // The next round: the slot half its data goes to. Every op takes its
  // first round before its first barrier (where a failed check stops it),
  // so all ranks always agree on the round.
  uint32_t NextRound() { return round_++; }

  absl::Status AllReduceOrReduce(const BufferView& data, ReduceOp op,
                                 int root);  // root < 0: every rank.
  absl::Status Broadcast(const BufferView& data, int root);
  absl::Status AllGather(const CollectiveOp& op, bool to_root_only);
  absl::Status AllGatherV(const CollectiveOp& op);
  absl::Status Scatter(const CollectiveOp& op);
  absl::Status AllToAll(const CollectiveOp& op);
  absl::Status AllToAllV(const CollectiveOp& op);
  absl::Status ReduceScatter(const CollectiveOp& op);

  const int rank_;
  const int size_;
  const ShmGroupOptions options_;
  void* const base_;
  const size_t bytes_;
  const absl::Duration spin_;

  // Per local rank: whether its pid is visible from here, so that its
  // exit can be seen (ranks in another pid namespace, e.g. other
  // containers sharing /dev/shm, are waited for until the deadline only).
  std::vector<bool> pid_visible_;
  uint32_t generation_ = 0;  // Barriers this rank has arrived at.
  uint32_t round_ = 0;       // Data rounds so far (slot halves alternate).
  uint32_t ops_ = 0;         // Ops so far (checks alternate).
  bool check_pending_ = false;
  absl::Time deadline_;
};

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_SHM_SHM_GROUP_H_
