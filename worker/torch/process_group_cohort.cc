#include "worker/torch/process_group_cohort.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "worker/collective/gloo/gloo_process_group.h"
#include "worker/torch/torch_store.h"
#include "worker/torch/torch_work.h"

namespace cohort {
namespace {

using c10d::OpType;
using Tensors = std::vector<at::Tensor>;

constexpr char kDtypes[] =
    "float32, float64, float16, bfloat16, int8, uint8, int32, int64";

// The checks below throw c10::Error, as torch's ProcessGroup API does; torch
// turns it into a Python RuntimeError.
Dtype CohortDtype(at::ScalarType type, const char* op) {
  switch (type) {
    case at::kFloat:
      return Dtype::kF32;
    case at::kDouble:
      return Dtype::kF64;
    case at::kHalf:
      return Dtype::kF16;
    case at::kBFloat16:
      return Dtype::kBF16;
    case at::kChar:
      return Dtype::kI8;
    case at::kByte:
      return Dtype::kU8;
    case at::kInt:
      return Dtype::kI32;
    case at::kLong:
      return Dtype::kI64;
    default:
      TORCH_CHECK(false, "cohort backend: ", op, " does not support dtype ",
                  type, " (supported: ", kDtypes, ")");
  }
}

// A tensor cohort can move: dense, on the CPU, of a supported dtype.
Dtype Check(const at::Tensor& tensor, const char* op) {
  TORCH_CHECK(tensor.defined(), "cohort backend: ", op,
              " got an undefined tensor");
  TORCH_CHECK(tensor.device().is_cpu(), "cohort backend: ", op,
              " needs CPU tensors, got one on ", tensor.device());
  TORCH_CHECK(tensor.layout() == at::kStrided, "cohort backend: ", op,
              " needs dense (strided) tensors, got a ", tensor.layout(),
              " one");
  return CohortDtype(tensor.scalar_type(), op);
}

// Every tensor of a list can be moved and has the dtype of `like`: an op
// moves one dtype.
void CheckAll(const Tensors& tensors, const at::Tensor& like, const char* op) {
  for (const at::Tensor& tensor : tensors) {
    Check(tensor, op);
    TORCH_CHECK(tensor.scalar_type() == like.scalar_type(),
                "cohort backend: ", op, " needs tensors of one dtype, got ",
                like.scalar_type(), " and ", tensor.scalar_type());
  }
}

at::Tensor& One(Tensors& tensors, const char* op) {
  TORCH_CHECK(tensors.size() == 1, "cohort backend: ", op,
              " takes one tensor per process, got ", tensors.size());
  return tensors[0];
}

// A list of one tensor per rank.
Tensors& PerRank(std::vector<Tensors>& lists, int size, const char* op,
                 const char* what) {
  TORCH_CHECK(lists.size() == 1, "cohort backend: ", op, " takes one ", what,
              " list per process, got ", lists.size());
  TORCH_CHECK(static_cast<int>(lists[0].size()) == size, "cohort backend: ", op,
              " needs one ", what, " tensor per rank (", size, "), got ",
              lists[0].size());
  return lists[0];
}

void CheckNumel(const Tensors& tensors, int64_t numel, const char* op,
                const char* what) {
  for (const at::Tensor& tensor : tensors) {
    TORCH_CHECK(tensor.numel() == numel, "cohort backend: ", op, " needs ",
                what, " tensors of ", numel, " elements each, got one of ",
                tensor.numel());
  }
}

// `tensor` itself if contiguous, else a contiguous copy of it.
at::Tensor Dense(const at::Tensor& tensor) {
  return tensor.is_contiguous() ? tensor : tensor.contiguous();
}

BufferView View(const at::Tensor& dense, Dtype dtype) {
  return BufferView{dense.data_ptr(), static_cast<size_t>(dense.numel()),
                    dtype};
}

// The tensors of a list laid end to end in one new flat tensor.
at::Tensor Flatten(const Tensors& tensors) {
  Tensors flat;
  flat.reserve(tensors.size());
  for (const at::Tensor& tensor : tensors) flat.push_back(tensor.reshape(-1));
  return at::cat(flat);
}

std::vector<size_t> Counts(const Tensors& tensors) {
  std::vector<size_t> counts;
  for (const at::Tensor& tensor : tensors) counts.push_back(tensor.numel());
  return counts;
}

// Copies a result computed in `dense` back into `tensor`, if they differ.
TorchWork::Finish CopyBack(const at::Tensor& tensor, const at::Tensor& dense) {
  if (dense.is_same(tensor)) return nullptr;
  return [tensor, dense]() { tensor.copy_(dense); };
}

// Copies consecutive pieces of the flat `staging` into `tensors`.
TorchWork::Finish Unflatten(const at::Tensor& staging, const Tensors& tensors) {
  return [staging, tensors]() {
    int64_t offset = 0;
    for (const at::Tensor& tensor : tensors) {
      const int64_t n = tensor.numel();
      tensor.copy_(staging.narrow(0, offset, n).view(tensor.sizes()));
      offset += n;
    }
  };
}

const char* RedOpName(c10d::ReduceOp::RedOpType op) {
  switch (op) {
    case c10d::ReduceOp::BAND:
      return "BAND";
    case c10d::ReduceOp::BOR:
      return "BOR";
    case c10d::ReduceOp::BXOR:
      return "BXOR";
    case c10d::ReduceOp::PREMUL_SUM:
      return "PREMUL_SUM";
    default:
      return "UNUSED";
  }
}

ReduceOp CohortReduceOp(const c10d::ReduceOp& op, const char* name) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return ReduceOp::kSum;
    case c10d::ReduceOp::PRODUCT:
      return ReduceOp::kProd;
    case c10d::ReduceOp::MIN:
      return ReduceOp::kMin;
    case c10d::ReduceOp::MAX:
      return ReduceOp::kMax;
    case c10d::ReduceOp::AVG:
      return ReduceOp::kAvg;
    default:
      TORCH_CHECK(false, "cohort backend: ", name, " does not support ",
                  "ReduceOp.", RedOpName(op.op_),
                  " (supported: SUM, PRODUCT, MIN, MAX, AVG)");
  }
}

