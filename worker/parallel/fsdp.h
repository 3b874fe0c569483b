// FSDP: fully sharded data parallelism, as torch.distributed.fsdp. The
// model is split by the caller into units (groups of layers); each unit's
// parameters are flattened into one buffer, padded to a multiple of the
// world size, and every rank keeps only its 1/N slice (its shard) of the
// parameters, of the gradients and of the optimizer state.
// Framework-agnostic: the caller names its parameters by element count,
// unit by unit, and brackets each unit's forward and backward:
//
//   auto fsdp = cohort::Fsdp::Create(group, {{w0, b0}, {w1, b1}}, {}).value();
//   fsdp->LoadFromRank0(initial_values);                 // shards from rank 0
//   for (step...) {
//     for (u = 0 .. units-1) {                          // forward
//       fsdp->BeginForward(u);    // all_gathers unit u (prefetches u+1...)
//       Compute(fsdp->param(u, 0), fsdp->param(u, 1), ...);
//       fsdp->EndForward(u);      // FULL_SHARD frees unit u's full params
//     }
//     for (u = units-1 .. 0) {                          // backward
//       fsdp->BeginBackward(u);   // gathers again if freed (prefetches u-1...)
//       Gradients(fsdp->param(u, i), fsdp->grad(u, i));  // add into grad
//       fsdp->EndBackward(u);     // reduce_scatter(AVG) into the grad shard
//     }
//     fsdp->FinishBackward();     // every gradient shard final
//     fsdp->Step(*optimizer);     // each rank updates its shards only
//     fsdp->ZeroGrad();
//   }
//
// Strategies: FULL_SHARD frees a unit's full parameters after its forward
// (the last unit's stay for the backward that follows at once) and after its
// backward; SHARD_GRAD_OP keeps them from forward until after backward;
// NO_SHARD keeps full parameters, gradients and optimizer state on every
// rank and all_reduces (AVG) the gradients: DDP's arithmetic.
//
// Every rank calls the same sequence of these methods (they issue
// collectives). Methods that return a Status return FAILED_PRECONDITION for
// calls out of sequence (EndBackward without BeginBackward...) and the
// group's error when a collective fails.
//
// Device memory. On a group whose buffers are device memory (NCCL), every
// buffer (shards, gathered units, gradients, the optimizer's state) is on
// the group's device, and the span accessors point there: the caller's
// kernels read param() and write grad(), and the host must not dereference
// them. Accumulating the reduced gradients, zeroing and the optimizer step
// (Optimizer::StepIn) are kernels on the group's device; only
// LoadFromRank0's values and GatherFullParams' result cross to the host,
// because the caller holds them there.
//
// Caller bugs, as in ddp.h: methods that return a Status report them
// (INVALID_ARGUMENT, FAILED_PRECONDITION); the span accessors (param, grad,
// param_shard, grad_shard), which have no status to return, abort the
// process with a message naming the call when used outside their window or
// with an index out of range.
#ifndef COHORT_WORKER_PARALLEL_FSDP_H_
#define COHORT_WORKER_PARALLEL_FSDP_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "worker/collective/process_group.h"
#include "worker/parallel/optimizer.h"

namespace cohort {

enum class ShardingStrategy { kFullShard, kShardGradOp, kNoShard };

// "full_shard", "shard_grad_op", "no_shard" (INVALID_ARGUMENT otherwise).
absl::StatusOr<ShardingStrategy> ParseShardingStrategy(absl::string_view name);
absl::string_view ShardingStrategyName(ShardingStrategy strategy);

struct FsdpOptions {
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  // How many units ahead to gather while the current one computes: at
  // BeginForward(u), units u+1 .. u+prefetch_depth; at BeginBackward(u),
  // units u-1 .. u-prefetch_depth (those not already gathered or in
  // flight). 0 gathers each unit only when its Begin* needs it; 1 overlaps
  // one unit's gather with the current unit's compute; more keep more
  // gathers in flight, so a slow gather hides behind several units of
  // compute, at the cost of memory: under FULL_SHARD up to prefetch_depth
  // + 1 units' full parameters are held at once (peak_gathered_bytes()).
  // Which units are gathered depends only on the calls, never on timing,
  // so every rank issues the same collectives. INVALID_ARGUMENT if < 0.
  int prefetch_depth = 1;
};

// Bytes this rank holds, by kind. The persistent part (shards, or full
// tensors under NO_SHARD) lives for the whole run; the transient part is
// what gathering holds between Begin* and its free.
struct FsdpMemory {
  size_t param_bytes = 0;      // Parameter shards (padded).
  size_t grad_bytes = 0;       // Gradient shards.
  size_t optimizer_bytes = 0;  // The optimizer's state, as of the last Step.
  size_t gathered_param_bytes = 0;  // Full unit parameters held right now.
  size_t gathered_grad_bytes = 0;   // Full unit gradients held right now.
  size_t peak_bytes = 0;            // Highest sum of all of the above so far.
  // Highest gathered_param_bytes so far: what prefetch_depth costs.
  size_t peak_gathered_param_bytes = 0;

