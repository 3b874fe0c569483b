// The example trainer: an MLP learns a fixed random teacher network, in DDP
// or FSDP across the ranks of a cohortrun job (or alone, --mode=local).
//
//   cohortrun --nnodes=1:1 --nproc-per-node=2 -- train --mode=ddp --steps=30
//
// Rank 0 prints "step N loss=L" lines and one summary line with
// param_checksum= (the sum of all final parameters: equal, up to rounding,
// for every mode and world size at the same --seed and --global_batch),
// steps/s, the bytes each rank communicated and the bytes it held.
//
// With COHORT_TRACE=DIR each rank writes DIR/trace-rank<R>.json, a timeline
// of its compute spans and its ops (docs/debugging.md; cohortctl trace).
#include <signal.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "base/signals.h"
#include "client/checkpoint_catalog.h"
#include "client/file_store.h"
#include "client/remote_store.h"
#include "worker/checkpoint/checkpoint.h"
#include "worker/collective/init/init.h"
#include "worker/collective/trace/timeline.h"
#include "worker/parallel/examples/mlp.h"
#include "worker/parallel/examples/trainer.h"

ABSL_FLAG(std::string, mode, "ddp",
          "local | ddp | fsdp | fsdp_grad_op | fsdp_no_shard | compute_only");
ABSL_FLAG(int, steps, 30, "Optimizer steps.");
ABSL_FLAG(uint64_t, seed, 7, "Seeds the data, the teacher and the init.");
ABSL_FLAG(int, global_batch, 128,
          "Samples per step across all ranks (each rank takes 1/world).");
ABSL_FLAG(std::vector<std::string>, dims,
          std::vector<std::string>({"64", "512", "512", "512", "16"}),
          "The student MLP's layer widths, input first.");
ABSL_FLAG(std::vector<std::string>, teacher_dims,
          std::vector<std::string>({"64", "128", "16"}),
          "The teacher MLP's layer widths.");
ABSL_FLAG(int, samples, 16384, "Dataset size.");
ABSL_FLAG(std::string, optimizer, "sgd", "sgd (with --momentum) or adam.");
ABSL_FLAG(double, lr, 0.05, "Learning rate.");
ABSL_FLAG(double, momentum, 0.9, "SGD momentum.");
ABSL_FLAG(double, adam_eps, 1e-8, "Adam's epsilon.");
ABSL_FLAG(int, grad_accum, 1,
          "Micro-batches per step (DDP: all but the last under no_sync).");
ABSL_FLAG(int, log_every, 1,
          "Print the loss every N steps (and the first and last).");
ABSL_FLAG(double, first_bucket_mb, 1, "DDP: the first bucket's size, MiB.");
ABSL_FLAG(double, bucket_cap_mb, 25, "DDP: the other buckets' size, MiB.");
ABSL_FLAG(bool, overlap, true,
          "DDP: reduce buckets during backward (false: all after it).");
ABSL_FLAG(std::string, comm_hook, "none",
          "DDP: none | fp16 | bf16 | powersgd.");
ABSL_FLAG(int, powersgd_rank, 1, "DDP, --comm_hook=powersgd: the rank r.");
ABSL_FLAG(int, powersgd_start_step, 10,
          "DDP, --comm_hook=powersgd: steps of plain all_reduce first.");
ABSL_FLAG(std::string, precision, "f32",
          "Compute precision: f32 | bf16 | fp16 (f32 master weights and "
          "optimizer state; fp16 with dynamic loss scaling).");
ABSL_FLAG(int, fsdp_prefetch, 1,
          "FSDP: units gathered ahead of the one computing (0: none; k: up "
          "to k in flight, k + 1 units' parameters held under FULL_SHARD).");
ABSL_FLAG(bool, prefetch, true,
          "FSDP, kept for old command lines: false is --fsdp_prefetch=0.");
ABSL_FLAG(int, compute_threads, 1,
          "Threads per matrix product (OpenBLAS); 1 suits a rank per core.");
ABSL_FLAG(bool, verify_ops, true,
          "Ranks compare each collective before running it (see "
          "ProcessGroupOptions::verify_ops); false saves a round trip per op.");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Save sharded checkpoints in step folders here (a shared "
          "filesystem), committed through cohortd under cohortrun, else "
          "through a store file in the folder. Empty: no checkpoints.");
ABSL_FLAG(int, checkpoint_every, 10,
          "With --checkpoint_dir: save every N steps and after the last.");
ABSL_FLAG(bool, checkpoint_sync, false,
          "Save synchronously (default: a thread writes while training "
          "goes on).");
ABSL_FLAG(std::string, checkpoint_run, "",
          "Under cohortrun: the run whose checkpoints to resume from and "
          "save to (default: this run, $COHORT_RUN_ID).");
