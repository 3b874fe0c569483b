#include "worker/checkpoint/training_state.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace cohort {
namespace {

std::string ParamName(size_t i) { return absl::StrCat("param.", i); }
std::string StateName(size_t i, const std::string& state) {
  return absl::StrCat("param.", i, ".", state);
}

// Attributes naming the optimizer and its step count, from a slot already
// exported (`known`, may be null) or else from its first slot.
absl::StatusOr<std::map<std::string, std::string>> OptimizerAttributes(
    const Optimizer& optimizer, const OptimizerSlotState* known) {
  long long step = 0;
  std::vector<int> slots = optimizer.slots();
  if (known != nullptr) {
    step = known->step;
  } else if (!slots.empty()) {
    absl::StatusOr<OptimizerSlotState> first = optimizer.ExportSlot(slots[0]);
    if (!first.ok()) return first.status();
    step = first->step;
  }
  return std::map<std::string, std::string>{
      {"optimizer", std::string(optimizer.name())},
      {"optimizer.step", absl::StrCat(step)}};
}

// The optimizer step count the checkpoint holds, after checking it was
// saved with this optimizer.
absl::StatusOr<long long> SavedStep(const CheckpointReader& reader,
                                    const Optimizer& optimizer) {
  const auto& attributes = reader.metadata().attributes();
  auto name = attributes.find("optimizer");
  auto step = attributes.find("optimizer.step");
  long long value = 0;
  if (name == attributes.end() || step == attributes.end() ||
      !absl::SimpleAtoi(step->second, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint of step ", reader.step(),
                     " has no optimizer attributes: not a training state"));
  }
  if (name->second != optimizer.name()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint of step ", reader.step(), " was saved with optimizer ",
        name->second, "; this job uses ", optimizer.name()));
  }
  return value;
}

absl::Status CheckNumel(const CheckpointReader& reader, const std::string& name,
                        size_t want) {
  absl::StatusOr<uint64_t> numel = reader.Numel(name);
  if (!numel.ok()) return numel.status();
  if (*numel != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint of step ", reader.step(), ": tensor '", name, "' has ",
        *numel, " elements; this model's has ", want, " (another model?)"));
  }
  return absl::OkStatus();
}

absl::Status Save(CheckpointWriter& writer, bool async, int64_t step,
                  const std::vector<ShardToSave>& shards,
                  const std::map<std::string, std::string>& attributes) {
  return async ? writer.SaveAsync(step, shards, attributes)
               : writer.Save(step, shards, attributes);
}

// Where unit u's shard begins in its flat unit: NO_SHARD (and world 1)
// holds the whole padded unit on every rank.
uint64_t ShardBegin(const Fsdp& fsdp, int u) {
  if (fsdp.shard_elements(u) == fsdp.padded_elements(u)) return 0;
  return static_cast<uint64_t>(fsdp.group().rank()) * fsdp.shard_elements(u);
}

// The sizes of unit u's parameters and the index of its first.
absl::StatusOr<std::pair<std::vector<size_t>, size_t>> UnitParams(
    const Fsdp& fsdp, const std::vector<size_t>& param_sizes, int u,
    size_t first) {
  std::vector<size_t> sizes;
  size_t total = 0;
  for (int i = 0; i < fsdp.num_params(u); ++i) {
    if (first + i >= param_sizes.size()) break;
    sizes.push_back(param_sizes[first + i]);
    total += sizes.back();
  }
  if (static_cast<int>(sizes.size()) != fsdp.num_params(u) ||
      total != fsdp.unpadded_elements(u)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FSDP unit ", u, " does not hold the model's parameters from ", first,
        " on (", fsdp.unpadded_elements(u), " elements in ", fsdp.num_params(u),
        " parameters)"));
  }
  return std::make_pair(std::move(sizes), first);
}

// Unit u's parameter shard where the host may read it: the shard itself,
// or, on a device, a copy appended to `staged` (which must outlive the save).
absl::StatusOr<absl::Span<const float>> HostShard(
    Fsdp& fsdp, int u, std::vector<std::vector<float>>& staged) {
  absl::Span<const float> shard = fsdp.param_shard(u);
  if (!fsdp.on_device()) return shard;
  staged.emplace_back(shard.size());
  if (!shard.empty()) {
    absl::Status s = fsdp.group().device_memory()->CopyToHost(
        staged.back().data(), shard.data(), shard.size() * sizeof(float));
    if (!s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("FSDP unit ", u,
                                 ": copying its shard to the host to save: ",
                                 s.message()));
    }
  }
  return absl::MakeConstSpan(staged.back());
}

