// The training loop of the example trainer (train.cc), as a library so that
// tests can run it at several world sizes and compare the results: an Mlp
// learns a teacher network's outputs with SGD or Adam, in one of the modes
// below. Every data-parallel mode computes the same global batch's mean
// gradient, so all of them should end with the same parameters up to
// floating-point rounding.
#ifndef COHORT_WORKER_PARALLEL_EXAMPLES_TRAINER_H_
#define COHORT_WORKER_PARALLEL_EXAMPLES_TRAINER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/collective/process_group.h"
#include "worker/collective/trace/timeline.h"
#include "worker/parallel/loss_scaler.h"
#include "worker/parallel/mixed_precision.h"

namespace cohort::examples {

enum class TrainMode {
  kLocal,        // One process, the whole global batch, no group.
  kDdp,          // Replicas; gradients all_reduced by the Reducer.
  kFsdp,         // FULL_SHARD, one unit per layer.
  kFsdpGradOp,   // SHARD_GRAD_OP.
  kFsdpNoShard,  // NO_SHARD.
  kComputeOnly,  // Each rank its share of the batch, no communication at
                 // all (wrong results; the benchmark's compute baseline).
};

// "local", "ddp", "fsdp", "fsdp_grad_op", "fsdp_no_shard", "compute_only".
absl::StatusOr<TrainMode> ParseTrainMode(absl::string_view name);
absl::string_view TrainModeName(TrainMode mode);

struct TrainConfig {
  TrainMode mode = TrainMode::kDdp;
  // The student network; the teacher shares its first and last dims.
  std::vector<int> dims = {64, 512, 512, 512, 16};
  std::vector<int> teacher_dims = {64, 128, 16};
  size_t samples = 16384;
  // Samples per optimizer step across all ranks; each rank takes
  // global_batch / world of them. Must divide by world * grad_accum.
  int global_batch = 128;
  int steps = 30;
  uint64_t seed = 7;
  std::string optimizer = "sgd";  // "sgd" (with momentum) or "adam".
  float lr = 0.05f;
  float momentum = 0.9f;
  // Adam's epsilon, added to the root of the second moment (torch's 1e-8).
  float adam_eps = 1e-8f;
  // Micro-batches per step. DDP runs all but the last under no_sync.
  int grad_accum = 1;
  // How often to compute (all_reduce) and report the global loss; the
  // first and last steps always report.
  int log_every = 1;
  // DDP.
  size_t first_bucket_bytes = size_t{1} << 20;
  size_t bucket_cap_bytes = size_t{25} << 20;
  bool overlap = true;
  std::string comm_hook = "none";  // "none", "fp16", "bf16" or "powersgd".
  // PowerSGD's rank and the steps of plain all_reduce before it starts.
  int powersgd_rank = 1;
  int powersgd_start_step = 10;
  // Compute precision (mixed_precision.h): the parameters forward and
  // backward use are rounded copies of the f32 master weights, activations
  // and gradients are rounded as they are produced, the reductions and the
  // optimizer (and its state) stay f32. fp16 scales the loss dynamically
  // (loss_scaler, as torch's GradScaler): a step whose gradients overflowed
  // on any rank is skipped on every rank.
  Precision precision = Precision::kF32;
  LossScalerOptions loss_scaler;
  // A fault drill for fp16: rank inject_inf_rank writes an inf into its
  // first gradient at step inject_inf_step (0: never).
  int inject_inf_step = 0;
  int inject_inf_rank = 0;
  // FSDP: units gathered ahead of the one computing (FsdpOptions).
  int fsdp_prefetch = 1;
  // Checkpoints (docs/checkpoints.md). With a writer, the parameters and
  // the optimizer's state are saved every checkpoint_every steps (> 0) and
  // after the last step, asynchronously unless checkpoint_async is false;
  // Train returns once the last save is committed. With resume_from,
  // training starts after the checkpoint's step with its parameters,
  // optimizer state and place in the data, whatever the world size that
  // saved it, so the loss curve continues where it left off.
  CheckpointWriter* checkpoint_writer = nullptr;
  int checkpoint_every = 0;
  bool checkpoint_async = true;
  const CheckpointReader* resume_from = nullptr;
  // A timeline (worker/collective/trace/timeline.h) to add this rank's
  // compute spans to: per step a "step" span (the whole iteration, loss
  // report and checkpoint included) and inside it "data", per layer
  // "forward" and "backward", "loss" and "optimizer", each around compute
  // alone (never around a wait for a collective, so that a wait shows as a
  // gap beside the comm span it waits for). Null: none, at no cost.
  Timeline* timeline = nullptr;
};

struct TrainReport {
  std::vector<int> logged_steps;  // 1-based steps whose loss was reported.
  std::vector<float> losses;      // The global mean loss at those steps.
  std::vector<float> params;      // All final parameters, flat, every rank.
  double checksum = 0;            // Their sum.
  double seconds = 0;             // Wall time of all steps.
  double steps_per_second = 0;    // Over steps 2.. (the first allocates).
  uint64_t comm_bytes = 0;        // Gradient and parameter traffic, this rank.
  // Bytes this rank held for the model: parameters, gradients, optimizer
  // state, and the most held at once (FSDP's gathered units included).
  size_t param_bytes = 0;
  size_t grad_bytes = 0;
  size_t optimizer_bytes = 0;
  size_t peak_bytes = 0;
  // FSDP: the most bytes of gathered (full) unit parameters held at once.
  size_t peak_gathered_bytes = 0;
  // The checkpoint step training resumed after (0: from the start), the
  // saves made, and the seconds the step loop spent in them (for an async
  // save: copying the shards).
  int resumed_after = 0;
  // fp16: the steps skipped because a gradient overflowed, and the loss
  // scale at the end (0 without loss scaling).
  std::vector<int> skipped_steps;
  float loss_scale = 0;
  int checkpoints_saved = 0;
  double checkpoint_stall_seconds = 0;
};

// Trains per `config` as rank group->rank() of group->size() (`group` may be
// null for kLocal and kComputeOnly, meaning rank 0 of 1). `on_log` is called
// for each reported step. INVALID_ARGUMENT for an inconsistent config; the
// group's error if a collective fails.
absl::StatusOr<TrainReport> Train(
    const TrainConfig& config, std::shared_ptr<ProcessGroup> group,
    const std::function<void(int step, float loss)>& on_log = nullptr);

}  // namespace cohort::examples

#endif  // COHORT_WORKER_PARALLEL_EXAMPLES_TRAINER_H_
