// How the pieces fit:
//  - Each unit's parameters live flat: parameter i at the sum of the earlier
//    counts, the unit padded with zeros to P = ceil(T / N) * N elements so
//    that rank r's shard is exactly [r * S, (r + 1) * S), S = P / N. The
//    padding is zero in the parameters and in every gradient, so optimizers
//    leave it zero (no element-wise update moves a zero with a zero
//    gradient). NO_SHARD keeps the whole unpadded unit (P = S = T).
//  - Gathering (all_gather of the shards into a full P buffer) happens at
//    Begin*, or earlier as a prefetch whose Work is kept with the unit and
//    waited for by the Begin* that needs it. Whether a unit is gathered is
//    decided only by the sequence of calls, never by timing, so every rank
//    issues the same collectives in the same order.
//  - Each backward's full gradient is reduce_scattered (AVG) asynchronously
//    at EndBackward into a temporary shard, and added into the persistent
//    gradient shard once it completes. EndBackward waits for the reductions
//    issued before its own, so at most two full gradients are alive at any
//    time (the one being reduced and the one being computed): memory stays
//    bounded and the same on every run instead of depending on when the
//    network finishes.
//  - Every buffer is a GroupBuffer in the group's memory (group_memory.h):
//    host memory, or the device's on NCCL, where the accumulation into the
//    gradient shards, the zeroing and the optimizer step run as kernels on
//    the device and nothing crosses to the host but LoadFromRank0's
//    values and GatherFullParams' result, which the caller hands over and
//    asks for on the host.
//  - Buffers in flight are owned by the unit (its `full` buffer, which is
//    never replaced while its gather runs) or by a PendingReduction, and
//    the destructor waits for every Work, so no collective ever writes
//    freed memory.
//  - bytes_communicated counts what this rank sends by WireBytes()
//    (process_group.h): the ring volume of each collective it issues.
//
// Not thread-safe: one thread drives an Fsdp, as one training loop does.
#include "worker/parallel/fsdp.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "worker/parallel/group_memory.h"

namespace cohort {
namespace {

size_t Bytes(size_t floats) { return floats * sizeof(float); }

// A bug in the caller (fsdp.h): the accessors have no status to return,
// and any span they returned would be misused.
[[noreturn]] void CallerBug(const std::string& what) {
  std::fprintf(stderr, "fsdp: bug in the caller: %s\n", what.c_str());
  std::abort();
}

enum class Phase { kIdle, kForward, kBackward };

}  // namespace

absl::StatusOr<ShardingStrategy> ParseShardingStrategy(absl::string_view name) {
  for (ShardingStrategy s :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
        ShardingStrategy::kNoShard}) {
    if (absl::EqualsIgnoreCase(name, ShardingStrategyName(s))) return s;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown FSDP sharding strategy '", name,
                   "'; expected full_shard, shard_grad_op or no_shard"));
}

absl::string_view ShardingStrategyName(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard:
      return "full_shard";
    case ShardingStrategy::kShardGradOp:
      return "shard_grad_op";
    case ShardingStrategy::kNoShard:
      return "no_shard";
  }
  return "unknown";
}

struct Fsdp::State {
  struct Unit {
    std::vector<size_t> counts;
    std::vector<size_t> offsets;  // Of each parameter in the flat unit.
    size_t unpadded = 0;
    size_t padded = 0;
    size_t shard = 0;
    GroupBuffer param_shard;
    GroupBuffer grad_shard;
    // The gathered unit (P elements) while held; empty when freed. Under
    // NO_SHARD unused: param_shard is the full unit.
    GroupBuffer full;
    std::shared_ptr<Work> gather;  // In flight into `full`, if any.
    bool gathered = false;         // `full` holds this step's values.
    // param() is allowed: set by Begin*, cleared when `full` is freed.
    bool open = false;
    Phase phase = Phase::kIdle;
    // The full gradient between BeginBackward and EndBackward.
    GroupBuffer grad;
  };

  // A gradient reduction in flight, with the buffers it reads and writes.
  struct PendingReduction {
    int unit = 0;
    GroupBuffer full_grad;
    // reduce_scatter's output; empty under NO_SHARD, whose all_reduce
    // averages `full_grad` in place.
    GroupBuffer out;
    std::shared_ptr<Work> work;
  };