  size_t persistent_bytes() const {
    return param_bytes + grad_bytes + optimizer_bytes;
  }
};

class Fsdp {
 public:
  // `units[u]` lists the element counts of unit u's parameters (f32). A
  // collective: every rank calls it, and the ranks check that they all
  // passed the same units (VerifySameSizes). INVALID_ARGUMENT for no units,
  // an empty unit, a zero count, or ranks that disagree.
  static absl::StatusOr<std::unique_ptr<Fsdp>> Create(
      std::shared_ptr<ProcessGroup> group,
      std::vector<std::vector<size_t>> units, const FsdpOptions& options = {});

  // Waits for collectives still running.
  ~Fsdp();

  int num_units() const;
  int num_params(int unit) const;
  const FsdpOptions& options() const;
  ProcessGroup& group() const;

  // Unit u's flat size without padding, with padding, and per rank.
  size_t unpadded_elements(int unit) const;
  size_t padded_elements(int unit) const;
  size_t shard_elements(int unit) const;

  // Sets every parameter from rank 0's `values[u][i]` (other ranks' values
  // are ignored but must have the same sizes): rank 0's flat units are
  // broadcast and each rank keeps its shard. INVALID_ARGUMENT for sizes
  // that do not match the units.
  absl::Status LoadFromRank0(
      const std::vector<std::vector<absl::Span<const float>>>& values);

  absl::Status BeginForward(int unit);
  absl::Status EndForward(int unit);
  absl::Status BeginBackward(int unit);
  absl::Status EndBackward(int unit);
  // Waits for every gradient reduction of this backward and adds the
  // results into the gradient shards (which accumulate until ZeroGrad()).
  absl::Status FinishBackward();

  // Unit u's parameter i at full size. REQUIRES: between Begin* and the
  // free that follows (else the process aborts, see above).
  absl::Span<const float> param(int unit, int index) const;
  // Unit u's gradient i at full size, zero at BeginBackward; backward adds
  // into it. REQUIRES: between BeginBackward and EndBackward.
  absl::Span<float> grad(int unit, int index);

  // This rank's shard of unit u's flat parameters and gradients. REQUIRES:
  // 0 <= unit < num_units().
  absl::Span<float> param_shard(int unit);
  absl::Span<const float> grad_shard(int unit) const;
  // The same, writable: for what runs between FinishBackward and Step on
  // the reduced gradients (fp16's unscaling, loss_scaler.h).
  absl::Span<float> grad_shard(int unit);

  // optimizer.Step(u, param_shard(u), grad_shard(u)) for every unit u (in
  // the shards' memory: StepIn; the optimizer must not outlive the group).
  absl::Status Step(Optimizer& optimizer);
  // On a device group a failed zeroing makes the Fsdp unusable, and the
  // next call reports it.
  void ZeroGrad();
  // Whether the buffers are in device memory (the group's).
  bool on_device() const;

  // Unit u's full parameters, unpadded and flat, on every rank (an
  // all_gather; call it on every rank).
  absl::StatusOr<std::vector<float>> GatherFullParams(int unit);

  FsdpMemory memory() const;
  // The most bytes of full (gathered) unit parameters held at once since
  // Create, counting gathers in flight: memory().peak_gathered_param_bytes.
  size_t peak_gathered_bytes() const;
  // Bytes this rank has sent, by WireBytes() (process_group.h): per step,
  // (n-1)/n of the flat parameters twice (all_gathers for forward and
  // backward; once under SHARD_GRAD_OP) and of the gradients once
  // (reduce_scatter); 0 at world size 1.
  uint64_t bytes_communicated() const;

 private:
  struct State;
  explicit Fsdp(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace cohort

#endif  // COHORT_WORKER_PARALLEL_FSDP_H_
