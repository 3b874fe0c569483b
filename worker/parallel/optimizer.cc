#include "worker/parallel/optimizer.h"

#include <cmath>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"

namespace cohort {
namespace {

absl::Status CheckNonNegative(absl::string_view optimizer,
                              absl::string_view option, float value) {
  if (!std::isfinite(value) || value < 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        optimizer, ": ", option, " must be finite and >= 0, got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckBeta(absl::string_view option, float value) {
  if (!(value >= 0.0f && value < 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("adam: ", option, " must be in [0, 1), got ", value));
  }
  return absl::OkStatus();
}

// Checks the arguments of Step against each other and against the size the
// slot had on its first step (recorded in `sizes`, which it updates).
absl::Status CheckStep(absl::string_view optimizer, int slot,
                       absl::Span<float> params, absl::Span<const float> grads,
                       std::map<int, size_t>& sizes) {
  if (slot < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(optimizer, ": slot must be >= 0, got ", slot));
  }
  if (params.size() != grads.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        optimizer, ": slot ", slot, " has ", params.size(), " parameters but ",
        grads.size(), " gradients; pass equal sizes"));
  }
  auto [it, inserted] = sizes.emplace(slot, params.size());
  if (!inserted && it->second != params.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        optimizer, ": slot ", slot, " was first stepped with ", it->second,
        " elements, now ", params.size(),
        "; every step of a slot must pass the same tensor (or shard)"));
  }
  return absl::OkStatus();
}

class Sgd : public Optimizer {
 public:
  explicit Sgd(const SgdOptions& options) : options_(options) {}

  absl::Status Step(int slot, absl::Span<float> params,
                    absl::Span<const float> grads) override {
    if (absl::Status s = CheckStep("sgd", slot, params, grads, sizes_);
        !s.ok()) {
      return s;
    }
    const float lr = options_.lr;
    const float wd = options_.weight_decay;
    const float momentum = options_.momentum;
    if (momentum == 0.0f) {
      for (size_t i = 0; i < params.size(); ++i) {
        const float g = grads[i] + wd * params[i];
        params[i] -= lr * g;
      }
      return absl::OkStatus();
    }
    auto [it, first] = buffers_.try_emplace(slot);
    std::vector<float>& buf = it->second;
    if (first) buf.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const float g = grads[i] + wd * params[i];
      // torch.optim.SGD seeds the buffer with the first gradient itself
      // rather than momentum * 0 + g (the same value, but no dampening).
      buf[i] = first ? g : momentum * buf[i] + g;
      params[i] -= lr * buf[i];
    }
    return absl::OkStatus();
  }

  size_t state_bytes() const override {
    size_t bytes = 0;
    for (const auto& [slot, buf] : buffers_)
      bytes += buf.size() * sizeof(float);
    return bytes;
  }

  absl::string_view name() const override { return "sgd"; }

 private:
  const SgdOptions options_;
  std::map<int, size_t> sizes_;
  std::map<int, std::vector<float>> buffers_;  // Only with momentum.
};

class Adam : public Optimizer {
 public:
  explicit Adam(const AdamOptions& options) : options_(options) {}

  absl::Status Step(int slot, absl::Span<float> params,
                    absl::Span<const float> grads) override {
    if (absl::Status s = CheckStep("adam", slot, params, grads, sizes_);
        !s.ok()) {
      return s;
    }
    auto [it, first] = slots_.try_emplace(slot);
    SlotState& state = it->second;
    if (first) {
      state.m.resize(params.size());
      state.v.resize(params.size());
    }
    ++state.step;
    // As torch.optim.Adam's single-tensor path: the bias corrections are
    // computed in double (Python floats there) and folded into a step size
    // and a divisor once per step, so every element (and every shard of a
    // tensor) sees the same f32 constants: lr * m_hat / (sqrt(v_hat) + eps)
    // == (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps).
    const double bc1 = 1.0 - std::pow(static_cast<double>(options_.beta1),
                                      static_cast<double>(state.step));
    const double bc2 = 1.0 - std::pow(static_cast<double>(options_.beta2),
                                      static_cast<double>(state.step));
    const float step_size = static_cast<float>(options_.lr / bc1);
    const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    const float b1 = options_.beta1;
    const float b2 = options_.beta2;
    const float wd = options_.weight_decay;
    const float eps = options_.eps;
    for (size_t i = 0; i < params.size(); ++i) {
      const float g = grads[i] + wd * params[i];
      state.m[i] = b1 * state.m[i] + (1.0f - b1) * g;
      state.v[i] = b2 * state.v[i] + (1.0f - b2) * g * g;
      const float denom = std::sqrt(state.v[i]) / bc2_sqrt + eps;
      params[i] -= step_size * (state.m[i] / denom);
    }
    return absl::OkStatus();
  }

  size_t state_bytes() const override {
    size_t bytes = 0;
    for (const auto& [slot, state] : slots_) {
      bytes += (state.m.size() + state.v.size()) * sizeof(float);
    }
    return bytes;
  }

  absl::string_view name() const override { return "adam"; }

 private:
  struct SlotState {
    long long step = 0;
    std::vector<float> m;
    std::vector<float> v;
  };

  const AdamOptions options_;
  std::map<int, size_t> sizes_;
  std::map<int, SlotState> slots_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Optimizer>> NewSgd(const SgdOptions& options) {
  for (absl::Status s :
       {CheckNonNegative("sgd", "lr", options.lr),
        CheckNonNegative("sgd", "momentum", options.momentum),
        CheckNonNegative("sgd", "weight_decay", options.weight_decay)}) {
    if (!s.ok()) return s;
  }
  return std::unique_ptr<Optimizer>(new Sgd(options));
}

absl::StatusOr<std::unique_ptr<Optimizer>> NewAdam(const AdamOptions& options) {
  for (absl::Status s :
       {CheckNonNegative("adam", "lr", options.lr),
        CheckBeta("beta1", options.beta1), CheckBeta("beta2", options.beta2),
        CheckNonNegative("adam", "weight_decay", options.weight_decay)}) {
    if (!s.ok()) return s;
  }
  if (!std::isfinite(options.eps) || options.eps <= 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("adam: eps must be finite and > 0, got ", options.eps));
  }
  return std::unique_ptr<Optimizer>(new Adam(options));
}

}  // namespace cohort
