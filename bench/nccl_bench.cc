// nccl_bench: the NCCL backend's bus bandwidth, printed in nccl-tests'
// columns (size, count, type, redop, root, time, algbw, busbw) so that the
// figures read against nccl-tests' own (all_reduce_perf, all_gather_perf,
// reduce_scatter_perf, broadcast_perf) for the same GPUs. It asserts no
// timing. Run one process per GPU under cohortrun (tools/gpu_test.sh does):
//
//   cohortrun --coordinator=HOST:PORT --nproc-per-node=8 --
//       bazel-bin/bench/nccl_bench [--min_bytes=8 --max_bytes=1G]
//
// Each rank joins InitProcessGroup("nccl", "env://") on device $LOCAL_RANK.
// Sizes double from --min_bytes to --max_bytes; per size: --warmup ops,
// then --iters ops, each waited for (Work::Wait) before the next is issued
// (the backend runs one op at a time: nccl_process_group.h), and rank 0
// prints the mean time per op. As nccl-tests defines them, with n ranks:
//   size: all_reduce, broadcast: the buffer; all_gather: the gathered
//         output (n x each rank's input); reduce_scatter: the input
//         (n x each rank's output)
//   algbw = size / time;  busbw = algbw x 2(n-1)/n (all_reduce),
//   (n-1)/n (all_gather, reduce_scatter), 1 (broadcast)
// Buffers are f32 (type "float"); reductions are SUM.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "worker/collective/init/init.h"
#include "worker/collective/nccl/nccl_process_group.h"

ABSL_FLAG(std::string, ops, "all_reduce,all_gather,reduce_scatter,broadcast",
          "comma-separated ops, in this order");
ABSL_FLAG(std::string, min_bytes, "8", "smallest size (K, M, G suffixes)");
ABSL_FLAG(std::string, max_bytes, "1G", "largest size (K, M, G suffixes)");
ABSL_FLAG(int, warmup, 5, "ops before timing, per size");
ABSL_FLAG(int, iters, 20, "timed ops per size");
ABSL_FLAG(bool, verify_ops, false,
          "the ProcessGroup's per-op check across ranks (off, as in "
          "nccl-tests, which has none)");

