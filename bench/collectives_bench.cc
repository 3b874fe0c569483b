// collectives_bench: GlooProcessGroup's collectives under the load of
// bench/baselines/torch_gloo_bench.py, printed in the same fields (with
// "cohort-TRANSPORT" for "torch-gloo") so the two can be read side by side. It
// prints figures and asserts no timing.
//
// --world ranks are forked processes on this machine that find each other
// through a FileStore in a fresh temporary folder (no server), and talk over
// loopback TCP, as the torch script's ranks do.
//
// Per op and size, as the torch script: f32 buffers of ones, 2 warm-up
// calls, a barrier, then max(3, min(200, 64 MiB / bytes)) calls, each
// waited for before the next is issued; rank 0 prints the mean time per
// call. Definitions (nccl-tests' busbw factors; `bytes` as in the torch
// script, the buffer each rank passes in):
//   all_reduce      bytes = the buffer;          busbw = algbw * 2(n-1)/n
//   all_gather      bytes = each rank's input;   busbw = algbw * (n-1)/n
//                   (the output is n * bytes)
//   broadcast       bytes = the buffer;          busbw = algbw
//   reduce_scatter  bytes = each rank's input;   busbw = algbw * (n-1)/n
//                   (the output is bytes / n)
//   all_to_all      bytes = each rank's input (= its output);
//                   busbw = algbw * (n-1)/n
// with algbw = bytes / time. reduce_scatter's bytes is the size reduced, so
// its algbw reads directly against torch's all_reduce of the same bytes
// (torch's Gloo backend has no reduce_scatter; that all_reduce is how one
// gets it there).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/file_store.h"
#include "worker/collective/gloo/gloo_process_group.h"

ABSL_FLAG(int, world, 2, "ranks (forked processes on this machine)");
ABSL_FLAG(std::string, ops,
          "all_reduce,all_gather,broadcast,reduce_scatter,all_to_all",
          "comma-separated ops to run, in this order");
ABSL_FLAG(std::string, sizes, "4096,262144,4194304,67108864",
          "comma-separated buffer sizes in bytes (multiples of 4 * world)");
ABSL_FLAG(bool, verify_ops, true,
          "ProcessGroupOptions::verify_ops: ranks compare each collective "
          "before running it (a round trip per call; the group's default)");
ABSL_FLAG(int, threads, 2, "ProcessGroupOptions::threads");
ABSL_FLAG(int, calls, 0,
          "timed calls per op and size; 0: the torch script's rule "
          "(max(3, min(200, 64 MiB / bytes)))");
ABSL_FLAG(int, flight_records, 2000,
          "ProcessGroupOptions::flight_records: ops the flight recorder "
          "keeps; 0 records none (bench/flight_recorder_overhead.sh)");
ABSL_FLAG(std::string, transport, "shm",
          "shm: ranks of this host over shared memory (GlooOptions's "
          "default); tcp: loopback TCP only, as torch-gloo; hosts:N: the "
          "ranks spread over N simulated hosts (rank % N), AllReduce "
          "hierarchical");
ABSL_FLAG(int64_t, shm_slot_bytes, 1 << 20, "GlooOptions::shm.slot_bytes");

namespace cohort::bench {
namespace {

struct Config {
  int world;
  std::vector<std::string> ops;
  std::vector<size_t> sizes;
  bool verify_ops;
  int threads;
  int flight_records;
  int calls;
  bool shared_memory;
  int hosts;  // Simulated hosts; 1: the real one.
  size_t shm_slot_bytes;
  std::string store_path;
  std::string label;  // "cohort-shm", "cohort-tcp", "cohort-hosts:2".
};

double BusFactor(const std::string& op, int world) {
  const double n = world;
  if (op == "all_reduce") return 2 * (n - 1) / n;
  if (op == "broadcast") return 1;
  return (n - 1) / n;
}

// One op at one size: its buffers and one call of it.
class Case {
 public:
  Case(GlooProcessGroup& group, std::string op, size_t bytes)
      : group_(group),
        op_(std::move(op)),
        count_(bytes / sizeof(float)),
        input_(count_, 1.0f),
        output_(OutputCount(), 0.0f) {}

