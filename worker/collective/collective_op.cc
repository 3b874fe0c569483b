#include "worker/collective/collective_op.h"

#include "absl/strings/str_cat.h"

namespace cohort {
namespace {

CollectiveOp Make(OpKind kind, BufferView input, BufferView output) {
  CollectiveOp op;
  op.kind = kind;
  op.input = input;
  op.output = output;
  return op;
}

// "4 f32": a view's elements as names write them.
std::string Elements(const BufferView& view) {
  return absl::StrCat(view.count, " ", DtypeName(view.dtype));
}

}  // namespace

CollectiveOp CollectiveOp::Broadcast(BufferView buffer, int root) {
  CollectiveOp op = Make(OpKind::kBroadcast, buffer, buffer);
  op.root = root;
  return op;
}

CollectiveOp CollectiveOp::AllReduce(BufferView buffer, ReduceOp reduce) {
  CollectiveOp op = Make(OpKind::kAllReduce, buffer, buffer);
  op.reduce = reduce;
  return op;
}

CollectiveOp CollectiveOp::Reduce(BufferView buffer, int root,
                                  ReduceOp reduce) {
  CollectiveOp op = Make(OpKind::kReduce, buffer, buffer);
  op.root = root;
  op.reduce = reduce;
  return op;
}

CollectiveOp CollectiveOp::AllGather(BufferView input, BufferView output) {
  return Make(OpKind::kAllGather, input, output);
}

CollectiveOp CollectiveOp::AllGatherV(BufferView input, BufferView output,
                                      absl::Span<const size_t> counts) {
  CollectiveOp op = Make(OpKind::kAllGatherV, input, output);
  op.counts.assign(counts.begin(), counts.end());
  return op;
}

CollectiveOp CollectiveOp::Gather(BufferView input, BufferView output,
                                  int root) {
  CollectiveOp op = Make(OpKind::kGather, input, output);
  op.root = root;
  return op;
}

CollectiveOp CollectiveOp::Scatter(BufferView input, BufferView output,
                                   int root) {
  CollectiveOp op = Make(OpKind::kScatter, input, output);
  op.root = root;
  return op;
}

CollectiveOp CollectiveOp::AllToAll(BufferView input, BufferView output) {
  return Make(OpKind::kAllToAll, input, output);
}

CollectiveOp CollectiveOp::AllToAllV(BufferView input,
                                     absl::Span<const size_t> send_counts,
                                     BufferView output,
                                     absl::Span<const size_t> recv_counts) {
  CollectiveOp op = Make(OpKind::kAllToAllV, input, output);
  op.counts.assign(send_counts.begin(), send_counts.end());
  op.recv_counts.assign(recv_counts.begin(), recv_counts.end());
  return op;
}

CollectiveOp CollectiveOp::ReduceScatter(BufferView input, BufferView output,
                                         ReduceOp reduce) {
  CollectiveOp op = Make(OpKind::kReduceScatter, input, output);
  op.reduce = reduce;
  return op;
}

CollectiveOp CollectiveOp::Barrier() {
  return Make(OpKind::kBarrier, BufferView{}, BufferView{});
}

bool CollectiveOp::in_place() const {
  return kind == OpKind::kBroadcast || kind == OpKind::kAllReduce ||
         kind == OpKind::kReduce;
}

bool CollectiveOp::is_reduction() const {
  return kind == OpKind::kAllReduce || kind == OpKind::kReduce ||
         kind == OpKind::kReduceScatter;
}

bool CollectiveOp::empty() const {
  switch (kind) {
    case OpKind::kBroadcast:
    case OpKind::kAllReduce:
    case OpKind::kReduce:
    case OpKind::kAllGather:
    case OpKind::kGather:
    case OpKind::kAllToAll:
      return input.count == 0;
    case OpKind::kScatter:
    case OpKind::kReduceScatter:
      return output.count == 0;
    case OpKind::kAllGatherV:
    case OpKind::kAllToAllV:
    case OpKind::kBarrier:
      return false;
  }
  return false;
}

std::string CollectiveOp::Name() const {
  const absl::string_view op = ReduceOpName(reduce);
  switch (kind) {
    case OpKind::kBroadcast:
      return absl::StrCat("Broadcast of ", Elements(input), " from root ",
                          root);
    case OpKind::kAllReduce:
      return absl::StrCat("AllReduce ", op, " of ", Elements(input));
    case OpKind::kReduce:
      return absl::StrCat("Reduce ", op, " of ", Elements(input), " to root ",
                          root);
    case OpKind::kAllGather:
      return absl::StrCat("AllGather of ", Elements(input));
    case OpKind::kAllGatherV:
      return absl::StrCat("AllGatherV of ", Elements(output));
    case OpKind::kGather:
      return absl::StrCat("Gather of ", Elements(input), " to root ", root);
    case OpKind::kScatter:
      return absl::StrCat("Scatter of ", Elements(output), " from root ", root);
    case OpKind::kAllToAll:
      return absl::StrCat("AllToAll of ", Elements(input));
    case OpKind::kAllToAllV:
      return absl::StrCat("AllToAllV of ", DtypeName(input.dtype));
    case OpKind::kReduceScatter:
      return absl::StrCat("ReduceScatter ", op, " of ", Elements(input));
    case OpKind::kBarrier:
      return "Barrier";
  }
  return "unknown op";
}

absl::Status CollectiveOp::Check(const GroupShape& group) const {
  switch (kind) {
    case OpKind::kBroadcast:
      return CheckBroadcast(group, input, root);
    case OpKind::kAllReduce:
      return CheckAllReduce(group, input);
    case OpKind::kReduce:
      return CheckReduce(group, input, root);
    case OpKind::kAllGather:
      return CheckAllGather(group, input, output);
    case OpKind::kAllGatherV:
      return CheckAllGatherV(group, input, output, counts);
    case OpKind::kGather:
      return CheckGather(group, input, output, root);
    case OpKind::kScatter:
      return CheckScatter(group, input, output, root);
    case OpKind::kAllToAll:
      return CheckAllToAll(group, input, output);
    case OpKind::kAllToAllV:
      return CheckAllToAllV(group, input, counts, output, recv_counts);
    case OpKind::kReduceScatter:
      return CheckReduceScatter(group, input, output);
    case OpKind::kBarrier:
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError("unknown op");
}

std::string PointToPointOp::Name() const {
  return is_send ? absl::StrCat("Send to rank ", peer, " with tag ", tag)
                 : absl::StrCat("Recv from rank ", peer, " with tag ", tag);
}

absl::Status PointToPointOp::Check(const GroupShape& group) const {
  return CheckPointToPoint(group, Name(), buffer, peer);
}

}  // namespace cohort