ABSL_FLAG(bool, resume, false,
          "Start from the latest committed checkpoint in --checkpoint_dir's "
          "catalog, at any world size (from the start when there is none).");
ABSL_FLAG(int, fault_kill_after_step, 0,
          "Fault drills: in a job's first attempt ($COHORT_RESTART_COUNT "
          "unset or 0) the last rank SIGKILLs itself once step N is logged "
          "(see --log_every); 0: never.");
ABSL_FLAG(bool, fault_kill_node, false,
          "With --fault_kill_after_step: the last rank SIGKILLs its parent "
          "(its node's cohortrun) before itself, so the node leaves the job "
          "instead of restarting.");
ABSL_FLAG(std::string, params_out, "",
          "Rank 0 writes the final parameters here (raw f32, in order).");

namespace {

using cohort::examples::TrainConfig;

// With COHORT_TRACE, a stop signal (cohortrun stopping the other workers of
// a job whose rank failed, or Ctrl-C) first writes the timeline, whose last
// ops are the ones that explain the stop, then ends the process as the
// signal would have.
absl::Mutex timeline_mu;
cohort::Timeline* stop_timeline ABSL_GUARDED_BY(timeline_mu) = nullptr;

// REQUIRES: no thread started yet (they must inherit the blocked mask).
void FlushTimelineOnStopSignals() {
  const sigset_t stop = cohort::base::BlockStopSignals();
  std::thread([stop] {
    int signal = 0;
    if (sigwait(&stop, &signal) != 0) return;
    {
      absl::MutexLock lock(&timeline_mu);
      if (stop_timeline != nullptr) (void)stop_timeline->Flush();
    }
    std::signal(signal, SIG_DFL);
    pthread_sigmask(SIG_UNBLOCK, &stop, nullptr);
    raise(signal);
  }).detach();
}

// Offers `timeline` to the stop signals' thread while it lives, and writes
// it as it goes: a stop signal that comes as the program ends waits for
// that write (under the lock) instead of ending the process in the middle
// of the timeline's last one.
class FlushOnStop {
 public:
  explicit FlushOnStop(cohort::Timeline* timeline) {
    absl::MutexLock lock(&timeline_mu);
    stop_timeline = timeline;
  }
  ~FlushOnStop() {
    absl::MutexLock lock(&timeline_mu);
    if (stop_timeline != nullptr) (void)stop_timeline->Flush();
    stop_timeline = nullptr;
  }
};
using cohort::examples::TrainMode;

absl::StatusOr<std::vector<int>> ParseDims(
    const std::vector<std::string>& texts, const char* flag) {
  std::vector<int> dims;
  for (const std::string& text : texts) {
    int d = 0;
    if (!absl::SimpleAtoi(text, &d) || d <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": '", text, "' is not a positive integer"));
    }
    dims.push_back(d);
  }
  return dims;
}

std::string Mib(size_t bytes) {
  return absl::StrFormat("%.2fMiB", bytes / 1048576.0);
}

// The run's checkpoint catalog, writer and resumed checkpoint, when
// --checkpoint_dir is given. Under cohortrun the catalog is cohortd's
// (COHORT_ADDR, the run's token from the environment), keyed by the run;
// alone, a FileStore in the folder.
struct Checkpoints {
  std::unique_ptr<cohort::Store> store;
  std::unique_ptr<cohort::CheckpointCatalog> catalog;
  std::unique_ptr<cohort::CheckpointWriter> writer;
  std::unique_ptr<cohort::CheckpointReader> resumed;

  absl::Status Open(TrainConfig& config, int rank, int world) {
    const std::string dir = absl::GetFlag(FLAGS_checkpoint_dir);
    if (dir.empty()) return absl::OkStatus();
    const char* address = std::getenv("COHORT_ADDR");
    const char* run = std::getenv("COHORT_RUN_ID");
    const char* round = std::getenv("COHORT_ROUND");
    std::string prefix;
    if (address != nullptr && run != nullptr) {
      cohort::RemoteStoreOptions options;
      options.address = address;
      absl::StatusOr<cohort::ConnectionOptions> with =
          cohort::WithEnvironmentCredentials(options);
      if (!with.ok()) return with.status();
      auto remote = cohort::RemoteStore::Connect(*with);
      if (!remote.ok()) return remote.status();
      store = *std::move(remote);
      const std::string named = absl::GetFlag(FLAGS_checkpoint_run);
      prefix = cohort::CheckpointPrefix(named.empty() ? run : named);
    } else {
      if (world > 1) {
        return absl::FailedPreconditionError(
            "--checkpoint_dir at world size > 1 needs cohortd (run under "
            "cohortrun): the ranks commit through it");
      }
      auto file = cohort::FileStore::Open(dir + "/catalog.store");
      if (!file.ok()) return file.status();
      store = *std::move(file);
      prefix = cohort::CheckpointPrefix("local");
    }
    catalog = std::make_unique<cohort::CheckpointCatalog>(store.get(), prefix);
    if (absl::GetFlag(FLAGS_resume)) {
      auto latest = cohort::CheckpointReader::OpenLatest(*catalog);
      if (!latest.ok()) return latest.status();
      resumed = *std::move(latest);
      config.resume_from = resumed.get();
    }
    cohort::CheckpointOptions options;
    options.dir = dir;
    options.rank = rank;
    options.world_size = world;
    options.catalog = catalog.get();
    if (round != nullptr) options.attempt = round;
    auto made = cohort::CheckpointWriter::Create(options);
    if (!made.ok()) return made.status();
    writer = *std::move(made);
    config.checkpoint_writer = writer.get();
    config.checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every);
    config.checkpoint_async = !absl::GetFlag(FLAGS_checkpoint_sync);
    return absl::OkStatus();
  }
};

