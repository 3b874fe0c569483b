#include "worker/parallel/optimizer.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/collective/elementwise.h"

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

// SGD and Adam: per slot, the state buffers (in the memory of the slot's
// first step) and a step count; each step is one ElementwiseUpdate
// (elementwise.h), run by the memory: a host loop or a device kernel.
class ElementwiseOptimizer : public Optimizer {
 public:
  absl::Status Step(int slot, absl::Span<float> params,
                    absl::Span<const float> grads) override {
    if (params.size() != grads.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          name(), ": slot ", slot, " has ", params.size(), " parameters but ",
          grads.size(), " gradients; pass equal sizes"));
    }
    return StepIn(host_, slot, params.data(), grads.data(), params.size());
  }

  absl::Status StepIn(GroupMemory& memory, int slot, float* params,
                      const float* grads, size_t count) override {
    if (slot < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name(), ": slot must be >= 0, got ", slot));
    }
    if (count != 0 && (params == nullptr || grads == nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat(
          name(), ": slot ", slot, ": null parameters or gradients"));
    }
    auto it = slots_.find(slot);
    if (it == slots_.end()) {
      SlotState fresh;
      fresh.size = count;
      fresh.device = memory.device();
      for (int k = 0; k < num_states(); ++k) {
        absl::StatusOr<GroupBuffer> buffer = memory.AllocateFloats(count);
        if (!buffer.ok()) {
          return absl::Status(buffer.status().code(),
                              absl::StrCat(name(), ": state for slot ", slot,
                                           ": ", buffer.status().message()));
        }
        fresh.state[k] = std::move(*buffer);
      }
      it = slots_.emplace(slot, std::move(fresh)).first;
    } else if (it->second.size != count) {
      return absl::InvalidArgumentError(absl::StrCat(
          name(), ": slot ", slot, " was first stepped with ", it->second.size,
          " elements, now ", count,
          "; every step of a slot must pass the same tensor (or shard)"));
    } else if (it->second.imported) {
      if (absl::Status s = MoveImported(memory, slot, it->second); !s.ok()) {
        return s;
      }
    } else if (it->second.device != memory.device()) {
      return absl::InvalidArgumentError(absl::StrCat(
          name(), ": slot ", slot, "'s state is in ",
          it->second.device == nullptr ? "host" : "device",
          " memory, where its first step was, and this step is in ",
          memory.on_device() ? "device" : "host",
          " memory; step each slot in one memory"));
    }
    SlotState& state = it->second;
    ElementwiseUpdate update;
    update.params = params;
    update.grads = grads;
    update.count = count;
    update.state0 = state.state[0].floats();
    update.state1 = state.state[1].floats();
    ++state.step;
    Fill(update, state.step);
    return memory.Update(update);
  }

  std::vector<int> slots() const override {
    std::vector<int> out;
    for (const auto& [slot, state] : slots_) out.push_back(slot);
    return out;
  }

  absl::StatusOr<OptimizerSlotState> ExportSlot(int slot) const override {
    auto it = slots_.find(slot);
    if (it == slots_.end()) {
      return absl::NotFoundError(
          absl::StrCat(name(), ": slot ", slot, " has no state yet"));
    }
    const SlotState& state = it->second;
    OptimizerSlotState out;
    out.step = state.step;
    out.size = state.size;
    for (int k = 0; k < num_states(); ++k) {
      out.buffers.emplace_back(state.size);
      const float* data = state.state[k].floats();
      if (state.device == nullptr) {
        std::copy(data, data + state.size, out.buffers.back().begin());
        continue;
      }
      if (state.size == 0) continue;
      if (absl::Status s = state.device->CopyToHost(
              out.buffers.back().data(), data, state.size * sizeof(float));
          !s.ok()) {
        return absl::Status(s.code(),
                            absl::StrCat(name(), ": exporting slot ", slot,
                                         " from the device: ", s.message()));
      }
    }
    return out;
  }

  absl::Status ImportSlot(int slot, const OptimizerSlotState& in) override {
    if (slot < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name(), ": slot must be >= 0, got ", slot));
    }
    if (static_cast<int>(in.buffers.size()) != num_states() || in.step < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          name(), ": slot ", slot, ": ", in.buffers.size(),
          " state buffers and step ", in.step, " imported; expected ",
          num_states(), " and a step >= 0"));
    }
    SlotState fresh;
    fresh.size = in.size;
    fresh.step = in.step;
    fresh.imported = true;
    for (int k = 0; k < num_states(); ++k) {
      if (in.buffers[k].size() != in.size) {
        return absl::InvalidArgumentError(absl::StrCat(
            name(), ": slot ", slot, ": state buffer ", k, " has ",
            in.buffers[k].size(), " elements, expected ", in.size));
      }
      absl::StatusOr<GroupBuffer> buffer = host_.AllocateFloats(in.size);
      if (!buffer.ok()) return buffer.status();
      std::copy(in.buffers[k].begin(), in.buffers[k].end(), buffer->floats());
      fresh.state[k] = std::move(*buffer);
    }
    slots_[slot] = std::move(fresh);
    return absl::OkStatus();
  }

  size_t state_bytes() const override {
    size_t bytes = 0;
    for (const auto& [slot, state] : slots_) {
      bytes += state.state[0].bytes() + state.state[1].bytes();
    }
    return bytes;
  }

 protected:
  // State buffers per slot: 0, 1 or 2.
  virtual int num_states() const = 0;
  // Sets the rule and its constants for step `step` (1 for the first).
  virtual void Fill(ElementwiseUpdate& update, long long step) const = 0;

 private:
  struct SlotState {
    size_t size = 0;
    DeviceMemory* device = nullptr;  // Where the state lives; null: host.
    // Imported (in host memory) and not stepped since: the next step's
    // memory becomes the state's.
    bool imported = false;
    long long step = 0;
    GroupBuffer state[2];
  };

  // Moves an imported slot's host state into `memory` (if that is a
  // device's: allocates there and copies), where it then stays.
  absl::Status MoveImported(GroupMemory& memory, int slot, SlotState& state) {
    state.imported = false;
    if (!memory.on_device()) return absl::OkStatus();
    GroupBuffer moved[2];
    for (int k = 0; k < num_states(); ++k) {
      absl::StatusOr<GroupBuffer> buffer = memory.AllocateFloats(state.size);
      absl::Status s = buffer.status();
      if (s.ok()) {
        s = memory.FromHost(buffer->data(), state.state[k].data(),
                            state.state[k].bytes());
      }
      if (!s.ok()) {
        state.imported = true;  // Still on the host; a later step may retry.
        return absl::Status(
            s.code(),
            absl::StrCat(name(), ": moving slot ", slot,
                         "'s imported state to the device: ", s.message()));
      }
      moved[k] = std::move(*buffer);
    }
    for (int k = 0; k < num_states(); ++k) state.state[k] = std::move(moved[k]);
    state.device = memory.device();
    return absl::OkStatus();
  }

  GroupMemory host_{nullptr};
  std::map<int, SlotState> slots_;
};

