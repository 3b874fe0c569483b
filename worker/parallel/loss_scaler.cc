#include "worker/parallel/loss_scaler.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace cohort {

LossScaler::LossScaler(const LossScalerOptions& options)
    : options_(options), scale_(options.init_scale) {}

absl::StatusOr<LossScaler> LossScaler::Create(const LossScalerOptions& o) {
  if (!std::isfinite(o.init_scale) || o.init_scale <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss scaler: init_scale must be finite and > 0, got ", o.init_scale));
  }
  if (!(o.growth_factor > 1.0f) || !std::isfinite(o.growth_factor)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss scaler: growth_factor must be > 1, got ", o.growth_factor));
  }
  if (!(o.backoff_factor > 0.0f && o.backoff_factor < 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss scaler: backoff_factor must be in (0, 1), got ", o.backoff_factor));
  }
  if (o.growth_interval < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss scaler: growth_interval must be >= 1, got ", o.growth_interval));
  }
  return LossScaler(o);
}

absl::StatusOr<bool> LossScaler::UnscaleAndCheck(
    const std::vector<absl::Span<float>>& grads, ProcessGroup* group) {
  // As GradScaler: multiply by the reciprocal, computed once in f32.
  const float inverse = 1.0f / scale_;
  float found = 0.0f;
  for (absl::Span<float> g : grads) {
    for (float& v : g) {
      v *= inverse;
      if (!std::isfinite(v)) found = 1.0f;
    }
  }
  if (group != nullptr && group->size() > 1) {
    absl::Status reduced =
        group->AllReduce(BufferView::Of(&found, 1), ReduceOp::kMax)->Wait();
    if (!reduced.ok()) return reduced;
  }
  return found != 0.0f;
}

absl::Status LossScaler::Restore(float scale, int clean_steps) {
  if (!std::isfinite(scale) || scale <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss scaler: a restored scale must be finite and > 0, got ", scale));
  }
  if (clean_steps < 0 || clean_steps >= options_.growth_interval) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss scaler: restored clean steps ", clean_steps,
        " outside [0, growth_interval = ", options_.growth_interval, ")"));
  }
  scale_ = scale;
  clean_steps_ = clean_steps;
  return absl::OkStatus();
}

void LossScaler::Update(bool found_inf) {
  if (found_inf) {
    scale_ *= options_.backoff_factor;
    clean_steps_ = 0;
    ++skipped_;
    return;
  }
  if (++clean_steps_ == options_.growth_interval) {
    const float grown = scale_ * options_.growth_factor;
    // GradScaler keeps the scale where it is rather than reach inf.
    if (std::isfinite(grown)) scale_ = grown;
    clean_steps_ = 0;
  }
}

}  // namespace cohort