absl::Status Run() {
  absl::StatusOr<TrainMode> mode =
      cohort::examples::ParseTrainMode(absl::GetFlag(FLAGS_mode));
  if (!mode.ok()) return mode.status();
  if (absl::GetFlag(FLAGS_compute_threads) <= 0) {
    return absl::InvalidArgumentError("--compute_threads must be > 0");
  }
  cohort::examples::SetComputeThreads(absl::GetFlag(FLAGS_compute_threads));
  TrainConfig config;
  config.mode = *mode;
  config.steps = absl::GetFlag(FLAGS_steps);
  config.seed = absl::GetFlag(FLAGS_seed);
  config.global_batch = absl::GetFlag(FLAGS_global_batch);
  absl::StatusOr<std::vector<int>> dims =
      ParseDims(absl::GetFlag(FLAGS_dims), "dims");
  if (!dims.ok()) return dims.status();
  config.dims = *dims;
  dims = ParseDims(absl::GetFlag(FLAGS_teacher_dims), "teacher_dims");
  if (!dims.ok()) return dims.status();
  config.teacher_dims = *dims;
  if (absl::GetFlag(FLAGS_samples) <= 0) {
    return absl::InvalidArgumentError("--samples must be > 0");
  }
  config.samples = absl::GetFlag(FLAGS_samples);
  config.optimizer = absl::GetFlag(FLAGS_optimizer);
  config.lr = static_cast<float>(absl::GetFlag(FLAGS_lr));
  config.momentum = static_cast<float>(absl::GetFlag(FLAGS_momentum));
  config.adam_eps = static_cast<float>(absl::GetFlag(FLAGS_adam_eps));
  config.grad_accum = absl::GetFlag(FLAGS_grad_accum);
  config.log_every = absl::GetFlag(FLAGS_log_every);
  config.first_bucket_bytes =
      static_cast<size_t>(absl::GetFlag(FLAGS_first_bucket_mb) * 1048576);
  config.bucket_cap_bytes =
      static_cast<size_t>(absl::GetFlag(FLAGS_bucket_cap_mb) * 1048576);
  config.overlap = absl::GetFlag(FLAGS_overlap);
  config.comm_hook = absl::GetFlag(FLAGS_comm_hook);
  config.powersgd_rank = absl::GetFlag(FLAGS_powersgd_rank);
  config.powersgd_start_step = absl::GetFlag(FLAGS_powersgd_start_step);
  absl::StatusOr<cohort::Precision> precision =
      cohort::ParsePrecision(absl::GetFlag(FLAGS_precision));
  if (!precision.ok()) return precision.status();
  config.precision = *precision;
  if (absl::GetFlag(FLAGS_fsdp_prefetch) < 0) {
    return absl::InvalidArgumentError("--fsdp_prefetch must be >= 0");
  }
  config.fsdp_prefetch =
      absl::GetFlag(FLAGS_prefetch) ? absl::GetFlag(FLAGS_fsdp_prefetch) : 0;

  if (absl::GetFlag(FLAGS_resume) &&
      absl::GetFlag(FLAGS_checkpoint_dir).empty()) {
    return absl::InvalidArgumentError("--resume needs --checkpoint_dir");
  }
  std::shared_ptr<cohort::ProcessGroup> group;
  if (config.mode != TrainMode::kLocal) {
    cohort::InitOptions init;
    init.group.verify_ops = absl::GetFlag(FLAGS_verify_ops);
    absl::StatusOr<std::unique_ptr<cohort::ProcessGroup>> created =
        cohort::InitProcessGroup("gloo", "env://", -1, -1, init);
    if (!created.ok()) return created.status();
    group = std::move(*created);
  }
  const int rank = group != nullptr ? group->rank() : 0;
  const int world = group != nullptr ? group->size() : 1;
  const bool lead = rank == 0;
  // Written once more when it goes, on every return from here.
  absl::StatusOr<std::unique_ptr<cohort::Timeline>> timeline =
      cohort::Timeline::FromEnvironment(rank, world, "trainer");
  if (!timeline.ok()) return timeline.status();
  if (*timeline != nullptr) {
    if (group != nullptr) {
      (*timeline)->AddGroup("world", group->flight_recorder(), world);
    }
    config.timeline = timeline->get();
    std::fprintf(stderr, "train: rank %d: writing a timeline to %s\n", rank,
                 (*timeline)->path().c_str());
  }
  const FlushOnStop flush_on_stop(timeline->get());
  if (lead) {
    std::printf(
        "mode=%s world=%d global_batch=%d steps=%d seed=%llu precision=%s\n",
        std::string(TrainModeName(config.mode)).c_str(), world,
        config.global_batch, config.steps,
        static_cast<unsigned long long>(config.seed),
        std::string(cohort::PrecisionName(config.precision)).c_str());
    std::fflush(stdout);
  }
  const char* restarts = std::getenv("COHORT_RESTART_COUNT");
  const bool first_attempt =
      restarts == nullptr || std::string(restarts) == "0";
  const int kill_after =
      first_attempt ? absl::GetFlag(FLAGS_fault_kill_after_step) : 0;
  Checkpoints checkpoints;
  if (absl::Status s = checkpoints.Open(config, rank, world); !s.ok()) return s;
  if (lead && config.resume_from != nullptr) {
    std::printf("resuming after step %lld from %s (saved at world %d)\n",
                static_cast<long long>(config.resume_from->step()),
                config.resume_from->folder().c_str(),
                config.resume_from->world_size());
    std::fflush(stdout);
  }
  absl::StatusOr<cohort::examples::TrainReport> report =
      Train(config, group, [&](int step, float loss) {
        if (step == kill_after && rank == world - 1) {
          const bool node = absl::GetFlag(FLAGS_fault_kill_node);
          std::fprintf(stderr,
                       "train: rank %d: SIGKILL%s after step %d "
                       "(--fault_kill_after_step)\n",
                       rank, node ? " of its node" : "", step);
          if (node) kill(getppid(), SIGKILL);
          std::raise(SIGKILL);
        }
        if (!lead) return;
        std::printf("step %d loss=%.6f\n", step, loss);
        std::fflush(stdout);
      });
  if (!report.ok()) return report.status();
  if (lead && config.precision == cohort::Precision::kF16) {
    std::printf(
        "fp16: %zu steps skipped for overflow%s%s, loss scale %g\n",
        report->skipped_steps.size(), report->skipped_steps.empty() ? "" : ": ",
        absl::StrJoin(report->skipped_steps, ",").c_str(), report->loss_scale);
    std::fflush(stdout);
  }
  if (lead && config.checkpoint_writer != nullptr) {
    std::printf(
        "checkpoints: %d saved (%s), %.3f s of steps spent saving, "
        "%.3f s writing\n",
        report->checkpoints_saved, config.checkpoint_async ? "async" : "sync",
        report->checkpoint_stall_seconds,
        config.checkpoint_writer->seconds_writing());
    std::fflush(stdout);
  }
  if (lead) {
    std::printf(
        "mode=%s world=%d param_checksum=%.9g steps_per_s=%.1f "
        "comm_bytes_per_rank=%llu (%s) mem_per_rank: params=%s grads=%s "
        "optimizer=%s peak=%s peak_gathered=%s\n",
        std::string(TrainModeName(config.mode)).c_str(), world,
        report->checksum, report->steps_per_second,
        static_cast<unsigned long long>(report->comm_bytes),
        Mib(report->comm_bytes).c_str(), Mib(report->param_bytes).c_str(),
        Mib(report->grad_bytes).c_str(), Mib(report->optimizer_bytes).c_str(),
        Mib(report->peak_bytes).c_str(),
        Mib(report->peak_gathered_bytes).c_str());
    std::fflush(stdout);
    const std::string out = absl::GetFlag(FLAGS_params_out);
    if (!out.empty()) {
      std::ofstream file(out, std::ios::binary | std::ios::trunc);
      file.write(
          reinterpret_cast<const char*>(report->params.data()),
          static_cast<std::streamsize>(report->params.size() * sizeof(float)));
      if (!file) {
        return absl::InternalError(absl::StrCat("cannot write ", out));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "trains an MLP on a teacher network's outputs; under cohortrun: "
      "cohortrun --nproc-per-node=2 -- train --mode=ddp|fsdp|fsdp_grad_op");
  if (const char* trace = std::getenv(cohort::kTraceEnv);
      trace != nullptr && *trace != '\0') {
    FlushTimelineOnStopSignals();
  }
  absl::ParseCommandLine(argc, argv);
  absl::Status status = Run();
  if (!status.ok()) {
    std::fprintf(stderr, "train: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