  absl::Status Once() {
    const int n = group_.size();
    const BufferView in = BufferView::Of(input_.data(), input_.size());
    const BufferView out = BufferView::Of(output_.data(), output_.size());
    if (op_ == "all_reduce")
      return group_.AllReduce(in, ReduceOp::kSum)->Wait();
    if (op_ == "all_gather") return group_.AllGather(in, out)->Wait();
    if (op_ == "broadcast") return group_.Broadcast(in, 0)->Wait();
    if (op_ == "reduce_scatter") {
      return group_.ReduceScatter(in, out, ReduceOp::kSum)->Wait();
    }
    if (op_ == "all_to_all") return group_.AllToAll(in, out)->Wait();
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown op '", op_, "' (world ", n, "); see --ops for the list"));
  }

  // After one call on buffers of ones: the results every rank must hold.
  absl::Status CheckFirstResult() const {
    const int n = group_.size();
    auto expect_all = [&](const std::vector<float>& v, float value,
                          const char* which) -> absl::Status {
      for (size_t i = 0; i < v.size(); ++i) {
        if (v[i] != value) {
          return absl::InternalError(absl::StrFormat(
              "%s of %d bytes on rank %d: %s[%d] is %g, expected %g", op_,
              count_ * sizeof(float), group_.rank(), which, i, v[i], value));
        }
      }
      return absl::OkStatus();
    };
    if (op_ == "all_reduce") return expect_all(input_, n, "buffer");
    if (op_ == "broadcast") return expect_all(input_, 1, "buffer");
    if (op_ == "reduce_scatter") return expect_all(output_, n, "output");
    return expect_all(output_, 1, "output");
  }

  // Buffers of ones again, so that the timed calls see ordinary numbers
  // rather than values doubled by every call.
  void Reset() { std::fill(input_.begin(), input_.end(), 1.0f); }

 private:
  size_t OutputCount() const {
    if (op_ == "all_gather") return count_ * group_.size();
    if (op_ == "reduce_scatter") return count_ / group_.size();
    if (op_ == "all_to_all") return count_;
    return 0;
  }