int Root(int64_t root, int64_t root_tensor, const char* op) {
  TORCH_CHECK(root_tensor == 0, "cohort backend: ", op,
              " takes one tensor per process, so rootTensor must be 0, got ",
              root_tensor);
  TORCH_CHECK(root >= 0 && root <= INT32_MAX, "cohort backend: ", op,
              " got root rank ", root);
  return static_cast<int>(root);
}

}  // namespace

c10::intrusive_ptr<ProcessGroupCohort> ProcessGroupCohort::Create(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout) {
  TORCH_CHECK(store, "cohort backend: no store to bootstrap through");
  GlooOptions options;
  options.group.timeout = absl::FromChrono(timeout);
  options.store_prefix = "cohort";
  // torch's knob for the interface Gloo listens on, honoured the same way.
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    std::vector<std::string> names = absl::StrSplit(ifname, ',');
    options.interface = names[0];
  }
  if (const char* verify = std::getenv("COHORT_VERIFY_OPS")) {
    options.group.verify_ops = std::string(verify) != "0";
  }
  // Ranks of one host share memory unless COHORT_SHARED_MEMORY=0;
  // COHORT_HOST_ID (read by GlooProcessGroup) says which host a rank is on.
  if (const char* shm = std::getenv("COHORT_SHARED_MEMORY")) {
    options.shared_memory = std::string(shm) != "0";
  }
  auto adapter = std::make_shared<TorchStore>(store);
  adapter->SetTimeout(options.group.timeout);
  absl::StatusOr<std::unique_ptr<GlooProcessGroup>> group =
      GlooProcessGroup::Create(adapter, rank, size, options);
  TORCH_CHECK(group.ok(), "cohort backend: cannot create the group of rank ",
              rank, " of ", size, ": ", group.status().ToString());
  return c10::make_intrusive<ProcessGroupCohort>(*std::move(group));
}

ProcessGroupCohort::ProcessGroupCohort(
    std::unique_ptr<cohort::ProcessGroup> group)
    : c10d::ProcessGroup(group->rank(), group->size()),
      group_(std::move(group)) {
  init();  // torch's usage logging, as its own backends do.
}

namespace {
std::atomic<ProcessGroupCohort::WaitHook> wait_hook{nullptr};
}  // namespace

void ProcessGroupCohort::SetWaitHook(WaitHook hook) { wait_hook = hook; }

