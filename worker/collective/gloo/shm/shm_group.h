// ShmGroup: collectives among the ranks of one host over one shared-memory
// segment, at memory speed: no socket, no syscall while peers keep up. It
// is the Gloo backend's transport among the ranks of a host
// (gloo_process_group.h). Three parts:
//  - the segment (segment.h): created by local rank 0, named in the store,
//    mapped by all; per rank a control block and two data slots;
//  - the barrier (futex_barrier.h): spins, then sleeps on futexes, and
//    sees a dead or stuck peer;
//  - the algorithms (this file), in rounds.
//
// A round. Each rank writes its share of the round into its own slot,
// arrives at a barrier, and then reads what it needs straight from its
// peers' slots: reductions read every rank's chunk in place and write the
// result to the caller's buffer (ReduceScatter) or to the reducing rank's
// own slot (AllReduce, Reduce), from which the others copy it. Every result
// element is combined by one rank, in one fixed order, so all ranks get the
// same bits.
//
// Failures. An op that fails other than by a check fails the group for
// every rank (ShmSegment::Fail): peers waiting in a barrier return within
// a slice, and later ops fail at once.
//
// Checks. With a non-empty `check` (the op engine's OpRun::check), every
// rank publishes it before the op's first barrier and compares the others'
// right after it, before any output is written: no exchange is spent on it.
//
// Thread-compatible: one op at a time, in the same order on every rank.
#ifndef COHORT_WORKER_COLLECTIVE_GLOO_SHM_SHM_GROUP_H_
#define COHORT_WORKER_COLLECTIVE_GLOO_SHM_SHM_GROUP_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/store.h"
#include "worker/collective/collective_op.h"
#include "worker/collective/gloo/shm/futex_barrier.h"
#include "worker/collective/gloo/shm/segment.h"

namespace cohort {

// The segment's options (timeout, which here bounds every op too,
// slot_bytes and group_ranks), and the barrier's spin.
struct ShmGroupOptions : ShmSegmentOptions {
  // How long a barrier spins before it sleeps. Negative: $COHORT_SHM_SPIN_US
  // if set, else 50 us when the group's ranks fit on the CPUs this process
  // may run on, else none.
  absl::Duration spin = absl::Microseconds(-1);
};

class ShmGroup {
 public:
  // Creates the segment of `size` local ranks (ShmSegment::Create: local
  // rank 0 publishes its name in `store` under `key`). Returns once all
  // have mapped it. DEADLINE_EXCEEDED naming the ranks that did not come
  // within the timeout; UNAVAILABLE if the segment cannot be created (the
  // message says why; the other ranks get the same error).
  static absl::StatusOr<std::unique_ptr<ShmGroup>> Create(
      Store& store, absl::string_view key, int rank, int size,
      const ShmGroupOptions& options);

  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  int rank() const { return segment_->rank(); }
  int size() const { return segment_->size(); }

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
  // every rank with it and writes nothing. Both wait for the local peers
  // (BroadcastFromLeader: for the leader) up to twice the timeout: a peer
  // may spend one waiting on other hosts before it has a status, which
  // names them (one that fails before ReduceToLeader tells the others
  // through Fail).
  absl::Status ReduceToLeader(const BufferView& data, ReduceOp op,
                              absl::string_view check);
  absl::Status BroadcastFromLeader(const BufferView& data,
                                   const absl::Status& leader_status);

  // Marks the group failed with `status`: peers waiting in a barrier return
  // UNAVAILABLE quoting it within a slice. Later ops fail at once.
  void Fail(const absl::Status& status) { segment_->Fail(status); }

  // Whether `status` (from Create) says the segment could not be set up on
  // this host at all (ShmSegment::IsSetupFailure): the local ranks may then
  // fall back to another transport together.
  static bool IsSetupFailure(const absl::Status& status) {
    return ShmSegment::IsSetupFailure(status);
  }

 private:
  ShmGroup(std::unique_ptr<ShmSegment> segment, absl::Duration spin);

  using Control = ShmSegment::Control;
  Control& control(int rank) const { return segment_->control(rank); }
  char* slot(int rank, uint32_t round) const {
    return segment_->slot(rank, round);
  }
  size_t slot_bytes() const { return segment_->options().slot_bytes; }

  // Starts an op: publishes `check` (and `aux`) for this op.
  void BeginOp(absl::string_view check, uint64_t aux);
  // Arrives at the next barrier and waits for every peer. After the op's
  // first barrier it compares the published checks.
  absl::Status Barrier();
  absl::Status CompareChecks();
  // The largest aux any rank published for this op (after its first
  // barrier).
  uint64_t MaxAux() const;
  // The next round: the slot half its data goes to. Every op takes its
  // first round before its first barrier (where a failed check stops it),
  // so all ranks always agree on the round.
  uint32_t NextRound() { return round_++; }
  // Fails the group with `status` unless it is a failed check.
  absl::Status FailUnlessChecked(absl::Status status);

  absl::Status AllReduceOrReduce(const BufferView& data, ReduceOp op,
                                 int root);  // root < 0: every rank.
  absl::Status Broadcast(const BufferView& data, int root);
  absl::Status AllGather(const CollectiveOp& op, bool to_root_only);
  absl::Status AllGatherV(const CollectiveOp& op);
  absl::Status Scatter(const CollectiveOp& op);
  absl::Status AllToAll(const CollectiveOp& op);
  absl::Status AllToAllV(const CollectiveOp& op);
  absl::Status ReduceScatter(const CollectiveOp& op);

  const std::unique_ptr<ShmSegment> segment_;
  const int rank_;
  const int size_;
  FutexBarrier barrier_;
  uint32_t round_ = 0;  // Data rounds so far (slot halves alternate).
  uint32_t ops_ = 0;    // Ops so far (checks alternate).
  bool check_pending_ = false;
  absl::Time deadline_;
};

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_GLOO_SHM_SHM_GROUP_H_
