// The smallest cohort worker: joins its job's process group from the
// environment cohortrun sets, sums one value across every rank, prints it.
// Four ranks on this node, from the workspace (one command line):
//   bazel-bin/worker/launch/cohortrun --run-id=sum --nproc-per-node=4
//       -- bazel-bin/worker/collective/examples/allreduce
#include <cstdio>

#include "worker/collective/init/init.h"

int main() {
  absl::StatusOr<std::unique_ptr<cohort::ProcessGroup>> pg =
      cohort::InitProcessGroup("gloo", "env://");
  if (!pg.ok()) {
    std::fprintf(stderr, "allreduce: %s\n", pg.status().ToString().c_str());
    return 1;
  }
  double value = (*pg)->rank() + 1;
  absl::Status done =
      (*pg)
          ->AllReduce(cohort::BufferView::Of(&value, 1), cohort::ReduceOp::kSum)
          ->Wait();
  if (!done.ok()) {
    std::fprintf(stderr, "allreduce: %s\n", done.ToString().c_str());
    return 1;
  }
  std::printf("rank %d of %d: sum of 1..%d = %g\n", (*pg)->rank(),
              (*pg)->size(), (*pg)->size(), value);
  return 0;
}