ProcessGroupCohort::~ProcessGroupCohort() {
  const std::function<void()> destroy = [this] { group_.reset(); };
  if (WaitHook hook = wait_hook.load()) {
    hook(destroy);
  } else {
    destroy();
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::broadcast(
    Tensors& tensors, const c10d::BroadcastOptions& opts) {
  const char* op = "broadcast";
  at::NoGradGuard no_grad;
  at::Tensor& tensor = One(tensors, op);
  const Dtype dtype = Check(tensor, op);
  const int root = Root(opts.rootRank, opts.rootTensor, op);
  at::Tensor dense = Dense(tensor);
  return TorchWork::Wrap(group_->Broadcast(View(dense, dtype), root), rank_,
                         OpType::BROADCAST, {tensor}, {tensor, dense},
                         CopyBack(tensor, dense));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::allreduce(
    Tensors& tensors, const c10d::AllreduceOptions& opts) {
  const char* op = "allreduce";
  at::NoGradGuard no_grad;
  at::Tensor& tensor = One(tensors, op);
  const Dtype dtype = Check(tensor, op);
  const ReduceOp reduce = CohortReduceOp(opts.reduceOp, op);
  at::Tensor dense = Dense(tensor);
  return TorchWork::Wrap(group_->AllReduce(View(dense, dtype), reduce), rank_,
                         OpType::ALLREDUCE, {tensor}, {tensor, dense},
                         CopyBack(tensor, dense));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::allreduce_coalesced(
    Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  const char* op = "allreduce_coalesced";
  at::NoGradGuard no_grad;
  TORCH_CHECK(!tensors.empty(), "cohort backend: ", op, " got no tensors");
  const Dtype dtype = Check(tensors[0], op);
  CheckAll(tensors, tensors[0], op);
  const ReduceOp reduce = CohortReduceOp(opts.reduceOp, op);
  at::Tensor flat = Flatten(tensors);
  Tensors keep = tensors;
  keep.push_back(flat);
  return TorchWork::Wrap(group_->AllReduce(View(flat, dtype), reduce), rank_,
                         OpType::ALLREDUCE_COALESCED, tensors, std::move(keep),
                         Unflatten(flat, tensors));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::reduce(
    Tensors& tensors, const c10d::ReduceOptions& opts) {
  const char* op = "reduce";
  at::NoGradGuard no_grad;
  at::Tensor& tensor = One(tensors, op);
  const Dtype dtype = Check(tensor, op);
  const ReduceOp reduce = CohortReduceOp(opts.reduceOp, op);
  const int root = Root(opts.rootRank, opts.rootTensor, op);
  at::Tensor dense = Dense(tensor);
  return TorchWork::Wrap(group_->Reduce(View(dense, dtype), root, reduce),
                         rank_, OpType::REDUCE, {tensor}, {tensor, dense},
                         CopyBack(tensor, dense));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::allgather(
    std::vector<Tensors>& outputs, Tensors& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* op = "allgather";
  at::NoGradGuard no_grad;
  at::Tensor& input = One(inputs, op);
  const Dtype dtype = Check(input, op);
  Tensors& out = PerRank(outputs, size_, op, "output");
  CheckAll(out, input, op);
  at::Tensor dense = Dense(input);
  const std::vector<size_t> counts = Counts(out);
  size_t total = 0;
  bool even = true;
  for (size_t count : counts) {
    total += count;
    even = even && count == static_cast<size_t>(input.numel());
  }
  at::Tensor staging =
      at::empty({static_cast<int64_t>(total)}, input.options());
  std::shared_ptr<Work> work =
      even ? group_->AllGather(View(dense, dtype), View(staging, dtype))
           : group_->AllGatherV(View(dense, dtype), View(staging, dtype),
                                counts);
  Tensors keep = out;
  keep.insert(keep.end(), {input, dense, staging});
  return TorchWork::Wrap(std::move(work), rank_, OpType::ALLGATHER, out,
                         std::move(keep), Unflatten(staging, out));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  const char* op = "_allgather_base";
  at::NoGradGuard no_grad;
  const Dtype dtype = Check(input, op);
  CheckAll({output}, input, op);
  at::Tensor in = Dense(input);
  at::Tensor out = Dense(output);
  return TorchWork::Wrap(group_->AllGather(View(in, dtype), View(out, dtype)),
                         rank_, OpType::_ALLGATHER_BASE, {output},
                         {input, in, output, out}, CopyBack(output, out));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::gather(
    std::vector<Tensors>& outputs, Tensors& inputs,
    const c10d::GatherOptions& opts) {
  const char* op = "gather";
  at::NoGradGuard no_grad;
  at::Tensor& input = One(inputs, op);
  const Dtype dtype = Check(input, op);
  const int root = Root(opts.rootRank, 0, op);
  at::Tensor dense = Dense(input);
  Tensors out;
  at::Tensor staging;
  if (rank_ == root) {
    out = PerRank(outputs, size_, op, "output");
    CheckAll(out, input, op);
    CheckNumel(out, input.numel(), op, "output");
    staging = at::empty({input.numel() * size_}, input.options());
  }
  BufferView gathered{nullptr, 0, dtype};
  if (staging.defined()) gathered = View(staging, dtype);
  Tensors keep = out;
  keep.insert(keep.end(), {input, dense});
  TorchWork::Finish finish;
  if (staging.defined()) {
    keep.push_back(staging);
    finish = Unflatten(staging, out);
  }
  return TorchWork::Wrap(group_->Gather(View(dense, dtype), gathered, root),
                         rank_, OpType::GATHER, out, std::move(keep),
                         std::move(finish));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::scatter(
    Tensors& outputs, std::vector<Tensors>& inputs,
    const c10d::ScatterOptions& opts) {
  const char* op = "scatter";
  at::NoGradGuard no_grad;
  at::Tensor& output = One(outputs, op);
  const Dtype dtype = Check(output, op);
  const int root = Root(opts.rootRank, 0, op);
  at::Tensor out = Dense(output);
  Tensors keep = {output, out};
  BufferView scattered{nullptr, 0, dtype};
  if (rank_ == root) {
    Tensors& in = PerRank(inputs, size_, op, "input");
    CheckAll(in, output, op);
    CheckNumel(in, output.numel(), op, "input");
    at::Tensor staging = Flatten(in);
    scattered = View(staging, dtype);
    keep.push_back(staging);
  }
  return TorchWork::Wrap(group_->Scatter(scattered, View(out, dtype), root),
                         rank_, OpType::SCATTER, {output}, std::move(keep),
                         CopyBack(output, out));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::reduce_scatter(
    Tensors& outputs, std::vector<Tensors>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter";
  at::NoGradGuard no_grad;
  at::Tensor& output = One(outputs, op);
  const Dtype dtype = Check(output, op);
  const ReduceOp reduce = CohortReduceOp(opts.reduceOp, op);
  Tensors& in = PerRank(inputs, size_, op, "input");
  CheckAll(in, output, op);
  CheckNumel(in, output.numel(), op, "input");
  at::Tensor staging = Flatten(in);
  at::Tensor out = Dense(output);
  return TorchWork::Wrap(
      group_->ReduceScatter(View(staging, dtype), View(out, dtype), reduce),
      rank_, OpType::REDUCE_SCATTER, {output}, {output, out, staging},
      CopyBack(output, out));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  const char* op = "_reduce_scatter_base";
  at::NoGradGuard no_grad;
  const Dtype dtype = Check(input, op);
  CheckAll({output}, input, op);
  const ReduceOp reduce = CohortReduceOp(opts.reduceOp, op);
  at::Tensor in = Dense(input);
  at::Tensor out = Dense(output);
  return TorchWork::Wrap(
      group_->ReduceScatter(View(in, dtype), View(out, dtype), reduce), rank_,
      OpType::_REDUCE_SCATTER_BASE, {output}, {input, in, output, out},
      CopyBack(output, out));
}

namespace {

// Element counts per rank of `tensor` split along dimension 0 by `splits`
// rows (equal parts when empty).
std::vector<size_t> SplitCounts(const at::Tensor& tensor,
                                const std::vector<int64_t>& splits, int size,
                                const char* what) {
  const char* op = "alltoall_base";
  TORCH_CHECK(tensor.dim() > 0, "cohort backend: ", op, " with split sizes ",
              "needs ", what, " tensors of at least one dimension");
  const int64_t rows = tensor.size(0);
  const int64_t row = rows > 0 ? tensor.numel() / rows : 0;
  std::vector<size_t> counts;
  if (splits.empty()) {
    TORCH_CHECK(rows % size == 0, "cohort backend: ", op, ": the ", what, "'s ",
                rows, " rows do not split evenly among ", size,
                " ranks; pass split sizes");
    counts.assign(size, static_cast<size_t>(rows / size * row));
    return counts;
  }
  TORCH_CHECK(static_cast<int>(splits.size()) == size, "cohort backend: ", op,
              " needs one ", what, " split size per rank (", size, "), got ",
              splits.size());
  for (int64_t split : splits) {
    TORCH_CHECK(split >= 0, "cohort backend: ", op, " got ", what,
                " split size ", split);
    counts.push_back(static_cast<size_t>(split * row));
  }
  return counts;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::alltoall_base(
    at::Tensor& output, at::Tensor& input,
    std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes,
    const c10d::AllToAllOptions& opts) {
  const char* op = "alltoall_base";
  at::NoGradGuard no_grad;
  const Dtype dtype = Check(input, op);
  CheckAll({output}, input, op);
  at::Tensor in = Dense(input);
  at::Tensor out = Dense(output);
  std::shared_ptr<Work> work;
  if (output_split_sizes.empty() && input_split_sizes.empty()) {
    work = group_->AllToAll(View(in, dtype), View(out, dtype));
  } else {
    work = group_->AllToAllV(
        View(in, dtype), SplitCounts(input, input_split_sizes, size_, "input"),
        View(out, dtype),
        SplitCounts(output, output_split_sizes, size_, "output"));
  }
  return TorchWork::Wrap(std::move(work), rank_, OpType::ALLTOALL_BASE,
                         {output}, {input, in, output, out},
                         CopyBack(output, out));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::alltoall(
    Tensors& outputs, Tensors& inputs, const c10d::AllToAllOptions& opts) {
  const char* op = "alltoall";
  at::NoGradGuard no_grad;
  TORCH_CHECK(static_cast<int>(inputs.size()) == size_ &&
                  static_cast<int>(outputs.size()) == size_,
              "cohort backend: ", op, " needs one input and one output ",
              "tensor per rank (", size_, "), got ", inputs.size(), " and ",
              outputs.size());
  const Dtype dtype = Check(inputs[0], op);
  CheckAll(inputs, inputs[0], op);
  CheckAll(outputs, inputs[0], op);
  at::Tensor in = Flatten(inputs);
  const std::vector<size_t> recv_counts = Counts(outputs);
  int64_t total = 0;
  for (size_t count : recv_counts) total += static_cast<int64_t>(count);
  at::Tensor staging = at::empty({total}, in.options());
  Tensors keep = outputs;
  keep.insert(keep.end(), {in, staging});
  return TorchWork::Wrap(group_->AllToAllV(View(in, dtype), Counts(inputs),
                                           View(staging, dtype), recv_counts),
                         rank_, OpType::ALLTOALL, outputs, std::move(keep),
                         Unflatten(staging, outputs));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::barrier(
    const c10d::BarrierOptions& opts) {
  return TorchWork::Wrap(group_->Barrier(), rank_, OpType::BARRIER, {}, {});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::send(Tensors& tensors,
                                                        int dst_rank, int tag) {
  const char* op = "send";
  at::NoGradGuard no_grad;
  at::Tensor& tensor = One(tensors, op);
  const Dtype dtype = Check(tensor, op);
  TORCH_CHECK(tag >= 0, "cohort backend: send needs a tag >= 0, got ", tag);
  at::Tensor dense = Dense(tensor);
  return TorchWork::Wrap(
      group_->Send(View(dense, dtype), dst_rank, static_cast<uint32_t>(tag)),
      rank_, OpType::SEND, {tensor}, {tensor, dense});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::recv(Tensors& tensors,
                                                        int src_rank, int tag) {
  const char* op = "recv";
  at::NoGradGuard no_grad;
  at::Tensor& tensor = One(tensors, op);
  const Dtype dtype = Check(tensor, op);
  TORCH_CHECK(tag >= 0, "cohort backend: recv needs a tag >= 0, got ", tag);
  at::Tensor dense = Dense(tensor);
  return TorchWork::Wrap(
      group_->Recv(View(dense, dtype), src_rank, static_cast<uint32_t>(tag)),
      rank_, OpType::RECV, {tensor}, {tensor, dense}, CopyBack(tensor, dense));
}

}  // namespace cohort
