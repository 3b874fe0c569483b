#include "worker/parallel/examples/trainer.h"

#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "worker/checkpoint/training_state.h"
#include "worker/parallel/ddp.h"
#include "worker/parallel/examples/data.h"
#include "worker/parallel/examples/mlp.h"
#include "worker/parallel/fsdp.h"
#include "worker/parallel/optimizer.h"
#include "worker/parallel/powersgd.h"

namespace cohort::examples {
namespace {

constexpr absl::string_view kModeNames[] = {
    "local", "ddp", "fsdp", "fsdp_grad_op", "fsdp_no_shard", "compute_only"};

bool IsFsdp(TrainMode mode) {
  return mode == TrainMode::kFsdp || mode == TrainMode::kFsdpGradOp ||
         mode == TrainMode::kFsdpNoShard;
}

ShardingStrategy StrategyOf(TrainMode mode) {
  switch (mode) {
    case TrainMode::kFsdpGradOp:
      return ShardingStrategy::kShardGradOp;
    case TrainMode::kFsdpNoShard:
      return ShardingStrategy::kNoShard;
    default:
      return ShardingStrategy::kFullShard;
  }
}

absl::Status CheckConfig(const TrainConfig& c, int world) {
  if (c.dims.size() < 2 || c.teacher_dims.size() < 2) {
    return absl::InvalidArgumentError(
        "dims and teacher_dims need at least an input and an output size");
  }
  for (int d : c.dims) {
    if (d <= 0) return absl::InvalidArgumentError("every dim must be > 0");
  }
  for (int d : c.teacher_dims) {
    if (d <= 0)
      return absl::InvalidArgumentError("every teacher dim must be > 0");
  }
  if (c.dims.front() != c.teacher_dims.front() ||
      c.dims.back() != c.teacher_dims.back()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the student (", absl::StrJoin(c.dims, ","),
                     ") and the teacher (", absl::StrJoin(c.teacher_dims, ","),
                     ") must have the same input and output sizes"));
  }
  if (c.steps <= 0 || c.grad_accum <= 0 || c.log_every <= 0) {
    return absl::InvalidArgumentError(
        "steps, grad_accum and log_every must be > 0");
  }
  if (c.global_batch <= 0 || c.global_batch % (world * c.grad_accum) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("global_batch ", c.global_batch,
                     " must be a positive multiple of world size (", world,
                     ") x grad_accum (", c.grad_accum, ")"));
  }
  if (c.inject_inf_step < 0 || c.inject_inf_rank < 0 ||
      (c.inject_inf_step > 0 && c.precision != Precision::kF16)) {
    return absl::InvalidArgumentError(
        "inject_inf_step and inject_inf_rank must be >= 0, and an injected "
        "inf needs fp16 (only fp16's loss scaling skips steps)");
  }
  if (c.checkpoint_every < 0) {
    return absl::InvalidArgumentError("checkpoint_every must be >= 0");
  }
  if (c.samples < static_cast<size_t>(c.global_batch)) {
    return absl::InvalidArgumentError(
        absl::StrCat("samples (", c.samples,
                     ") must be at least global_batch (", c.global_batch, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Optimizer>> MakeOptimizer(const TrainConfig& c) {
  if (c.optimizer == "sgd") {
    return NewSgd({.lr = c.lr, .momentum = c.momentum});
  }
  if (c.optimizer == "adam") return NewAdam({.lr = c.lr, .eps = c.adam_eps});
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown optimizer '", c.optimizer, "'; expected sgd or adam"));
}

absl::StatusOr<std::shared_ptr<CommHook>> MakeHook(const TrainConfig& c,
                                                   const Mlp& mlp) {
  const std::string& name = c.comm_hook;
  if (name == "none") return AllReduceHook();
  if (name == "fp16") return Fp16CompressHook();
  if (name == "bf16") return Bf16CompressHook();
  if (name == "powersgd") {
    // Layer l's weight is dims[l+1] x dims[l], column-major; its bias a
    // column.
    std::vector<MatrixShape> shapes;
    for (int l = 0; l < mlp.num_layers(); ++l) {
      const size_t out = mlp.dims()[l + 1], in = mlp.dims()[l];
      shapes.push_back({out, in});
      shapes.push_back({out, 1});
    }
    PowerSgdOptions options;
    options.matrix_approximation_rank = c.powersgd_rank;
    options.start_powersgd_iter = c.powersgd_start_step;
    options.seed = c.seed;
    absl::StatusOr<std::shared_ptr<PowerSgdHook>> hook =
        PowerSgdHook::Create(options, std::move(shapes));
    if (!hook.ok()) return hook.status();
    return std::shared_ptr<CommHook>(*std::move(hook));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown comm_hook '", name, "'; expected none, fp16, bf16 or powersgd"));
}

// The data this rank trains on: its sampler's indices for the current
// epoch, and where the next batch starts.
class Batches {
 public:
  Batches(const Dataset& data, int world, int rank, uint64_t seed,
          size_t global_batch)
      : data_(data),
        sampler_(data.size(), world, rank, seed),
        per_rank_(global_batch / world),
        // Whole global batches only (drop_last), so that every rank, at any
        // world size, walks the same global batches.
        batches_per_epoch_(data.size() / global_batch) {}

  // Moves past the first `steps` global batches, as if they were taken:
  // where training resumed from a checkpoint continues.
  void SkipSteps(int steps) {
    const size_t per_epoch = batches_per_epoch_ * per_rank_;
    const size_t taken = static_cast<size_t>(steps) * per_rank_;
    epoch_ = static_cast<int>(taken / per_epoch);
    indices_ = sampler_.Indices(epoch_++);
    offset_ = taken % per_epoch;
  }

  // The next `count` samples of this rank's share of the current global
  // batch, as (inputs, targets).
  std::pair<Matrix, Matrix> Next(size_t count) {
    if (indices_.empty() || offset_ == batches_per_epoch_ * per_rank_) {
      indices_ = sampler_.Indices(epoch_++);
      offset_ = 0;
    }
    std::pair<Matrix, Matrix> batch{
        Columns(data_.inputs, indices_, offset_, count),
        Columns(data_.targets, indices_, offset_, count)};
    offset_ += count;
    return batch;
  }

 private:
  const Dataset& data_;
  DistributedSampler sampler_;
  size_t per_rank_;
  size_t batches_per_epoch_;
  std::vector<size_t> indices_;
  size_t offset_ = 0;
  int epoch_ = 0;
};

// The step loop shared by every mode; `step` runs one optimizer step on
// `micro` micro-batches and returns this rank's mean loss.
struct Loop {
  const TrainConfig& config;
  ProcessGroup* group;  // Null: no loss reduction.
  const std::function<void(int, float)>& on_log;
  // Saves a checkpoint of step s (the mode's training state).
  std::function<absl::Status(int s)> save = nullptr;
  int first = 1;  // The first step to run (after a resumed checkpoint's).

  absl::Status Run(const std::function<absl::StatusOr<float>(int s)>& step,
                   TrainReport& report) {
    const absl::Time start = absl::Now();
    absl::Time after_first = start;
    for (int s = first; s <= config.steps; ++s) {
      if (config.timeline != nullptr) {
        config.timeline->BeginStep(s, Timeline::NowMicros());
      }
      absl::StatusOr<float> loss = step(s);
      if (!loss.ok()) {
        return absl::Status(
            loss.status().code(),
            absl::StrCat("step ", s, ": ", loss.status().message()));
      }
      if (s == 1 || s % config.log_every == 0 || s == config.steps) {
        float global = *loss;
        if (group != nullptr && group->size() > 1) {
          absl::Status reduced =
              group->AllReduce(BufferView::Of(&global, 1), ReduceOp::kAvg)
                  ->Wait();
          if (!reduced.ok()) return reduced;
        }
        report.logged_steps.push_back(s);
        report.losses.push_back(global);
        if (on_log) on_log(s, global);
      }
      if (save != nullptr && config.checkpoint_writer != nullptr &&
          config.checkpoint_every > 0 &&
          (s % config.checkpoint_every == 0 || s == config.steps)) {
        const absl::Time before = absl::Now();
        if (absl::Status saved = save(s); !saved.ok()) {
          return absl::Status(saved.code(), absl::StrCat("saving step ", s, ": ",
                                                         saved.message()));
        }
        report.checkpoint_stall_seconds +=
            absl::ToDoubleSeconds(absl::Now() - before);
        ++report.checkpoints_saved;
      }
      if (config.timeline != nullptr) {
        config.timeline->EndStep(Timeline::NowMicros());
      }
      if (s == first) after_first = absl::Now();
    }
    if (config.checkpoint_writer != nullptr) {
      if (absl::Status s = config.checkpoint_writer->Wait(); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat("saving the last checkpoint: ",
                                                   s.message()));
      }
    }
    const absl::Time end = absl::Now();
    report.seconds = absl::ToDoubleSeconds(end - start);
    const int ran = config.steps - first + 1;
    if (ran > 1) {
      report.steps_per_second =
          (ran - 1) / absl::ToDoubleSeconds(end - after_first);
    } else if (ran == 1) {
      report.steps_per_second = 1 / report.seconds;
    }
    return absl::OkStatus();
  }

  // Where a resumed run starts: after the checkpoint's step.
  void ResumeAfter(int step, TrainReport& report) {
    first = step + 1;
    report.resumed_after = step;
  }
};

size_t TotalBytes(const std::vector<std::vector<float>>& tensors) {
  size_t bytes = 0;
  for (const auto& t : tensors) bytes += t.size() * sizeof(float);
  return bytes;
}

void Finalize(std::vector<std::vector<float>> params, TrainReport& report) {
  report.params.clear();
  for (const auto& t : params) {
    report.params.insert(report.params.end(), t.begin(), t.end());
  }
  report.checksum = 0;
  for (float v : report.params) report.checksum += v;
}

// What every mode starts from: the model, this rank's share of the data,
// the optimizer.
struct Job {
  Job(const TrainConfig& c, int world, int rank)
      : config(c),
        rank(rank),
        mlp(c.dims),
        data(MakeTeacherDataset(c.samples, c.teacher_dims, c.seed)),
        batches(data, world, rank, c.seed, c.global_batch),
        micro(c.global_batch / world / c.grad_accum) {}
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  absl::Status Init() {
    absl::StatusOr<std::unique_ptr<Optimizer>> made = MakeOptimizer(config);
    if (!made.ok()) return made.status();
    optimizer = std::move(*made);
    mlp.set_precision(config.precision);
    if (config.precision == Precision::kF16) {
      absl::StatusOr<LossScaler> created = LossScaler::Create(config.loss_scaler);
      if (!created.ok()) return created.status();
      scaler.emplace(*created);
    }
    return absl::OkStatus();
  }

  // The parameters forward and backward use: `params` themselves in f32,
  // else copies rounded to the compute precision, refreshed from them
  // (once a step: the optimizer moves the f32 masters).
  const std::vector<std::vector<float>>& ComputeParams(
      const std::vector<std::vector<float>>& params) {
    if (config.precision == Precision::kF32) return params;
    rounded.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      rounded[i].resize(params[i].size());
      RoundCopy(config.precision, params[i], absl::MakeSpan(rounded[i]));
    }
    return rounded;
  }

  // Layer `layer`'s gradients as backward left them, rounded to the compute
  // precision (fp16 overflows to inf here), and the inf fault drill.
  void FinishLayerGrads(int step, int layer, absl::Span<float> weight,
                        absl::Span<float> bias) const {
    RoundInPlace(config.precision, weight);
    RoundInPlace(config.precision, bias);
    if (layer == 0 && step == config.inject_inf_step &&
        rank == config.inject_inf_rank && !weight.empty()) {
      weight[0] = std::numeric_limits<float>::infinity();
    }
  }

  // fp16: unscales the reduced gradients and says whether step `step` is
  // skipped, the same answer on every rank of `group` (a found-inf flag
  // all_reduced). Without loss scaling: never, and `grads` (which lists
  // them) is not called, so f32 and bf16 steps build nothing here.
  absl::StatusOr<bool> UnscaleAndCheck(
      int step, const std::function<std::vector<absl::Span<float>>()>& grads,
      ProcessGroup* group, TrainReport& report) {
    if (!scaler.has_value()) return false;
    absl::StatusOr<bool> found = scaler->UnscaleAndCheck(grads(), group);
    if (!found.ok()) return found.status();
    scaler->Update(*found);
    if (*found) report.skipped_steps.push_back(step);
    report.loss_scale = scaler->scale();
    return *found;
  }

  float loss_scale() const { return scaler.has_value() ? scaler->scale() : 1; }

  // The loss scaler's state, saved beside the optimizer's.
  std::map<std::string, std::string> ScalerAttributes() const {
    if (!scaler.has_value()) return {};
    return {{"loss_scale", absl::StrFormat("%.9g", scaler->scale())},
            {"loss_scale.clean_steps", absl::StrCat(scaler->clean_steps())}};
  }

  // Takes the loss scaler's state from a checkpoint that has it (one saved
  // without fp16 leaves the scaler at its initial scale).
  absl::Status RestoreScaler(const CheckpointReader& reader, TrainReport& report) {
    if (!scaler.has_value()) return absl::OkStatus();
    const auto& attributes = reader.metadata().attributes();
    const auto scale = attributes.find("loss_scale");
    const auto clean = attributes.find("loss_scale.clean_steps");
    if (scale == attributes.end() || clean == attributes.end()) {
      return absl::OkStatus();
    }
    float value = 0;
    int steps = 0;
    if (!absl::SimpleAtof(scale->second, &value) ||
        !absl::SimpleAtoi(clean->second, &steps)) {
      return absl::DataLossError(absl::StrCat(
          reader.folder(), ": loss scaler attributes '", scale->second,
          "', '", clean->second, "' are not numbers"));
    }
    if (absl::Status s = scaler->Restore(value, steps); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat(reader.folder(), ": ", s.message()));
    }
    report.loss_scale = scaler->scale();
    return absl::OkStatus();
  }

  // Takes the next micro-batch and runs it forward, layer l with the
  // parameters `params(l)` returns once `before(l)` succeeded (FSDP
  // gathers there) and then `after(l)`. Returns the micro-batch's loss
  // divided by the number of micro-batches, the backward seeded to match.
  absl::StatusOr<float> Forward(
      const std::function<Mlp::LayerParams(int)>& params,
      const std::function<absl::Status(int)>& before = nullptr,
      const std::function<absl::Status(int)>& after = nullptr) {
    Timeline* const timeline = config.timeline;
    std::optional<ComputeSpan> data_span(std::in_place, timeline, "data", step);
    auto [x, y] = batches.Next(micro);
    mlp.Begin(x);
    data_span.reset();
    for (int l = 0; l < mlp.num_layers(); ++l) {
      if (before) {
        if (absl::Status s = before(l); !s.ok()) return s;
      }
      {
        ComputeSpan span(timeline, "forward", step, l);
        mlp.Forward(l, params(l));
      }
      if (after) {
        if (absl::Status s = after(l); !s.ok()) return s;
      }
    }
    ComputeSpan span(timeline, "loss", step);
    return mlp.Loss(y, loss_scale() / config.grad_accum) / config.grad_accum;
  }

  // Steps every whole parameter i with the gradient `grad(i)` returns.
  absl::Status StepReplica(
      std::vector<std::vector<float>>& params,
      const std::function<absl::Span<const float>(int)>& grad) {
    ComputeSpan span(config.timeline, "optimizer", step);
    for (size_t i = 0; i < params.size(); ++i) {
      const int slot = static_cast<int>(i);
      absl::Status stepped =
          optimizer->Step(slot, absl::MakeSpan(params[i]), grad(slot));
      if (!stepped.ok()) return stepped;
    }
    return absl::OkStatus();
  }

  // Fills the report of a mode that keeps whole replicas.
  void ReportReplica(std::vector<std::vector<float>> params, size_t grad_bytes,
                     TrainReport& report) const {
    report.param_bytes = TotalBytes(params);
    report.grad_bytes = grad_bytes;
    report.optimizer_bytes = optimizer->state_bytes();
    report.peak_bytes =
        report.param_bytes + report.grad_bytes + report.optimizer_bytes;
    Finalize(std::move(params), report);
  }

  const TrainConfig& config;
  const int rank;
  Mlp mlp;
  const Dataset data;  // Before batches, which refers to it.
  Batches batches;
  const size_t micro;  // Samples per micro-batch on this rank.
  std::unique_ptr<Optimizer> optimizer;
  std::optional<LossScaler> scaler;          // fp16 only.
  std::vector<std::vector<float>> rounded;  // ComputeParams' copies.
  int step = 0;  // The step running, for the timeline's spans.
};

std::vector<absl::Span<float>> SpansOf(std::vector<std::vector<float>>& v) {
  std::vector<absl::Span<float>> spans;
  for (auto& t : v) spans.push_back(absl::MakeSpan(t));
  return spans;
}

// Resumes a replica's training state from config.resume_from, if given.
absl::Status ResumeReplica(const TrainConfig& c, Job& job,
                           std::vector<std::vector<float>>& params, Loop& loop,
                           TrainReport& report) {
  if (c.resume_from == nullptr) return absl::OkStatus();
  if (absl::Status s = LoadReplicaState(*c.resume_from, params, *job.optimizer);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = job.RestoreScaler(*c.resume_from, report); !s.ok()) {
    return s;
  }
  const int step = static_cast<int>(c.resume_from->step());
  job.batches.SkipSteps(step);
  loop.ResumeAfter(step, report);
  return absl::OkStatus();
}

Mlp::LayerParams LayerOf(const std::vector<std::vector<float>>& params, int l) {
  return {params[2 * l].data(), params[2 * l + 1].data()};
}

// local and compute_only: plain loops, no group.
absl::StatusOr<TrainReport> TrainAlone(const TrainConfig& c, int world,
                                       int rank, Loop& loop) {
  Job job(c, world, rank);
  if (absl::Status s = job.Init(); !s.ok()) return s;
  std::vector<std::vector<float>> params = job.mlp.Init(c.seed);
  std::vector<std::vector<float>> grads;
  for (const auto& p : params) grads.emplace_back(p.size());

  TrainReport report;
  if (absl::Status s = ResumeReplica(c, job, params, loop, report); !s.ok()) {
    return s;
  }
  loop.save = [&](int step) {
    return SaveReplicaState(*c.checkpoint_writer, c.checkpoint_async, step,
                            rank, world, params, *job.optimizer,
                            job.ScalerAttributes());
  };
  absl::Status status = loop.Run(
      [&](int step) -> absl::StatusOr<float> {
        job.step = step;
        for (auto& g : grads) std::fill(g.begin(), g.end(), 0.0f);
        const std::vector<std::vector<float>>& compute =
            job.ComputeParams(params);
        float loss = 0;
        for (int m = 0; m < c.grad_accum; ++m) {
          absl::StatusOr<float> micro_loss =
              job.Forward([&](int l) { return LayerOf(compute, l); });
          if (!micro_loss.ok()) return micro_loss.status();
          loss += *micro_loss;
          for (int l = job.mlp.num_layers() - 1; l >= 0; --l) {
            ComputeSpan span(c.timeline, "backward", step, l);
            job.mlp.Backward(l, LayerOf(compute, l),
                             {grads[2 * l].data(), grads[2 * l + 1].data()});
            job.FinishLayerGrads(step, l, absl::MakeSpan(grads[2 * l]),
                                 absl::MakeSpan(grads[2 * l + 1]));
          }
        }
        absl::StatusOr<bool> skip =
            job.UnscaleAndCheck(step, [&] { return SpansOf(grads); }, nullptr,
                                report);
        if (!skip.ok()) return skip.status();
        if (*skip) return loss;
        absl::Status stepped = job.StepReplica(
            params, [&](int i) { return absl::MakeConstSpan(grads[i]); });
        if (!stepped.ok()) return stepped;
        return loss;
      },
      report);
  if (!status.ok()) return status;
  job.ReportReplica(std::move(params), TotalBytes(grads), report);
  return report;
}

absl::StatusOr<TrainReport> TrainDdp(const TrainConfig& c,
                                     std::shared_ptr<ProcessGroup> group,
                                     Loop& loop) {
  Job job(c, group->size(), group->rank());
  if (absl::Status s = job.Init(); !s.ok()) return s;
  std::vector<std::vector<float>> params = job.mlp.Init(c.seed);
  TrainReport report;
  if (absl::Status s = ResumeReplica(c, job, params, loop, report); !s.ok()) {
    return s;
  }
  loop.save = [&](int step) {
    return SaveReplicaState(*c.checkpoint_writer, c.checkpoint_async, step,
                            group->rank(), group->size(), params,
                            *job.optimizer, job.ScalerAttributes());
  };
  std::vector<BufferView> views;
  for (auto& p : params) views.push_back(BufferView::Of(p.data(), p.size()));
  if (absl::Status s = BroadcastFromRank0(*group, views); !s.ok()) return s;

  absl::StatusOr<std::shared_ptr<CommHook>> hook = MakeHook(c, job.mlp);
  if (!hook.ok()) return hook.status();
  ReducerOptions options;
  options.first_bucket_bytes = c.first_bucket_bytes;
  options.bucket_cap_bytes = c.bucket_cap_bytes;
  options.overlap = c.overlap;
  options.hook = *hook;
  absl::StatusOr<std::unique_ptr<Reducer>> reducer =
      Reducer::Create(group, job.mlp.ParamSizes(), options);
  if (!reducer.ok()) return reducer.status();
  Reducer& r = **reducer;

  absl::Status status = loop.Run(
      [&](int step) -> absl::StatusOr<float> {
        job.step = step;
        r.ZeroGrad();
        const std::vector<std::vector<float>>& compute =
            job.ComputeParams(params);
        float loss = 0;
        for (int m = 0; m < c.grad_accum; ++m) {
          std::optional<Reducer::NoSyncScope> no_sync;
          if (m + 1 < c.grad_accum) no_sync.emplace(r);
          absl::StatusOr<float> micro_loss =
              job.Forward([&](int l) { return LayerOf(compute, l); });
          if (!micro_loss.ok()) return micro_loss.status();
          loss += *micro_loss;
          // Backward produces each layer's gradients last layer first, and
          // hands each to the reducer as soon as it is final, so the
          // buckets of later layers are on the wire while earlier layers
          // still compute.
          for (int l = job.mlp.num_layers() - 1; l >= 0; --l) {
            {
              ComputeSpan span(c.timeline, "backward", step, l);
              job.mlp.Backward(
                  l, LayerOf(compute, l),
                  {r.grad(2 * l).data(), r.grad(2 * l + 1).data()});
              job.FinishLayerGrads(step, l, r.grad(2 * l), r.grad(2 * l + 1));
            }
            if (absl::Status s = r.MarkReady(2 * l + 1); !s.ok()) return s;
            if (absl::Status s = r.MarkReady(2 * l); !s.ok()) return s;
          }
          if (absl::Status s = r.Finish(); !s.ok()) return s;
        }
        absl::StatusOr<bool> skip = job.UnscaleAndCheck(
            step,
            [&] {
              std::vector<absl::Span<float>> reduced;
              for (int i = 0; i < r.num_params(); ++i) {
                reduced.push_back(r.grad(i));
              }
              return reduced;
            },
            group.get(), report);
        if (!skip.ok()) return skip.status();
        if (*skip) return loss;
        absl::Status stepped = job.StepReplica(
            params, [&](int i) { return absl::Span<const float>(r.grad(i)); });
        if (!stepped.ok()) return stepped;
        return loss;
      },
      report);
  if (!status.ok()) return status;
  report.comm_bytes = r.bytes_communicated();
  job.ReportReplica(std::move(params), r.grad_bytes(), report);
  return report;
}

absl::StatusOr<TrainReport> TrainFsdp(const TrainConfig& c,
                                      std::shared_ptr<ProcessGroup> group,
                                      Loop& loop) {
  Job job(c, group->size(), group->rank());
  if (absl::Status s = job.Init(); !s.ok()) return s;
  const int layers = job.mlp.num_layers();
  std::vector<std::vector<size_t>> units;
  for (int l = 0; l < layers; ++l) {
    units.push_back({job.mlp.weight_size(l), job.mlp.bias_size(l)});
  }
  FsdpOptions options;
  options.strategy = StrategyOf(c.mode);
  options.prefetch_depth = c.fsdp_prefetch;
  absl::StatusOr<std::unique_ptr<Fsdp>> created =
      Fsdp::Create(group, std::move(units), options);
  if (!created.ok()) return created.status();
  Fsdp& fsdp = **created;
  TrainReport report;
  if (c.resume_from != nullptr) {
    // Each rank reads its shards, re-cut for this world size.
    if (absl::Status s = LoadFsdpState(*c.resume_from, fsdp,
                                       job.mlp.ParamSizes(), *job.optimizer);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = job.RestoreScaler(*c.resume_from, report); !s.ok()) {
      return s;
    }
    const int step = static_cast<int>(c.resume_from->step());
    job.batches.SkipSteps(step);
    loop.ResumeAfter(step, report);
  } else {
    // Every rank builds the initial values (from the seed), but only rank
    // 0's count: they are broadcast, then each rank keeps its shard.
    const std::vector<std::vector<float>> initial = job.mlp.Init(c.seed);
    std::vector<std::vector<absl::Span<const float>>> values(layers);
    for (int l = 0; l < layers; ++l) {
      values[l] = {initial[2 * l], initial[2 * l + 1]};
    }
    if (absl::Status s = fsdp.LoadFromRank0(values); !s.ok()) return s;
  }

  loop.save = [&](int step) {
    return SaveFsdpState(*c.checkpoint_writer, c.checkpoint_async, step, fsdp,
                         job.mlp.ParamSizes(), *job.optimizer,
                         job.ScalerAttributes());
  };
  // The unit's gathered parameters, or copies rounded to the compute
  // precision (the f32 shards stay the masters).
  std::vector<std::vector<float>> rounded(2 * layers);
  auto params_of = [&](int l) -> Mlp::LayerParams {
    if (c.precision == Precision::kF32) {
      return {fsdp.param(l, 0).data(), fsdp.param(l, 1).data()};
    }
    for (int i = 0; i < 2; ++i) {
      const absl::Span<const float> full = fsdp.param(l, i);
      rounded[2 * l + i].resize(full.size());
      RoundCopy(c.precision, full, absl::MakeSpan(rounded[2 * l + i]));
    }
    return {rounded[2 * l].data(), rounded[2 * l + 1].data()};
  };
  absl::Status status = loop.Run(
      [&](int step) -> absl::StatusOr<float> {
        job.step = step;
        fsdp.ZeroGrad();
        float loss = 0;
        for (int m = 0; m < c.grad_accum; ++m) {
          absl::StatusOr<float> micro_loss = job.Forward(
              params_of, [&](int l) { return fsdp.BeginForward(l); },
              [&](int l) { return fsdp.EndForward(l); });
          if (!micro_loss.ok()) return micro_loss.status();
          loss += *micro_loss;
          for (int l = layers - 1; l >= 0; --l) {
            if (absl::Status s = fsdp.BeginBackward(l); !s.ok()) return s;
            {
              ComputeSpan span(c.timeline, "backward", step, l);
              job.mlp.Backward(
                  l, params_of(l),
                  {fsdp.grad(l, 0).data(), fsdp.grad(l, 1).data()});
              job.FinishLayerGrads(step, l, fsdp.grad(l, 0), fsdp.grad(l, 1));
            }
            if (absl::Status s = fsdp.EndBackward(l); !s.ok()) return s;
          }
          if (absl::Status s = fsdp.FinishBackward(); !s.ok()) return s;
        }
        // Each rank sees only its gradient shards: the found-inf flag is
        // all_reduced, so every rank skips the same steps.
        absl::StatusOr<bool> skip = job.UnscaleAndCheck(
            step,
            [&] {
              std::vector<absl::Span<float>> shards;
              for (int u = 0; u < layers; ++u) {
                shards.push_back(fsdp.grad_shard(u));
              }
              return shards;
            },
            group.get(), report);
        if (!skip.ok()) return skip.status();
        if (*skip) return loss;
        ComputeSpan span(c.timeline, "optimizer", step);
        if (absl::Status s = fsdp.Step(*job.optimizer); !s.ok()) return s;
        return loss;
      },
      report);
  if (!status.ok()) return status;
  const FsdpMemory memory = fsdp.memory();
  report.comm_bytes = fsdp.bytes_communicated();
  report.param_bytes = memory.param_bytes;
  report.grad_bytes = memory.grad_bytes;
  report.optimizer_bytes = memory.optimizer_bytes;
  report.peak_bytes = memory.peak_bytes;
  report.peak_gathered_bytes = memory.peak_gathered_param_bytes;
  std::vector<std::vector<float>> params;
  for (int l = 0; l < layers; ++l) {
    absl::StatusOr<std::vector<float>> full = fsdp.GatherFullParams(l);
    if (!full.ok()) return full.status();
    const size_t w = job.mlp.weight_size(l);
    params.emplace_back(full->begin(), full->begin() + w);
    params.emplace_back(full->begin() + w, full->end());
  }
  Finalize(std::move(params), report);
  return report;
}

}  // namespace

absl::StatusOr<TrainMode> ParseTrainMode(absl::string_view name) {
  for (size_t i = 0; i < std::size(kModeNames); ++i) {
    if (name == kModeNames[i]) return static_cast<TrainMode>(i);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown mode '", name, "'; expected one of ",
                   absl::StrJoin(kModeNames, ", ")));
}