namespace cohort {
namespace {

size_t ParseBytes(std::string text) {
  size_t scale = 1;
  if (!text.empty()) {
    switch (text.back()) {
      case 'K':
        scale = size_t{1} << 10;
        break;
      case 'M':
        scale = size_t{1} << 20;
        break;
      case 'G':
        scale = size_t{1} << 30;
        break;
    }
    if (scale != 1) text.pop_back();
  }
  size_t value = 0;
  if (!absl::SimpleAtoi(text, &value)) {
    std::fprintf(stderr, "nccl_bench: bad size '%s'\n", text.c_str());
    std::exit(2);
  }
  return value * scale;
}

struct Op {
  std::string name;
  double bus_factor;
  // Issues the op on `size` bytes of the buffers.
  std::function<std::shared_ptr<Work>(size_t size)> issue;
  // The size nccl-tests prints for a size that must be a multiple of this.
  size_t multiple;
};

int Main() {
  ProcessGroupOptions pg;
  pg.verify_ops = absl::GetFlag(FLAGS_verify_ops);
  pg.timeout = absl::Seconds(600);
  InitOptions init;
  init.group = pg;
  absl::StatusOr<std::unique_ptr<ProcessGroup>> created =
      InitProcessGroup("nccl", "env://", -1, -1, init);
  if (!created.ok()) {
    std::fprintf(stderr, "nccl_bench: %s\n",
                 std::string(created.status().message()).c_str());
    return 1;
  }
  auto* group = dynamic_cast<NcclProcessGroup*>(created->get());
  const int n = group->size();
  const size_t max_bytes = ParseBytes(absl::GetFlag(FLAGS_max_bytes));
  const size_t min_bytes = ParseBytes(absl::GetFlag(FLAGS_min_bytes));

  NcclApi& api = group->api();
  absl::StatusOr<void*> in = api.Alloc(group->device(), max_bytes);
  absl::StatusOr<void*> out = api.Alloc(group->device(), max_bytes);
  if (!in.ok() || !out.ok()) {
    std::fprintf(
        stderr, "nccl_bench: cannot allocate 2 x %zu bytes: %s\n", max_bytes,
        std::string((in.ok() ? out.status() : in.status()).message()).c_str());
    return 1;
  }
  group->Memset(*in, 0, max_bytes).IgnoreError();
  auto f32 = [](void* data, size_t bytes) {
    return BufferView{data, bytes / 4, Dtype::kF32};
  };
  std::vector<Op> ops = {
      {"all_reduce", 2.0 * (n - 1) / n,
       [&](size_t size) {
         return group->AllReduce(f32(*in, size), ReduceOp::kSum);
       },
       4},
      {"all_gather", double(n - 1) / n,
       [&](size_t size) {
         return group->AllGather(f32(*in, size / n), f32(*out, size));
       },
       size_t{4} * n},
      {"reduce_scatter", double(n - 1) / n,
       [&](size_t size) {
         return group->ReduceScatter(f32(*in, size), f32(*out, size / n),
                                     ReduceOp::kSum);
       },
       size_t{4} * n},
      {"broadcast", 1.0,
       [&](size_t size) { return group->Broadcast(f32(*in, size), 0); }, 4},
  };

  const bool print = group->rank() == 0;
  if (print) {
    std::printf("# nccl_bench: %d ranks, one per GPU; cohort's NCCL backend\n",
                n);
  }
  for (const std::string& wanted : std::vector<std::string>(
           absl::StrSplit(absl::GetFlag(FLAGS_ops), ','))) {
    auto op = std::find_if(ops.begin(), ops.end(),
                           [&](const Op& o) { return o.name == wanted; });
    if (op == ops.end()) {
      std::fprintf(stderr, "nccl_bench: unknown op '%s'\n", wanted.c_str());
      return 2;
    }
    if (print) {
      std::printf("#\n# %s\n", op->name.c_str());
      std::printf("# %12s %12s %8s %6s %6s %10s %8s %8s\n", "size", "count",
                  "type", "redop", "root", "time", "algbw", "busbw");
      std::printf("# %12s %12s %8s %6s %6s %10s %8s %8s\n", "(B)", "(elements)",
                  "", "", "", "(us)", "(GB/s)", "(GB/s)");
    }
    for (size_t size = min_bytes; size <= max_bytes; size *= 2) {
      const size_t rounded =
          std::max(op->multiple, size / op->multiple * op->multiple);
      if (rounded > max_bytes) break;
      for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) {
        absl::Status s = op->issue(rounded)->Wait();
        if (!s.ok()) {
          std::fprintf(stderr, "nccl_bench: %s\n", s.ToString().c_str());
          return 1;
        }
      }
      group->Barrier()->Wait().IgnoreError();
      const int iters = absl::GetFlag(FLAGS_iters);
      const absl::Time start = absl::Now();
      for (int i = 0; i < iters; ++i) {
        absl::Status s = op->issue(rounded)->Wait();
        if (!s.ok()) {
          std::fprintf(stderr, "nccl_bench: %s\n", s.ToString().c_str());
          return 1;
        }
      }
      const double us = absl::ToDoubleMicroseconds(absl::Now() - start) / iters;
      const double algbw = rounded / (us * 1e3);  // bytes/us/1e3 = GB/s
      if (print) {
        const bool reduces =
            op->name == "all_reduce" || op->name == "reduce_scatter";
        std::printf("  %12zu %12zu %8s %6s %6s %10.1f %8.2f %8.2f\n", rounded,
                    rounded / 4, "float", reduces ? "sum" : "none",
                    op->name == "broadcast" ? "0" : "-1", us, algbw,
                    algbw * op->bus_factor);
        std::fflush(stdout);
      }
    }
  }
  api.Free(*in);
  api.Free(*out);
  return 0;
}

}  // namespace
}  // namespace cohort

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return cohort::Main();
}
