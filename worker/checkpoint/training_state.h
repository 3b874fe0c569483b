// A data-parallel model's training state in a checkpoint, the same for DDP
// replicas and FSDP shards, so that either loads what the other saved at
// any world size:
//   param.<i>               parameter i of the model, whole (shape {size});
//   param.<i>.<state>       its optimizer state, by Optimizer::state_names();
//   attributes optimizer = the optimizer's name, optimizer.step = the steps
//   it has taken (every slot of these trainers steps together), plus the
//   caller's `extra` attributes (a loss scaler's state, say), which must
//   not reuse those two names.
// An FSDP on device memory (NCCL) is staged through host memory: each
// unit's parameter shard is copied to the host to save and read into a
// host buffer to load, then copied to the device at once; the optimizer
// exports its device state to the host, and state imported on load moves
// to the device at the first Step (optimizer.h). Call them between steps,
// when no collective of the Fsdp is in flight.
#ifndef COHORT_WORKER_CHECKPOINT_TRAINING_STATE_H_
#define COHORT_WORKER_CHECKPOINT_TRAINING_STATE_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/parallel/fsdp.h"
#include "worker/parallel/optimizer.h"

namespace cohort {

// Replicas (DDP, or one process): every rank holds every parameter, and
// rank r writes those with i % world == r. Optimizer slot i is parameter i.
// `async` saves with SaveAsync (the writer copies before returning).
absl::Status SaveReplicaState(
    CheckpointWriter& writer, bool async, int64_t step, int rank, int world,
    const std::vector<std::vector<float>>& params, const Optimizer& optimizer,
    const std::map<std::string, std::string>& extra = {});

// Fills every parameter (sized as the model's) and the optimizer's slots.
// INVALID_ARGUMENT naming the tensor if the checkpoint's sizes differ;
// FAILED_PRECONDITION if it was saved with another optimizer.
absl::Status LoadReplicaState(const CheckpointReader& reader,
                              std::vector<std::vector<float>>& params,
                              Optimizer& optimizer);

// FSDP: unit u holds the next fsdp.num_params(u) parameters of
// `param_sizes`, in order; each rank writes the part of each parameter its
// shard holds. Optimizer slot u is unit u's shard.
absl::Status SaveFsdpState(
    CheckpointWriter& writer, bool async, int64_t step, Fsdp& fsdp,
    const std::vector<size_t>& param_sizes, const Optimizer& optimizer,
    const std::map<std::string, std::string>& extra = {});

// Fills this rank's shards, re-cut for the current world size, and the
// optimizer's slots, from a checkpoint saved by FSDP or by replicas. Call
// it instead of LoadFromRank0, on every rank (no collective is issued).
absl::Status LoadFsdpState(const CheckpointReader& reader, Fsdp& fsdp,
                           const std::vector<size_t>& param_sizes,
                           Optimizer& optimizer);

}  // namespace cohort

#endif  // COHORT_WORKER_CHECKPOINT_TRAINING_STATE_H_