class Sgd : public ElementwiseOptimizer {
 public:
  explicit Sgd(const SgdOptions& options) : options_(options) {}
  absl::string_view name() const override { return "sgd"; }
  std::vector<std::string> state_names() const override {
    if (options_.momentum == 0.0f) return {};
    return {"momentum_buffer"};
  }

 protected:
  int num_states() const override { return options_.momentum == 0.0f ? 0 : 1; }
  void Fill(ElementwiseUpdate& update, long long step) const override {
    update.lr = options_.lr;
    update.weight_decay = options_.weight_decay;
    if (options_.momentum == 0.0f) {
      update.rule = ElementwiseUpdate::Rule::kSgd;
      return;
    }
    update.rule = ElementwiseUpdate::Rule::kSgdMomentum;
    update.momentum = options_.momentum;
    update.first_step = step == 1;
  }

 private:
  const SgdOptions options_;
};

class Adam : public ElementwiseOptimizer {
 public:
  explicit Adam(const AdamOptions& options) : options_(options) {}
  absl::string_view name() const override { return "adam"; }
  std::vector<std::string> state_names() const override {
    return {"exp_avg", "exp_avg_sq"};
  }

 protected:
  int num_states() const override { return 2; }
  void Fill(ElementwiseUpdate& update, long long step) const override {
    // As torch.optim.Adam's single-tensor path: the bias corrections are
    // computed in double (Python floats there) and folded into a step size
    // and a divisor once per step, so every element (and every shard of a
    // tensor) sees the same f32 constants: lr * m_hat / (sqrt(v_hat) + eps)
    // == (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps).
    const double bc1 = 1.0 - std::pow(static_cast<double>(options_.beta1),
                                      static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(static_cast<double>(options_.beta2),
                                      static_cast<double>(step));
    update.rule = ElementwiseUpdate::Rule::kAdam;
    update.lr = options_.lr;
    update.weight_decay = options_.weight_decay;
    update.beta1 = options_.beta1;
    update.beta2 = options_.beta2;
    update.eps = options_.eps;
    update.step_size = static_cast<float>(options_.lr / bc1);
    update.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  }

 private:
  const AdamOptions options_;
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
