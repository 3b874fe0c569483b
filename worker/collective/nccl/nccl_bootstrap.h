// How the ranks of an NCCL communicator meet through a cohort::Store: the
// root ranks publish their ncclUniqueIds, every rank reads them, and every
// rank marks its arrival so that an init that never completes can name the
// ranks that never came. Every step is bounded by one deadline, the same
// that then bounds NCCL's own init (nccl_process_group.h).
//
// Keys, under the store the caller passes (the group's prefix), for the
// communicator `comm` (a name fresh for every communicator: "comm/0",
// "comm/1", ...):
//   <comm>/unique_id/<i>   root i's ncclUniqueId (128 bytes)
//   <comm>/arrived/<rank>  set by each rank before it starts NCCL's init
#ifndef COHORT_WORKER_COLLECTIVE_NCCL_NCCL_BOOTSTRAP_H_
#define COHORT_WORKER_COLLECTIVE_NCCL_NCCL_BOOTSTRAP_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/store.h"
#include "worker/collective/nccl/nccl_api.h"

namespace cohort {

// The ranks that create the unique ids of a communicator of `size` ranks:
// one root for up to `ranks_per_root` ranks (NCCL's plain init), else
// ceil(size / ranks_per_root) roots (ncclCommInitRankScalable), root i at
// rank i * ceil(size / roots), so that each serves an equal share.
// REQUIRES: size >= 1, ranks_per_root >= 1.
std::vector<int> NcclRootRanks(int size, int ranks_per_root);

std::string NcclUniqueIdKey(absl::string_view comm, int root_index);
std::string NcclArrivedKey(absl::string_view comm, int rank);

// Publishes this rank's unique id if it is a root, marks its arrival, and
// returns every root's id in root order. DEADLINE_EXCEEDED at `deadline`
// naming the root ranks that did not publish theirs (and their keys); the
// store's or NCCL's error otherwise.
absl::StatusOr<std::vector<NcclUniqueId>> ExchangeNcclUniqueIds(
    NcclApi& api, Store& store, absl::string_view comm, int rank, int size,
    int ranks_per_root, absl::Time deadline);

// The ranks in [0, size) that have not marked their arrival for `comm`
// (for the error of an init that did not complete). Best effort: empty if
// the store cannot say.
std::vector<int> NcclMissingRanks(Store& store, absl::string_view comm,
                                  int size);

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_NCCL_NCCL_BOOTSTRAP_H_