  GlooProcessGroup& group_;
  const std::string op_;
  const size_t count_;
  std::vector<float> input_;
  std::vector<float> output_;
};

absl::Status RunRank(const Config& config, int rank) {
  absl::StatusOr<std::unique_ptr<FileStore>> store =
      FileStore::Open(config.store_path);
  if (!store.ok()) return store.status();
  GlooOptions options;
  options.group.verify_ops = config.verify_ops;
  options.group.threads = config.threads;
  options.group.flight_records = config.flight_records;
  options.group.timeout = absl::Seconds(120);
  options.bind_address = "127.0.0.1";
  options.store_prefix = "collectives_bench";
  options.shm.enabled = config.shared_memory;
  options.shm.slot_bytes = config.shm_slot_bytes;
  if (config.hosts > 1)
    options.shm.host_id = absl::StrCat("host", rank % config.hosts);
  const absl::Time init_start = absl::Now();
  absl::StatusOr<std::unique_ptr<GlooProcessGroup>> group =
      GlooProcessGroup::Create(std::move(*store), rank, config.world, options);
  if (!group.ok()) return group.status();
  const absl::Duration init = absl::Now() - init_start;
  if (rank == 0) {
    std::printf("%s init_process_group world=%d %.1f ms\n",
                config.label.c_str(), config.world, absl::ToDoubleMilliseconds(init));
    std::fflush(stdout);
  }
  for (const std::string& op : config.ops) {
    for (size_t bytes : config.sizes) {
      Case c(**group, op, bytes);
      const int iters =
          config.calls > 0
              ? config.calls
              : static_cast<int>(std::max<size_t>(
                    3, std::min<size_t>(200, (size_t{256} << 20) / bytes / 4)));
      if (absl::Status s = c.Once(); !s.ok()) return s;
      if (absl::Status s = c.CheckFirstResult(); !s.ok()) return s;
      c.Reset();
      if (absl::Status s = c.Once(); !s.ok()) return s;
      if (absl::Status s = (*group)->Barrier()->Wait(); !s.ok()) return s;
      const absl::Time start = absl::Now();
      for (int i = 0; i < iters; ++i) {
        if (absl::Status s = c.Once(); !s.ok()) return s;
      }
      const double seconds = absl::ToDoubleSeconds(absl::Now() - start) / iters;
      const double algbw = bytes / seconds / 1e9;
      if (rank == 0) {
        std::printf(
            "%s %-10s world=%d bytes=%9zu time_us=%10.1f "
            "algbw_GBps=%7.3f busbw_GBps=%7.3f\n",
            config.label.c_str(), op.c_str(), config.world, bytes, seconds * 1e6, algbw,
            algbw * BusFactor(op, config.world));
        std::fflush(stdout);
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Config> ParseConfig() {
  Config config;
  config.world = absl::GetFlag(FLAGS_world);
  config.verify_ops = absl::GetFlag(FLAGS_verify_ops);
  config.threads = absl::GetFlag(FLAGS_threads);
  config.flight_records = absl::GetFlag(FLAGS_flight_records);
  config.calls = absl::GetFlag(FLAGS_calls);
  config.shm_slot_bytes = absl::GetFlag(FLAGS_shm_slot_bytes);
  const std::string transport = absl::GetFlag(FLAGS_transport);
  config.shared_memory = transport != "tcp";
  config.label = absl::StrCat("cohort-", transport);
  config.hosts = 1;
  if (transport != "tcp" && transport != "shm" &&
      !(absl::StartsWith(transport, "hosts:") &&
        absl::SimpleAtoi(transport.substr(6), &config.hosts) &&
        config.hosts >= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--transport=", transport, ": use shm, tcp or hosts:N (N >= 1)"));
  }
  if (config.world < 1) {
    return absl::InvalidArgumentError("--world must be at least 1");
  }
  config.ops = absl::StrSplit(absl::GetFlag(FLAGS_ops), ',', absl::SkipEmpty());
  for (absl::string_view text :
       absl::StrSplit(absl::GetFlag(FLAGS_sizes), ',', absl::SkipEmpty())) {
    size_t bytes;
    if (!absl::SimpleAtoi(text, &bytes) || bytes == 0 ||
        bytes % (sizeof(float) * config.world) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--sizes: '", text, "' is not a positive multiple of 4 * world (",
          4 * config.world, ")"));
    }
    config.sizes.push_back(bytes);
  }
  return config;
}

// This machine's limit for moving bytes within one process: memcpy of a
// 64 MiB buffer (past every cache), median of 5. Shared-memory collectives
// are bounded by it; the figures are read against it.
double MemcpyGBps() {
  constexpr size_t kBytes = 64 << 20;
  std::vector<char> from(kBytes, 1), to(kBytes, 0);
  std::vector<double> rates;
  for (int i = 0; i < 6; ++i) {
    const absl::Time start = absl::Now();
    std::memcpy(to.data(), from.data(), kBytes);
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    if (i > 0) rates.push_back(kBytes / seconds / 1e9);  // 0 warms up.
    from[i] = to[kBytes - 1 - i];  // Keeps the copies observable.
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

absl::Status Run() {
  absl::StatusOr<Config> config = ParseConfig();
  if (!config.ok()) return config.status();
  std::printf("memcpy bytes=%9zu GBps=%7.3f (one thread, median of 5)\n",
              size_t{64} << 20, MemcpyGBps());
  std::string dir =
      (std::filesystem::temp_directory_path() / "collectives_bench.XXXXXX")
          .string();
  if (mkdtemp(dir.data()) == nullptr) {
    return absl::InternalError(
        absl::StrCat("cannot create a temporary folder like ", dir));
  }
  config->store_path = dir + "/store";
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < config->world; ++rank) {
    const pid_t pid = fork();
    if (pid < 0) return absl::InternalError("fork failed");
    if (pid == 0) {
      absl::Status status = RunRank(*config, rank);
      if (!status.ok()) {
        std::fprintf(stderr, "collectives_bench: rank %d of %d: %s\n", rank,
                     config->world, status.ToString().c_str());
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(status.ok() ? 0 : 1);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  if (failed > 0) {
    return absl::InternalError(
        absl::StrCat(failed, " of ", config->world, " ranks failed"));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace cohort::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "collectives_bench --world=N [--ops=all_reduce,...] [--sizes=4096,...]\n"
      "Times GlooProcessGroup's collectives over N forked ranks on loopback, "
      "in the fields of bench/baselines/torch_gloo_bench.py.");
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = cohort::bench::Run(); !s.ok()) {
    std::fprintf(stderr, "collectives_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