// The caller's attributes beside the optimizer's, which they may not replace.
absl::Status AddExtra(const std::map<std::string, std::string>& extra,
                      std::map<std::string, std::string>& attributes) {
  for (const auto& [name, value] : extra) {
    if (!attributes.emplace(name, value).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint attribute '", name,
                       "' is the training state's own; choose another name"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SaveReplicaState(CheckpointWriter& writer, bool async,
                              int64_t step, int rank, int world,
                              const std::vector<std::vector<float>>& params,
                              const Optimizer& optimizer,
                              const std::map<std::string, std::string>& extra) {
  const std::vector<std::string> states = optimizer.state_names();
  std::vector<OptimizerSlotState> exported;  // Alive until the save copies.
  exported.reserve(params.size());
  std::vector<ShardToSave> shards;
  for (size_t i = 0; i < params.size(); ++i) {
    if (static_cast<int>(i % world) != rank) continue;
    const uint64_t size = params[i].size();
    shards.push_back({ParamName(i), {size}, 0, params[i]});
    if (states.empty()) continue;
    absl::StatusOr<OptimizerSlotState> state =
        optimizer.ExportSlot(static_cast<int>(i));
    if (absl::IsNotFound(state.status())) continue;  // Not stepped yet.
    if (!state.ok()) return state.status();
    exported.push_back(*std::move(state));
    for (size_t k = 0; k < states.size(); ++k) {
      shards.push_back(
          {StateName(i, states[k]), {size}, 0, exported.back().buffers[k]});
    }
  }
  absl::StatusOr<std::map<std::string, std::string>> attributes =
      OptimizerAttributes(optimizer, exported.empty() ? nullptr : &exported[0]);
  if (!attributes.ok()) return attributes.status();
  if (absl::Status s = AddExtra(extra, *attributes); !s.ok()) return s;
  return Save(writer, async, step, shards, *attributes);
}

absl::Status LoadReplicaState(const CheckpointReader& reader,
                              std::vector<std::vector<float>>& params,
                              Optimizer& optimizer) {
  absl::StatusOr<long long> step = SavedStep(reader, optimizer);
  if (!step.ok()) return step.status();
  const std::vector<std::string> states = optimizer.state_names();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string name = ParamName(i);
    if (absl::Status s = CheckNumel(reader, name, params[i].size()); !s.ok()) {
      return s;
    }
    if (absl::Status s = reader.Read(name, 0, absl::MakeSpan(params[i]));
        !s.ok()) {
      return s;
    }
    OptimizerSlotState slot{.step = *step, .size = params[i].size()};
    for (const std::string& state : states) {
      if (!reader.Has(StateName(i, state))) break;  // Saved before a step.
      slot.buffers.emplace_back(params[i].size());
      if (absl::Status s = reader.Read(StateName(i, state), 0,
                                       absl::MakeSpan(slot.buffers.back()));
          !s.ok()) {
        return s;
      }
    }
    if (slot.buffers.size() != states.size()) continue;
    if (absl::Status s = optimizer.ImportSlot(static_cast<int>(i), slot);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status SaveFsdpState(CheckpointWriter& writer, bool async, int64_t step,
                           Fsdp& fsdp, const std::vector<size_t>& param_sizes,
                           const Optimizer& optimizer,
                           const std::map<std::string, std::string>& extra) {
  const std::vector<std::string> states = optimizer.state_names();
  const int rank = fsdp.group().rank();
  const int world = fsdp.group().size();
  // Alive until the save has copied them: exported optimizer state and, on
  // a device, the parameter shards staged on the host.
  std::vector<OptimizerSlotState> exported;
  exported.reserve(fsdp.num_units());
  std::vector<std::vector<float>> staged;
  staged.reserve(fsdp.num_units());
  std::vector<ShardToSave> shards;
  size_t first = 0;
  for (int u = 0; u < fsdp.num_units(); ++u) {
    auto unit = UnitParams(fsdp, param_sizes, u, first);
    if (!unit.ok()) return unit.status();
    const std::vector<size_t>& sizes = unit->first;
    // The part of the unit this rank writes, and where it is in the shard.
    const ElementRange mine = EvenShard(fsdp.unpadded_elements(u), rank, world);
    const uint64_t in_shard = mine.start - ShardBegin(fsdp, u);
    absl::StatusOr<absl::Span<const float>> shard = HostShard(fsdp, u, staged);
    if (!shard.ok()) return shard.status();
    const OptimizerSlotState* state = nullptr;
    if (!states.empty()) {
      absl::StatusOr<OptimizerSlotState> got = optimizer.ExportSlot(u);
      if (got.ok()) {
        exported.push_back(*std::move(got));
        state = &exported.back();
      } else if (!absl::IsNotFound(got.status())) {
        return got.status();
      }
    }
    for (const FlatPiece& p : SplitFlatRange(sizes, mine.start, mine.count)) {
      const size_t i = first + p.tensor;
      const uint64_t at = in_shard + p.offset;
      shards.push_back({ParamName(i),
                        {sizes[p.tensor]},
                        p.start,
                        shard->subspan(at, p.count)});
      if (state == nullptr) continue;
      for (size_t k = 0; k < states.size(); ++k) {
        shards.push_back(
            {StateName(i, states[k]),
             {sizes[p.tensor]},
             p.start,
             absl::MakeConstSpan(state->buffers[k]).subspan(at, p.count)});
      }
    }
    first += sizes.size();
  }
  absl::StatusOr<std::map<std::string, std::string>> attributes =
      OptimizerAttributes(optimizer, exported.empty() ? nullptr : &exported[0]);
  if (!attributes.ok()) return attributes.status();
  if (absl::Status s = AddExtra(extra, *attributes); !s.ok()) return s;
  return Save(writer, async, step, shards, *attributes);
}

absl::Status LoadFsdpState(const CheckpointReader& reader, Fsdp& fsdp,
                           const std::vector<size_t>& param_sizes,
                           Optimizer& optimizer) {
  absl::StatusOr<long long> step = SavedStep(reader, optimizer);
  if (!step.ok()) return step.status();
  const std::vector<std::string> states = optimizer.state_names();
  size_t first = 0;
  for (int u = 0; u < fsdp.num_units(); ++u) {
    auto unit = UnitParams(fsdp, param_sizes, u, first);
    if (!unit.ok()) return unit.status();
    const std::vector<size_t>& sizes = unit->first;
    for (size_t t = 0; t < sizes.size(); ++t) {
      if (absl::Status s = CheckNumel(reader, ParamName(first + t), sizes[t]);
          !s.ok()) {
        return s;
      }
    }
    // What this rank holds of the unit now, padding excluded, read into
    // the shard (on a device, into a host copy of it, copied over after).
    absl::Span<float> device_shard = fsdp.param_shard(u);
    std::vector<float> staged;
    absl::Span<float> shard = device_shard;
    if (fsdp.on_device()) {
      staged.resize(device_shard.size());
      shard = absl::MakeSpan(staged);
    }
    const uint64_t begin = ShardBegin(fsdp, u);
    const uint64_t held =
        std::min<uint64_t>(fsdp.unpadded_elements(u), begin + shard.size()) -
        std::min<uint64_t>(fsdp.unpadded_elements(u), begin);
    std::fill(shard.begin(), shard.end(), 0.0f);
    OptimizerSlotState slot{.step = *step, .size = shard.size()};
    bool has_state = !states.empty();
    for (const std::string& state : states) {
      has_state = has_state && reader.Has(StateName(first, state));
    }
    if (has_state)
      slot.buffers.assign(states.size(), std::vector<float>(shard.size()));
    for (const FlatPiece& p : SplitFlatRange(sizes, begin, held)) {
      const size_t i = first + p.tensor;
      if (absl::Status s = reader.Read(ParamName(i), p.start,
                                       shard.subspan(p.offset, p.count));
          !s.ok()) {
        return s;
      }
      if (!has_state) continue;
      for (size_t k = 0; k < states.size(); ++k) {
        if (absl::Status s = reader.Read(
                StateName(i, states[k]), p.start,
                absl::MakeSpan(slot.buffers[k]).subspan(p.offset, p.count));
            !s.ok()) {
          return s;
        }
      }
    }
    if (fsdp.on_device() && !shard.empty()) {
      absl::Status s = fsdp.group().device_memory()->CopyToDevice(
          device_shard.data(), shard.data(), shard.size() * sizeof(float));
      if (!s.ok()) {
        return absl::Status(
            s.code(), absl::StrCat("FSDP unit ", u,
                                   ": copying its loaded shard to the device: ",
                                   s.message()));
      }
    }
    if (has_state || states.empty()) {
      if (absl::Status s = optimizer.ImportSlot(u, slot); !s.ok()) return s;
    }
    first += sizes.size();
  }
  return absl::OkStatus();
}

}  // namespace cohort
