// Dynamic loss scaling for fp16 training, as torch.cuda.amp.GradScaler: the
// loss is multiplied by scale() before backward so that small gradients
// survive fp16's range; before the optimizer step the gradients are
// unscaled and checked for inf or NaN on every rank, and a step whose
// gradients overflowed anywhere is skipped everywhere; the scale backs off
// on an overflow and grows after growth_interval clean steps.
//
//   auto scaler = cohort::LossScaler::Create({}).value();
//   backward(loss * scaler.scale());
//   bool skip = scaler.UnscaleAndCheck(grads, group.get()).value();
//   if (!skip) optimizer.Step(...);
//   scaler.Update(skip);
#ifndef COHORT_WORKER_PARALLEL_LOSS_SCALER_H_
#define COHORT_WORKER_PARALLEL_LOSS_SCALER_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/collective/process_group.h"

namespace cohort {

// torch.cuda.amp.GradScaler's defaults.
struct LossScalerOptions {
  float init_scale = 65536.0f;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int growth_interval = 2000;
};

class LossScaler {
 public:
  // INVALID_ARGUMENT naming the option: init_scale must be finite and > 0,
  // growth_factor > 1, backoff_factor in (0, 1), growth_interval >= 1.
  static absl::StatusOr<LossScaler> Create(const LossScalerOptions& options);

  float scale() const { return scale_; }

  // Multiplies every gradient by 1 / scale() in place, then says whether
  // any gradient on any rank of `group` is inf or NaN (one all_reduce MAX
  // of a flag; `group` null: this process alone). Every rank gets the same
  // answer, so all skip the step together. The group's error if the
  // all_reduce fails.
  absl::StatusOr<bool> UnscaleAndCheck(const std::vector<absl::Span<float>>& grads,
                                       ProcessGroup* group);

  // After the step, or its skip: an overflow multiplies the scale by
  // backoff_factor and restarts the count of clean steps; growth_interval
  // clean steps in a row multiply it by growth_factor.
  void Update(bool found_inf);

  int64_t skipped_steps() const { return skipped_; }
  // Clean steps in a row since the last overflow or growth.
  int clean_steps() const { return clean_steps_; }

  // Resumes from a checkpoint's scale() and clean_steps().
  // INVALID_ARGUMENT for a scale that is not finite and > 0, or clean steps
  // outside [0, growth_interval).
  absl::Status Restore(float scale, int clean_steps);

 private:
  explicit LossScaler(const LossScalerOptions& options);

  LossScalerOptions options_;
  float scale_;
  int clean_steps_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace cohort

#endif  // COHORT_WORKER_PARALLEL_LOSS_SCALER_H_