  std::shared_ptr<ProcessGroup> group;
  // Where every buffer lives: host memory, or the group's device memory.
  std::unique_ptr<GroupMemory> memory;
  FsdpOptions options;
  int rank = 0;
  int world = 1;
  // Sized once by Create and never resized: in-flight ops point into it.
  std::vector<Unit> units;
  std::deque<PendingReduction> pending;
  bool backward_since_finish = false;
  size_t optimizer_bytes = 0;
  size_t scratch_param_bytes = 0;  // LoadFromRank0's broadcast buffer.
  size_t peak_bytes = 0;
  size_t peak_gathered_param_bytes = 0;
  uint64_t bytes_communicated = 0;
  absl::Status first_error;  // Of the first failed collective.

  bool sharded() const {
    return options.strategy != ShardingStrategy::kNoShard;
  }

  FsdpMemory Memory() const {
    FsdpMemory m;
    for (const Unit& u : units) {
      m.param_bytes += u.param_shard.bytes();
      m.grad_bytes += u.grad_shard.bytes();
      m.gathered_param_bytes += u.full.bytes();
      m.gathered_grad_bytes += u.grad.bytes();
    }
    for (const PendingReduction& p : pending) {
      m.gathered_grad_bytes += p.full_grad.bytes() + p.out.bytes();
    }
    m.gathered_param_bytes += scratch_param_bytes;
    m.optimizer_bytes = optimizer_bytes;
    m.peak_bytes = peak_bytes;
    m.peak_gathered_param_bytes = peak_gathered_param_bytes;
    return m;
  }

  void UpdatePeak() {
    const FsdpMemory m = Memory();
    peak_bytes =
        std::max(peak_bytes, m.persistent_bytes() + m.gathered_param_bytes +
                                 m.gathered_grad_bytes);
    peak_gathered_param_bytes =
        std::max(peak_gathered_param_bytes, m.gathered_param_bytes);
  }