absl::string_view TrainModeName(TrainMode mode) {
  return kModeNames[static_cast<int>(mode)];
}

absl::StatusOr<TrainReport> Train(
    const TrainConfig& config, std::shared_ptr<ProcessGroup> group,
    const std::function<void(int step, float loss)>& on_log) {
  const bool alone = config.mode == TrainMode::kLocal ||
                     config.mode == TrainMode::kComputeOnly;
  if (!alone && group == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mode ", TrainModeName(config.mode), " needs a process group"));
  }
  const int world = group != nullptr ? group->size() : 1;
  const int rank = group != nullptr ? group->rank() : 0;
  if (config.mode == TrainMode::kLocal && world != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("mode local trains in one process; this job has ", world,
                     " ranks (use ddp or fsdp)"));
  }
  if (absl::Status s = CheckConfig(config, world); !s.ok()) return s;
  // compute_only must not communicate at all, not even the loss.
  Loop loop{config,
            config.mode == TrainMode::kComputeOnly ? nullptr : group.get(),
            on_log};
  if (alone) return TrainAlone(config, world, rank, loop);
  if (IsFsdp(config.mode)) return TrainFsdp(config, std::move(group), loop);
  return TrainDdp(config, std::move(group), loop);
}

}  // namespace cohort::examples
