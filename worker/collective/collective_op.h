// CollectiveOp and PointToPointOp: one ProcessGroup op as the caller issued
// it, in one value. The op engine (op_engine.h) checks it, names it, queues
// it and hands it to a backend's body; nothing here talks to peers.
#ifndef COHORT_WORKER_COLLECTIVE_COLLECTIVE_OP_H_
#define COHORT_WORKER_COLLECTIVE_COLLECTIVE_OP_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "worker/collective/op_checks.h"
#include "worker/collective/process_group.h"

namespace cohort {

enum class OpKind {
  kBroadcast,
  kAllReduce,
  kReduce,
  kAllGather,
  kAllGatherV,
  kGather,
  kScatter,
  kAllToAll,
  kAllToAllV,
  kReduceScatter,
  kBarrier,
};

// A collective with its arguments, as process_group.h defines them. The
// in-place ops (Broadcast, AllReduce, Reduce) have one buffer: `input` and
// `output` are the same view. Build one with the factories below.
struct CollectiveOp {
  OpKind kind = OpKind::kBarrier;
  BufferView input;
  BufferView output;
  int root = 0;                      // Broadcast, Reduce, Gather, Scatter.
  ReduceOp reduce = ReduceOp::kSum;  // AllReduce, Reduce, ReduceScatter.
  std::vector<size_t> counts;        // AllGatherV; AllToAllV's send counts.
  std::vector<size_t> recv_counts;   // AllToAllV.

  static CollectiveOp Broadcast(BufferView buffer, int root);
  static CollectiveOp AllReduce(BufferView buffer, ReduceOp op);
  static CollectiveOp Reduce(BufferView buffer, int root, ReduceOp op);
  static CollectiveOp AllGather(BufferView input, BufferView output);
  static CollectiveOp AllGatherV(BufferView input, BufferView output,
                                 absl::Span<const size_t> counts);
  static CollectiveOp Gather(BufferView input, BufferView output, int root);
  static CollectiveOp Scatter(BufferView input, BufferView output, int root);
  static CollectiveOp AllToAll(BufferView input, BufferView output);
  static CollectiveOp AllToAllV(BufferView input,
                                absl::Span<const size_t> send_counts,
                                BufferView output,
                                absl::Span<const size_t> recv_counts);
  static CollectiveOp ReduceScatter(BufferView input, BufferView output,
                                    ReduceOp op);
  static CollectiveOp Barrier();

  // Broadcast, AllReduce and Reduce.
  bool in_place() const;
  // AllReduce, Reduce and ReduceScatter: the ops that combine with `reduce`.
  bool is_reduction() const;
  // Whether the op moves no element on any rank (its counts are zero, and
  // every rank passes the same counts), so that there is nothing to run.
  // Never true of Barrier, AllGatherV and AllToAllV.
  bool empty() const;

  // What the op does in the words every rank must agree on, e.g.
  // "AllReduce SUM of 4 f32": kind, reduce op, dtype, element counts and
  // root, nothing rank-specific (AllToAllV's counts differ from rank to
  // rank, so its name leaves them out). Errors about the op start with it,
  // and verify_ops compares it across ranks.
  std::string Name() const;

  // OK or INVALID_ARGUMENT: op_checks.h's check of this kind of op.
  absl::Status Check(const GroupShape& group) const;
};

// A Send (to `peer`) or a Recv (from `peer`) of `buffer`, matched by `tag`.
struct PointToPointOp {
  bool is_send = true;
  BufferView buffer;
  int peer = 0;
  uint32_t tag = 0;

  // "Send to rank 3 with tag 7", "Recv from rank 1 with tag 7".
  std::string Name() const;
  // OK or INVALID_ARGUMENT (CheckPointToPoint).
  absl::Status Check(const GroupShape& group) const;
};

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_COLLECTIVE_OP_H_