  absl::Status Usable() const {
    if (first_error.ok()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "fsdp is unusable: an earlier collective or device operation failed (",
        first_error.ToString(),
        "); peers may be mid-collective, so recreate the group and Fsdp"));
  }

  // Records a failure that leaves the ranks out of step (a collective, or
  // memory that a collective needed) and returns it.
  absl::Status Fail(absl::Status status) {
    if (first_error.ok()) first_error = status;
    return status;
  }

  absl::Status Wait(const std::shared_ptr<Work>& work, absl::string_view what) {
    absl::Status status = work->Wait();
    if (status.ok()) return status;
    return Fail(absl::Status(status.code(),
                             absl::StrCat(what, ": ", status.message())));
  }

  absl::Status CheckUnit(absl::string_view method, int unit) const {
    if (unit < 0 || unit >= static_cast<int>(units.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat(method, "(", unit, "): unit out of range; there are ",
                       units.size(), " units"));
    }
    return absl::OkStatus();
  }

  // FAILED_PRECONDITION naming the first unit mid-forward or mid-backward.
  absl::Status CheckNoUnitOpen(absl::string_view method) const {
    for (size_t u = 0; u < units.size(); ++u) {
      if (units[u].phase == Phase::kForward) {
        return absl::FailedPreconditionError(
            absl::StrCat(method, ": unit ", u,
                         " is in its forward; call EndForward(", u, ") first"));
      }
      if (units[u].phase == Phase::kBackward) {
        return absl::FailedPreconditionError(absl::StrCat(
            method, ": unit ", u, " is in its backward; call EndBackward(", u,
            ") first"));
      }
    }
    return absl::OkStatus();
  }

  // A zeroed buffer of `elements` f32, or the error naming what it was for.
  absl::StatusOr<GroupBuffer> Allocate(size_t elements,
                                       absl::string_view what) {
    absl::StatusOr<GroupBuffer> buffer = memory->AllocateFloats(elements);
    if (buffer.ok()) return buffer;
    return absl::Status(buffer.status().code(),
                        absl::StrCat("allocating ", what, " (", Bytes(elements),
                                     " bytes): ", buffer.status().message()));
  }

  // Issues the all_gather of unit u's shards into its full buffer.
  absl::Status StartGather(int u) {
    Unit& unit = units[u];
    absl::StatusOr<GroupBuffer> full =
        Allocate(unit.padded, absl::StrCat("unit ", u, "'s full parameters"));
    // Every rank issues the gathers in one order: one that cannot is out
    // of step for good.
    if (!full.ok()) return Fail(full.status());
    unit.full = std::move(*full);
    UpdatePeak();
    unit.gather =
        group->AllGather(BufferView::Of(unit.param_shard.floats(), unit.shard),
                         BufferView::Of(unit.full.floats(), unit.padded));
    bytes_communicated +=
        WireBytes(Traffic::kAllGather, Bytes(unit.padded), group->size());
    return absl::OkStatus();
  }

  // Makes unit u's full parameters available, gathering them (or waiting
  // for their prefetch) if needed.
  absl::Status EnsureGathered(int u) {
    Unit& unit = units[u];
    if (!sharded() || unit.gathered) return absl::OkStatus();
    if (unit.gather == nullptr) {
      if (absl::Status s = StartGather(u); !s.ok()) return s;
    }
    return FinishGather(u);
  }

  absl::Status FinishGather(int u) {
    Unit& unit = units[u];
    absl::Status status =
        Wait(unit.gather, absl::StrCat("all_gather of unit ", u));
    if (!status.ok()) return status;
    unit.gather = nullptr;
    unit.gathered = true;
    return absl::OkStatus();
  }

  // Starts gathering the prefetch_depth units after `u` in the direction
  // `step` (+1 forward, -1 backward) that are neither gathered nor in
  // flight, nearest first, so that every rank issues them in one order.
  absl::Status Prefetch(int u, int step) {
    if (!sharded()) return absl::OkStatus();
    for (int k = 1; k <= options.prefetch_depth; ++k) {
      const int next = u + k * step;
      if (next < 0 || next >= static_cast<int>(units.size())) break;
      if (units[next].gathered || units[next].gather != nullptr) continue;
      if (absl::Status s = StartGather(next); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

  void FreeFull(int u) {
    Unit& unit = units[u];
    if (!sharded()) return;
    unit.full = GroupBuffer();
    unit.gathered = false;
    unit.open = false;
  }

  // Waits for every prefetch in flight and frees every gathered unit: their
  // values are about to go stale (Step, LoadFromRank0).
  absl::Status DropGathered() {
    absl::Status result;
    for (size_t u = 0; u < units.size(); ++u) {
      if (units[u].gather != nullptr) {
        absl::Status s = FinishGather(u);
        if (!s.ok()) {
          result.Update(s);
          continue;  // Keep the buffer: the Work has it, the error is set.
        }
      }
      FreeFull(u);
    }
    return result;
  }

  // Waits for the oldest pending reduction and adds its result into its
  // unit's gradient shard.
  absl::Status RetireOldest() {
    PendingReduction& p = pending.front();
    absl::Status status =
        Wait(p.work, absl::StrCat(sharded() ? "reduce_scatter" : "all_reduce",
                                  " of unit ", p.unit, "'s gradients"));
    if (status.ok()) {
      const GroupBuffer& result = p.out.data() != nullptr ? p.out : p.full_grad;
      GroupBuffer& shard = units[p.unit].grad_shard;
      status = memory->Add(shard.floats(), result.floats(), shard.elements());
      if (!status.ok()) {
        Fail(absl::Status(status.code(),
                          absl::StrCat("adding unit ", p.unit,
                                       "'s reduced gradients into its shard: ",
                                       status.message())))
            .IgnoreError();
      }
    }
    // The Work has completed either way, so its buffers may go.
    pending.pop_front();
    return status;
  }

  void WaitForEverything() {
    for (Unit& unit : units) {
      if (unit.gather != nullptr) unit.gather->Wait().IgnoreError();
    }
    for (PendingReduction& p : pending) p.work->Wait().IgnoreError();
  }
};

absl::StatusOr<std::unique_ptr<Fsdp>> Fsdp::Create(
    std::shared_ptr<ProcessGroup> group, std::vector<std::vector<size_t>> units,
    const FsdpOptions& options) {
  if (group == nullptr) {
    return absl::InvalidArgumentError("Fsdp::Create: the group is null");
  }
  if (units.empty()) {
    return absl::InvalidArgumentError(
        "Fsdp::Create: no units; pass at least one unit of parameters");
  }
  if (options.prefetch_depth < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Fsdp::Create: prefetch_depth is ", options.prefetch_depth,
                     "; use 0 (no prefetch) or more units"));
  }
  auto state = std::make_unique<State>();
  state->group = std::move(group);
  state->memory = std::make_unique<GroupMemory>(state->group->device_memory());
  state->options = options;
  state->rank = state->group->rank();
  state->world = state->group->size();
  const size_t n = state->sharded() ? state->world : 1;
  state->units.resize(units.size());
  for (size_t u = 0; u < units.size(); ++u) {
    if (units[u].empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Fsdp::Create: unit ", u, " has no parameters; drop it or merge it"));
    }
    State::Unit& unit = state->units[u];
    unit.counts = std::move(units[u]);
    for (size_t i = 0; i < unit.counts.size(); ++i) {
      if (unit.counts[i] == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Fsdp::Create: unit ", u, " parameter ", i, " has zero elements"));
      }
      unit.offsets.push_back(unit.unpadded);
      unit.unpadded += unit.counts[i];
    }
    unit.padded = (unit.unpadded + n - 1) / n * n;
    unit.shard = unit.padded / n;
  }
  // Every rank must shard the same units: a unit's count, then its sizes.
  std::vector<size_t> layout;
  for (const State::Unit& unit : state->units) {
    layout.push_back(unit.counts.size());
    layout.insert(layout.end(), unit.counts.begin(), unit.counts.end());
  }
  if (absl::Status same =
          VerifySameSizes(*state->group, layout, "Fsdp::Create");
      !same.ok()) {
    return same;
  }
  for (size_t u = 0; u < state->units.size(); ++u) {
    State::Unit& unit = state->units[u];
    for (GroupBuffer* buffer : {&unit.param_shard, &unit.grad_shard}) {
      absl::StatusOr<GroupBuffer> shard = state->Allocate(
          unit.shard,
          absl::StrCat("unit ", u, "'s ",
                       buffer == &unit.param_shard ? "parameter" : "gradient",
                       " shard"));
      if (!shard.ok()) {
        return absl::Status(
            shard.status().code(),
            absl::StrCat("Fsdp::Create: ", shard.status().message()));
      }
      *buffer = std::move(*shard);
    }
  }
  state->UpdatePeak();
  return std::unique_ptr<Fsdp>(new Fsdp(std::move(state)));
}

