// Element-wise optimizers over f32 tensors: SGD (with momentum) and Adam,
// with torch.optim's update rules. Because every update is element-wise, an
// optimizer stepping a shard of a tensor (FSDP) produces exactly the values
// it would produce for that slice of the whole tensor (DDP, one process).
//
//   auto sgd = cohort::NewSgd({.lr = 0.05f, .momentum = 0.9f}).value();
//   for (int i = 0; i < num_params; ++i) sgd->Step(i, params[i], grads[i]);
#ifndef COHORT_WORKER_PARALLEL_OPTIMIZER_H_
#define COHORT_WORKER_PARALLEL_OPTIMIZER_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "worker/parallel/group_memory.h"

namespace cohort {

struct SgdOptions {
  float lr = 0.01f;
  // torch.optim.SGD: buf = momentum * buf + grad (buf = grad on the first
  // step); param -= lr * buf. 0 keeps no state.
  float momentum = 0.0f;
  // Added to the gradient as weight_decay * param before the update.
  float weight_decay = 0.0f;
};

struct AdamOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // L2, as torch.optim.Adam (not AdamW).
};

// One slot's state as a checkpoint holds it, in host memory: the steps
// taken and the state buffers, one per Optimizer::state_names(), each of
// `size` elements.
struct OptimizerSlotState {
  long long step = 0;
  size_t size = 0;
  std::vector<std::vector<float>> buffers;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // Updates `params` in place from `grads`. `slot` names the tensor (or
  // shard) across steps: its state is created on first use, sized to it,
  // and every later Step of the slot must pass the same size.
  // INVALID_ARGUMENT if the sizes differ from each other or from the slot's
  // state, or the slot is negative.
  virtual absl::Status Step(int slot, absl::Span<float> params,
                            absl::Span<const float> grads) = 0;

  // The same step on `count` f32 at `params` and `grads` in `memory` (on
  // an NCCL group's device memory: the slot's state is allocated on the
  // device and the update runs as a kernel on the group's device, nothing
  // on the host). Step() is StepIn over host memory. A slot's state stays
  // in the memory of its first step (for an imported slot, of its first
  // step after the import: host state imported is moved there, allocated
  // and copied once): INVALID_ARGUMENT for a step of it in another, or null
  // buffers. The memory must outlive the optimizer.
  virtual absl::Status StepIn(GroupMemory& memory, int slot, float* params,
                              const float* grads, size_t count) = 0;

  // Bytes of state held for all slots (momentum buffers, Adam's moments).
  virtual size_t state_bytes() const = 0;

  virtual absl::string_view name() const = 0;

  // The state buffers each slot keeps, by name: torch.optim's
  // ("momentum_buffer" for SGD with momentum, none without; "exp_avg" and
  // "exp_avg_sq" for Adam).
  virtual std::vector<std::string> state_names() const = 0;
  // Slots that have state (stepped or imported), ascending.
  virtual std::vector<int> slots() const = 0;
  // A copy of the slot's state in host memory; state in device memory is
  // copied to the host (DeviceMemory::CopyToHost: REQUIRES no op in flight
  // on it, which holds between steps). NOT_FOUND for a slot that has none;
  // the device's error if the copy fails.
  virtual absl::StatusOr<OptimizerSlotState> ExportSlot(int slot) const = 0;
  // Creates or replaces the slot's state in host memory, so that the next
  // Step (or StepIn) of the slot continues as the one that exported it
  // would have; that step's memory, a device's too, becomes the state's
  // (see StepIn). INVALID_ARGUMENT for a negative slot, or buffers that are
  // not one per state name of `size` elements each.
  virtual absl::Status ImportSlot(int slot,
                                  const OptimizerSlotState& state) = 0;
};

// INVALID_ARGUMENT naming the option for a negative or non-finite lr,
// momentum or weight_decay, betas outside [0, 1), or eps <= 0.
absl::StatusOr<std::unique_ptr<Optimizer>> NewSgd(const SgdOptions& options);
absl::StatusOr<std::unique_ptr<Optimizer>> NewAdam(const AdamOptions& options);

}  // namespace cohort

#endif  // COHORT_WORKER_PARALLEL_OPTIMIZER_H_