Fsdp::Fsdp(std::unique_ptr<State> state) : state_(std::move(state)) {}

Fsdp::~Fsdp() { state_->WaitForEverything(); }

int Fsdp::num_units() const { return static_cast<int>(state_->units.size()); }

int Fsdp::num_params(int unit) const {
  if (!state_->CheckUnit("num_params", unit).ok()) return 0;
  return static_cast<int>(state_->units[unit].counts.size());
}

const FsdpOptions& Fsdp::options() const { return state_->options; }

ProcessGroup& Fsdp::group() const { return *state_->group; }

size_t Fsdp::unpadded_elements(int unit) const {
  if (!state_->CheckUnit("unpadded_elements", unit).ok()) return 0;
  return state_->units[unit].unpadded;
}

size_t Fsdp::padded_elements(int unit) const {
  if (!state_->CheckUnit("padded_elements", unit).ok()) return 0;
  return state_->units[unit].padded;
}

size_t Fsdp::shard_elements(int unit) const {
  if (!state_->CheckUnit("shard_elements", unit).ok()) return 0;
  return state_->units[unit].shard;
}

absl::Status Fsdp::LoadFromRank0(
    const std::vector<std::vector<absl::Span<const float>>>& values) {
  State& s = *state_;
  if (absl::Status st = s.Usable(); !st.ok()) return st;
  if (values.size() != s.units.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoadFromRank0: got values for ", values.size(),
                     " units, the model has ", s.units.size()));
  }
  for (size_t u = 0; u < s.units.size(); ++u) {
    const State::Unit& unit = s.units[u];
    if (values[u].size() != unit.counts.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("LoadFromRank0: unit ", u, " got ", values[u].size(),
                       " parameters, it has ", unit.counts.size()));
    }
    for (size_t i = 0; i < unit.counts.size(); ++i) {
      if (values[u][i].size() != unit.counts[i]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "LoadFromRank0: unit ", u, " parameter ", i, " got ",
            values[u][i].size(), " elements, it has ", unit.counts[i]));
      }
    }
  }
  if (absl::Status st = s.CheckNoUnitOpen("LoadFromRank0"); !st.ok()) {
    return st;
  }
  if (absl::Status st = s.DropGathered(); !st.ok()) return st;
  for (size_t u = 0; u < s.units.size(); ++u) {
    State::Unit& unit = s.units[u];
    // The values are the caller's, on the host: rank 0 copies them into a
    // flat buffer in the group's memory, which is broadcast.
    absl::StatusOr<GroupBuffer> flat =
        s.Allocate(unit.padded, absl::StrCat("unit ", u, "'s broadcast"));
    if (!flat.ok()) return s.Fail(flat.status());
    if (s.rank == 0) {
      for (size_t i = 0; i < unit.counts.size(); ++i) {
        absl::Status st =
            s.memory->FromHost(flat->floats() + unit.offsets[i],
                               values[u][i].data(), Bytes(unit.counts[i]));
        if (!st.ok()) return s.Fail(st);
      }
    }
    s.scratch_param_bytes = flat->bytes();
    s.UpdatePeak();
    std::shared_ptr<Work> work =
        s.group->Broadcast(BufferView::Of(flat->floats(), unit.padded), 0);
    s.bytes_communicated +=
        WireBytes(Traffic::kBroadcast, Bytes(unit.padded), s.group->size());
    absl::Status st = s.Wait(work, absl::StrCat("broadcast of unit ", u));
    s.scratch_param_bytes = 0;
    if (!st.ok()) return st;
    const size_t begin = s.sharded() ? s.rank * unit.shard : 0;
    st = s.memory->Copy(unit.param_shard.floats(), flat->floats() + begin,
                        Bytes(unit.shard));
    if (!st.ok()) return s.Fail(st);
  }
  return absl::OkStatus();
}

absl::Status Fsdp::BeginForward(int unit) {
  State& s = *state_;
  if (absl::Status st = s.Usable(); !st.ok()) return st;
  if (absl::Status st = s.CheckUnit("BeginForward", unit); !st.ok()) return st;
  State::Unit& u = s.units[unit];
  if (u.phase != Phase::kIdle) {
    return absl::FailedPreconditionError(absl::StrCat(
        "BeginForward(", unit, "): unit ", unit, " is already in its ",
        u.phase == Phase::kForward ? "forward; call EndForward"
                                   : "backward; call EndBackward",
        " first"));
  }
  if (absl::Status st = s.EnsureGathered(unit); !st.ok()) return st;
  if (absl::Status st = s.Prefetch(unit, +1); !st.ok()) return st;
  u.phase = Phase::kForward;
  u.open = true;
  return absl::OkStatus();
}

absl::Status Fsdp::EndForward(int unit) {
  State& s = *state_;
  if (absl::Status st = s.Usable(); !st.ok()) return st;
  if (absl::Status st = s.CheckUnit("EndForward", unit); !st.ok()) return st;
  State::Unit& u = s.units[unit];
  if (u.phase != Phase::kForward) {
    return absl::FailedPreconditionError(absl::StrCat(
        "EndForward(", unit, "): unit ", unit,
        " is not in its forward; call BeginForward(", unit, ") first"));
  }
  u.phase = Phase::kIdle;
  // The last unit's backward comes next, so FULL_SHARD keeps it rather
  // than gathering it again at once.
  if (s.options.strategy == ShardingStrategy::kFullShard &&
      unit != num_units() - 1) {
    s.FreeFull(unit);
  }
  return absl::OkStatus();
}

absl::Status Fsdp::BeginBackward(int unit) {
  State& s = *state_;
  if (absl::Status st = s.Usable(); !st.ok()) return st;
  if (absl::Status st = s.CheckUnit("BeginBackward", unit); !st.ok()) {
    return st;
  }
  State::Unit& u = s.units[unit];
  if (u.phase != Phase::kIdle) {
    return absl::FailedPreconditionError(absl::StrCat(
        "BeginBackward(", unit, "): unit ", unit, " is already in its ",
        u.phase == Phase::kForward ? "forward; call EndForward"
                                   : "backward; call EndBackward",
        " first"));
  }
  if (absl::Status st = s.EnsureGathered(unit); !st.ok()) return st;
  if (absl::Status st = s.Prefetch(unit, -1); !st.ok()) return st;
  absl::StatusOr<GroupBuffer> grad =
      s.Allocate(u.padded, absl::StrCat("unit ", unit, "'s full gradient"));
  if (!grad.ok()) return s.Fail(grad.status());
  u.grad = std::move(*grad);
  s.UpdatePeak();
  u.phase = Phase::kBackward;
  u.open = true;
  return absl::OkStatus();
}

absl::Status Fsdp::EndBackward(int unit) {
  State& s = *state_;
  if (absl::Status st = s.Usable(); !st.ok()) return st;
  if (absl::Status st = s.CheckUnit("EndBackward", unit); !st.ok()) return st;
  State::Unit& u = s.units[unit];
  if (u.phase != Phase::kBackward) {
    return absl::FailedPreconditionError(absl::StrCat(
        "EndBackward(", unit, "): unit ", unit,
        " is not in its backward; call BeginBackward(", unit, ") first"));
  }
  u.phase = Phase::kIdle;
  s.backward_since_finish = true;
  State::PendingReduction p;
  p.unit = unit;
  p.full_grad = std::move(u.grad);
  const BufferView grad = p.full_grad.view();
  if (s.sharded()) {
    absl::StatusOr<GroupBuffer> out = s.Allocate(
        u.shard, absl::StrCat("unit ", unit, "'s reduce_scatter output"));
    if (!out.ok()) return s.Fail(out.status());
    p.out = std::move(*out);
    p.work = s.group->ReduceScatter(
        grad, BufferView::Of(p.out.floats(), u.shard), ReduceOp::kAvg);
  } else {
    p.work = s.group->AllReduce(grad, ReduceOp::kAvg);
  }
  s.bytes_communicated +=
      WireBytes(s.sharded() ? Traffic::kReduceScatter : Traffic::kAllReduce,
                grad.bytes(), s.group->size());
  s.pending.push_back(std::move(p));
  s.UpdatePeak();
  // Both sharded strategies are done with the unit's parameters until the
  // next forward.
  s.FreeFull(unit);
  // Bounds the gradients held to this one and the next unit's (see top).
  while (s.pending.size() > 1) {
    if (absl::Status st = s.RetireOldest(); !st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status Fsdp::FinishBackward() {
  State& s = *state_;
  if (absl::Status st = s.Usable(); !st.ok()) return st;
  if (absl::Status st = s.CheckNoUnitOpen("FinishBackward"); !st.ok()) {
    return st;
  }
  if (!s.backward_since_finish) {
    return absl::FailedPreconditionError(
        "FinishBackward: no EndBackward since the last FinishBackward; run "
        "the backward (BeginBackward/EndBackward of each unit) first");
  }
  s.backward_since_finish = false;
  while (!s.pending.empty()) {
    if (absl::Status st = s.RetireOldest(); !st.ok()) return st;
  }
  // A prefetch nobody claimed (an unusual call order) must not stay in
  // flight behind the caller's back.
  for (size_t u = 0; u < s.units.size(); ++u) {
    if (s.units[u].gather != nullptr) {
      if (absl::Status st = s.FinishGather(u); !st.ok()) return st;
    }
  }
  return absl::OkStatus();
}

absl::Span<const float> Fsdp::param(int unit, int index) const {
  const State& s = *state_;
  if (unit < 0 || unit >= num_units() || index < 0 ||
      index >= num_params(unit)) {
    CallerBug(
        absl::StrCat("param(", unit, ", ", index, "): no such parameter"));
  }
  const State::Unit& u = s.units[unit];
  const bool held = !s.sharded() || u.gathered;
  if (!held || !u.open) {
    CallerBug(absl::StrCat("param(", unit, ", ", index, "): unit ", unit,
                           " is not gathered; call it between BeginForward or "
                           "BeginBackward and the free that follows"));
  }
  const GroupBuffer& full = s.sharded() ? u.full : u.param_shard;
  return absl::MakeConstSpan(full.floats() + u.offsets[index], u.counts[index]);
}

absl::Span<float> Fsdp::grad(int unit, int index) {
  State& s = *state_;
  if (unit < 0 || unit >= num_units() || index < 0 ||
      index >= num_params(unit)) {
    CallerBug(absl::StrCat("grad(", unit, ", ", index, "): no such parameter"));
  }
  State::Unit& u = s.units[unit];
  if (u.phase != Phase::kBackward) {
    CallerBug(absl::StrCat("grad(", unit, ", ", index, "): unit ", unit,
                           " is not in its backward; call it between "
                           "BeginBackward and EndBackward"));
  }
  return absl::MakeSpan(u.grad.floats() + u.offsets[index], u.counts[index]);
}

absl::Span<float> Fsdp::param_shard(int unit) {
  if (unit < 0 || unit >= num_units()) {
    CallerBug(absl::StrCat("param_shard(", unit, "): no such unit"));
  }
  const State::Unit& u = state_->units[unit];
  return absl::MakeSpan(u.param_shard.floats(), u.shard);
}

absl::Span<const float> Fsdp::grad_shard(int unit) const {
  if (unit < 0 || unit >= num_units()) {
    CallerBug(absl::StrCat("grad_shard(", unit, "): no such unit"));
  }
  const State::Unit& u = state_->units[unit];
  return absl::MakeConstSpan(u.grad_shard.floats(), u.shard);
}

absl::Span<float> Fsdp::grad_shard(int unit) {
  const absl::Span<const float> shard = std::as_const(*this).grad_shard(unit);
  return absl::MakeSpan(const_cast<float*>(shard.data()), shard.size());
}

absl::Status Fsdp::Step(Optimizer& optimizer) {
  State& s = *state_;
  if (absl::Status st = s.Usable(); !st.ok()) return st;
  if (absl::Status st = s.CheckNoUnitOpen("Step"); !st.ok()) return st;
  if (!s.pending.empty() || s.backward_since_finish) {
    return absl::FailedPreconditionError(
        "Step: gradient reductions are still pending; call FinishBackward "
        "first");
  }
  // Gathered copies would go stale once the shards change.
  if (absl::Status st = s.DropGathered(); !st.ok()) return st;
  for (int u = 0; u < num_units(); ++u) {
    State::Unit& unit = s.units[u];
    // In the shards' memory: on a device group, a kernel on its stream.
    absl::Status st = optimizer.StepIn(*s.memory, u, unit.param_shard.floats(),
                                       unit.grad_shard.floats(), unit.shard);
    if (!st.ok()) {
      return absl::Status(
          st.code(), absl::StrCat("Step: ", optimizer.name(), " on unit ", u,
                                  ": ", st.message()));
    }
  }
  s.optimizer_bytes = optimizer.state_bytes();
  s.UpdatePeak();
  return absl::OkStatus();
}

void Fsdp::ZeroGrad() {
  State& s = *state_;
  for (State::Unit& unit : s.units) {
    absl::Status zeroed =
        s.memory->Zero(unit.grad_shard.data(), unit.grad_shard.bytes());
    if (!zeroed.ok()) {
      // No status to return: the next call reports it.
      s.Fail(zeroed).IgnoreError();
      return;
    }
  }
}

bool Fsdp::on_device() const { return state_->memory->on_device(); }

absl::StatusOr<std::vector<float>> Fsdp::GatherFullParams(int unit) {
  State& s = *state_;
  if (absl::Status st = s.Usable(); !st.ok()) return st;
  if (absl::Status st = s.CheckUnit("GatherFullParams", unit); !st.ok()) {
    return st;
  }
  State::Unit& u = s.units[unit];
  std::vector<float> result(u.unpadded);
  const GroupBuffer* source = &u.param_shard;  // NO_SHARD: the full unit.
  GroupBuffer full;
  if (s.sharded()) {
    absl::StatusOr<GroupBuffer> gathered = s.Allocate(
        u.padded, absl::StrCat("GatherFullParams(", unit, ")'s buffer"));
    if (!gathered.ok()) return s.Fail(gathered.status());
    full = std::move(*gathered);
    std::shared_ptr<Work> work =
        s.group->AllGather(BufferView::Of(u.param_shard.floats(), u.shard),
                           BufferView::Of(full.floats(), u.padded));
    s.bytes_communicated +=
        WireBytes(Traffic::kAllGather, Bytes(u.padded), s.group->size());
    if (absl::Status st = s.Wait(
            work, absl::StrCat("GatherFullParams(", unit, "): all_gather"));
        !st.ok()) {
      return st;
    }
    source = &full;
  }
  if (absl::Status st =
          s.memory->ToHost(result.data(), source->data(), Bytes(u.unpadded));
      !st.ok()) {
    return st;
  }
  return result;
}

FsdpMemory Fsdp::memory() const { return state_->Memory(); }

size_t Fsdp::peak_gathered_bytes() const {
  return state_->peak_gathered_param_bytes;
}

uint64_t Fsdp::bytes_communicated() const { return state_->bytes_communicated; }

}  // namespace cohort
