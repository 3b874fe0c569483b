#include "worker/torch/process_group_cohort.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <utility>

#include "ATen/core/grad_mode.h"
#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/collective/trace/timeline.h"
#include "worker/torch/gloo_group.h"
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

// The buffer the tensors of a list already form when each is contiguous and
// each starts where the one before ends (views of one flat tensor, as
// torch's callers often pass them): an op can use it in place of a staging
// copy. A view with no data otherwise.
BufferView Consecutive(const Tensors& tensors, Dtype dtype) {
  const BufferView none{nullptr, 0, dtype};
  if (tensors.empty()) return none;
  const char* next = static_cast<const char*>(tensors[0].data_ptr());
  size_t count = 0;
  for (const at::Tensor& tensor : tensors) {
    if (!tensor.is_contiguous() ||
        static_cast<const char*>(tensor.data_ptr()) != next) {
      return none;
    }
    next += tensor.numel() * tensor.element_size();
    count += tensor.numel();
  }
  if (next == nullptr) return none;
  return BufferView{tensors[0].data_ptr(), count, dtype};
}

std::vector<size_t> Counts(const Tensors& tensors) {
  std::vector<size_t> counts;
  for (const at::Tensor& tensor : tensors) counts.push_back(tensor.numel());
  return counts;
}

size_t Total(const std::vector<size_t>& counts) {
  size_t total = 0;
  for (size_t count : counts) total += count;
  return total;
}

// `first`, then `second`; either may be null.
TorchWork::Finish Then(TorchWork::Finish first, TorchWork::Finish second) {
  if (!first) return second;
  if (!second) return first;
  return [first = std::move(first), second = std::move(second)]() {
    first();
    second();
  };
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

// A torch reduce op as cohort runs it: cohort's op, then, for PREMUL_SUM, a
// factor the reduced result is multiplied by.
struct Reduction {
  ReduceOp op = ReduceOp::kSum;
  std::optional<double> scale;
};

#if COHORT_TORCH_BACKEND
constexpr char kReduceOps[] = "SUM, PRODUCT, MIN, MAX, AVG, PREMUL_SUM";

// PREMUL_SUM's factor: a double, or a one-element tensor (FSDP2 passes
// either).
double PremulFactor(const c10d::ReduceOp& op, const char* name) {
  const auto* supplement =
      dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK(supplement != nullptr, "cohort backend: ", name,
              " got ReduceOp.PREMUL_SUM without its factor (make it with "
              "torch.distributed._make_nccl_premul_sum)");
  if (!supplement->tensor_factor.defined()) return supplement->double_factor;
  TORCH_CHECK(supplement->tensor_factor.numel() == 1, "cohort backend: ", name,
              " needs a PREMUL_SUM factor of one element, got ",
              supplement->tensor_factor.numel());
  return supplement->tensor_factor.item<double>();
}
#else
constexpr char kReduceOps[] = "SUM, PRODUCT, MIN, MAX, AVG";
#endif

// `op` for tensors like `like`.
Reduction CohortReduction(const c10d::ReduceOp& op, const at::Tensor& like,
                          const char* name) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return {ReduceOp::kSum};
    case c10d::ReduceOp::PRODUCT:
      return {ReduceOp::kProd};
    case c10d::ReduceOp::MIN:
      return {ReduceOp::kMin};
    case c10d::ReduceOp::MAX:
      return {ReduceOp::kMax};
    case c10d::ReduceOp::AVG:
      return {ReduceOp::kAvg};
#if COHORT_TORCH_BACKEND
    case c10d::ReduceOp::PREMUL_SUM:
      TORCH_CHECK(at::isFloatingType(like.scalar_type()),
                  "cohort backend: ", name,
                  " does not support ReduceOp.PREMUL_SUM on dtype ",
                  like.scalar_type(), " (floating dtypes only)");
      return {ReduceOp::kSum, PremulFactor(op, name)};
#endif
    default:
      TORCH_CHECK(false, "cohort backend: ", name, " does not support ",
                  "ReduceOp.", RedOpName(op.op_), " (supported: ", kReduceOps,
                  ")");
  }
}

// Multiplies `tensors` by the reduction's factor once the op is done.
TorchWork::Finish Scale(const Tensors& tensors, const Reduction& reduction) {
  if (!reduction.scale) return nullptr;
  return [tensors, factor = *reduction.scale]() {
    for (const at::Tensor& tensor : tensors) tensor.mul_(factor);
  };
}

int Root(int64_t root, int64_t root_tensor, const char* op) {
  TORCH_CHECK(root_tensor == 0, "cohort backend: ", op,
              " takes one tensor per process, so rootTensor must be 0, got ",
              root_tensor);
  TORCH_CHECK(root >= 0 && root <= INT32_MAX, "cohort backend: ", op,
              " got root rank ", root);
  return static_cast<int>(root);
}

// A Work that completes when all of `works` have: with the first error
// among them, else OK.
std::shared_ptr<Work> AllOf(const std::vector<std::shared_ptr<Work>>& works) {
  auto all = std::make_shared<Work>();
  if (works.empty()) {
    all->Complete(absl::OkStatus());
    return all;
  }
  struct State {
    explicit State(size_t n) : left(n) {}
    absl::Mutex mu;
    size_t left ABSL_GUARDED_BY(mu);
    absl::Status first_error ABSL_GUARDED_BY(mu);
  };
  auto state = std::make_shared<State>(works.size());
  for (const std::shared_ptr<Work>& work : works) {
    work->OnComplete([all, state](const absl::Status& status) {
      absl::Status result;
      {
        absl::MutexLock lock(&state->mu);
        if (!status.ok() && state->first_error.ok()) {
          state->first_error = status;
        }
        if (--state->left > 0) return;
        result = state->first_error;
      }
      all->Complete(result);
    });
  }
  return all;
}

}  // namespace

// An op handed to cohort, as TorchWork::Wrap takes it.
struct ProcessGroupCohort::Issued {
  std::shared_ptr<cohort::Work> work;
  // What result() and the future's value are.
  Tensors outputs;
  // Every tensor the op reads or writes, the caller's and staging ones.
  Tensors keep;
  TorchWork::Finish finish;
};

ProcessGroupCohort::Issued ProcessGroupCohort::Merge(std::vector<Issued> ops) {
  Issued all;
  std::vector<std::shared_ptr<cohort::Work>> works;
  std::vector<TorchWork::Finish> finishes;
  for (Issued& op : ops) {
    works.push_back(std::move(op.work));
    all.outputs.insert(all.outputs.end(), op.outputs.begin(), op.outputs.end());
    all.keep.insert(all.keep.end(), op.keep.begin(), op.keep.end());
    if (op.finish) finishes.push_back(std::move(op.finish));
  }
  all.work = AllOf(works);
  if (!finishes.empty()) {
    all.finish = [finishes = std::move(finishes)]() {
      for (const TorchWork::Finish& finish : finishes) finish();
    };
  }
  return all;
}

c10::intrusive_ptr<ProcessGroupCohort> ProcessGroupCohort::Create(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout) {
  TORCH_CHECK(store, "cohort backend: no store to bootstrap through");
  auto adapter = std::make_shared<TorchStore>(store);
  adapter->SetTimeout(absl::FromChrono(timeout));
  absl::StatusOr<std::unique_ptr<cohort::ProcessGroup>> group =
      CreateGlooGroup(adapter, rank, size, absl::FromChrono(timeout));
  TORCH_CHECK(group.ok(), "cohort backend: cannot create the group of rank ",
              rank, " of ", size, ": ", group.status().ToString());
  return c10::make_intrusive<ProcessGroupCohort>(*std::move(group));
}

namespace {

// The process's timeline (COHORT_TRACE), made with its first group and
// never destroyed before exit: groups may be destroyed at any point of
// Python's shutdown, or never.
struct ProcessTimeline {
  absl::Mutex mu;
  std::unique_ptr<Timeline> timeline ABSL_GUARDED_BY(mu);
  bool failed ABSL_GUARDED_BY(mu) = false;
  int groups ABSL_GUARDED_BY(mu) = 0;
};

ProcessTimeline& TheTimeline() {
  static ProcessTimeline* const timeline = new ProcessTimeline;
  return *timeline;
}

// At exit: stops the timeline's thread and writes the file a last time.
void CloseTimeline() {
  ProcessTimeline& t = TheTimeline();
  absl::MutexLock lock(&t.mu);
  t.timeline.reset();
}

int EnvInt(const char* name, int otherwise) {
  const char* text = std::getenv(name);
  int value = 0;
  return text != nullptr && absl::SimpleAtoi(text, &value) ? value : otherwise;
}

// Adds `group`'s ops to the process's timeline when COHORT_TRACE is set;
// returns its id there, or -1.
int TraceGroup(const cohort::ProcessGroup& group) {
  const char* dir = std::getenv(kTraceEnv);
  if (dir == nullptr || *dir == '\0') return -1;
  ProcessTimeline& t = TheTimeline();
  absl::MutexLock lock(&t.mu);
  if (t.timeline == nullptr) {
    if (t.failed) return -1;
    // The job's rank as torchrun, cohortrun and env:// set it.
    absl::StatusOr<std::unique_ptr<Timeline>> made =
        Timeline::FromEnvironment(EnvInt("RANK", group.rank()),
                                  EnvInt("WORLD_SIZE", group.size()), "torch");
    if (!made.ok()) {
      t.failed = true;
      std::fprintf(stderr, "cohort backend: no timeline (%s=%s): %s\n",
                   kTraceEnv, dir, made.status().ToString().c_str());
      return -1;
    }
    t.timeline = *std::move(made);
    std::atexit(&CloseTimeline);
  }
  return t.timeline->AddGroup(absl::StrCat("pg", t.groups++),
                              group.flight_recorder(), group.size());
}

// Writes the group's ops in the file before the group goes.
void UntraceGroup(int id) {
  if (id < 0) return;
  ProcessTimeline& t = TheTimeline();
  absl::MutexLock lock(&t.mu);
  if (t.timeline == nullptr) return;
  t.timeline->RemoveGroup(id);
  if (absl::Status s = t.timeline->Flush(); !s.ok()) {
    std::fprintf(stderr, "cohort backend: %s\n", s.ToString().c_str());
  }
}

}  // namespace

ProcessGroupCohort::ProcessGroupCohort(
    std::unique_ptr<cohort::ProcessGroup> group)
    : TorchBackend(group->rank(), group->size()), group_(std::move(group)) {
  init();  // torch's usage logging, as its own backends do.
  trace_id_ = TraceGroup(*group_);
}

namespace {
std::atomic<ProcessGroupCohort::WaitHook> wait_hook{nullptr};
}  // namespace

void ProcessGroupCohort::SetWaitHook(WaitHook hook) { wait_hook = hook; }

ProcessGroupCohort::~ProcessGroupCohort() {
  const std::function<void()> destroy = [this] {
    UntraceGroup(trace_id_);
    group_.reset();
  };
  if (WaitHook hook = wait_hook.load()) {
    hook(destroy);
  } else {
    destroy();
  }
}

at::Tensor ProcessGroupCohort::Staging(int64_t numel, const at::Tensor& like) {
  const int64_t bytes = numel * static_cast<int64_t>(like.element_size());
  absl::MutexLock lock(&staging_mu_);
  // Free when no view of it is alive: each view holds a reference to its
  // storage, and only issuers (under staging_mu_) make new ones.
  const bool free =
      staging_.defined() && staging_.storage().use_count() == 1;
  if (free && staging_.numel() < bytes) staging_ = at::Tensor();
  if (!staging_.defined()) {
    staging_ = at::empty({bytes}, like.options().dtype(at::kByte));
  } else if (!free) {
    return at::empty({numel}, like.options());
  }
  return staging_.narrow(0, 0, bytes).view(like.scalar_type());
}

at::Tensor ProcessGroupCohort::Flatten(const Tensors& tensors) {
  int64_t numel = 0;
  for (const at::Tensor& tensor : tensors) numel += tensor.numel();
  at::Tensor flat = Staging(numel, tensors[0]);
  int64_t offset = 0;
  for (const at::Tensor& tensor : tensors) {
    flat.narrow(0, offset, tensor.numel()).view(tensor.sizes()).copy_(tensor);
    offset += tensor.numel();
  }
  return flat;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::Submit(Issued op,
                                                          OpType type) {
  {
    absl::MutexLock lock(&mu_);
    if (coalescing_) {
      coalesced_works_.push_back(op.work);
      coalesced_outputs_.insert(coalesced_outputs_.end(), op.outputs.begin(),
                                op.outputs.end());
    }
  }
  return TorchWork::Wrap(std::move(op.work), rank_, type, std::move(op.outputs),
                         std::move(op.keep), std::move(op.finish));
}

#if COHORT_TORCH_BACKEND
void ProcessGroupCohort::startCoalescing() {
  absl::MutexLock lock(&mu_);
  TORCH_CHECK(!coalescing_,
              "cohort backend: startCoalescing called again "
              "before endCoalescing");
  coalescing_ = true;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::endCoalescing() {
  std::vector<std::shared_ptr<cohort::Work>> works;
  Tensors outputs;
  {
    absl::MutexLock lock(&mu_);
    TORCH_CHECK(coalescing_,
                "cohort backend: endCoalescing without startCoalescing");
    coalescing_ = false;
    works.swap(coalesced_works_);
    outputs.swap(coalesced_outputs_);
  }
  // Each op's own Work finishes (copies its results) before this one
  // completes: its callback was added first.
  return TorchWork::Wrap(AllOf(works), rank_, OpType::COALESCED,
                         std::move(outputs), {});
}
#endif

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::broadcast(
    Tensors& tensors, const c10d::BroadcastOptions& opts) {
  const char* op = "broadcast";
  at::NoGradGuard no_grad;
  at::Tensor& tensor = One(tensors, op);
  const Dtype dtype = Check(tensor, op);
  const int root = Root(opts.rootRank, opts.rootTensor, op);
  at::Tensor dense = Dense(tensor);
  return Submit({group_->Broadcast(View(dense, dtype), root),
                 {tensor},
                 {tensor, dense},
                 CopyBack(tensor, dense)},
                OpType::BROADCAST);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::allreduce(
    Tensors& tensors, const c10d::AllreduceOptions& opts) {
  const char* op = "allreduce";
  at::NoGradGuard no_grad;
  at::Tensor& tensor = One(tensors, op);
  const Dtype dtype = Check(tensor, op);
  const Reduction reduction = CohortReduction(opts.reduceOp, tensor, op);
  at::Tensor dense = Dense(tensor);
  return Submit({group_->AllReduce(View(dense, dtype), reduction.op),
                 {tensor},
                 {tensor, dense},
                 Then(CopyBack(tensor, dense), Scale({tensor}, reduction))},
                OpType::ALLREDUCE);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::allreduce_coalesced(
    Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  const char* op = "allreduce_coalesced";
  at::NoGradGuard no_grad;
  TORCH_CHECK(!tensors.empty(), "cohort backend: ", op, " got no tensors");
  const Dtype dtype = Check(tensors[0], op);
  CheckAll(tensors, tensors[0], op);
  const Reduction reduction = CohortReduction(opts.reduceOp, tensors[0], op);
  Issued issued{nullptr, tensors, tensors, Scale(tensors, reduction)};
  BufferView flat = Consecutive(tensors, dtype);
  if (flat.data == nullptr) {
    at::Tensor staging = Flatten(tensors);
    flat = View(staging, dtype);
    issued.keep.push_back(staging);
    issued.finish = Then(Unflatten(staging, tensors), std::move(issued.finish));
  }
  issued.work = group_->AllReduce(flat, reduction.op);
  return Submit(std::move(issued), OpType::ALLREDUCE_COALESCED);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::reduce(
    Tensors& tensors, const c10d::ReduceOptions& opts) {
  const char* op = "reduce";
  at::NoGradGuard no_grad;
  at::Tensor& tensor = One(tensors, op);
  const Dtype dtype = Check(tensor, op);
  const Reduction reduction = CohortReduction(opts.reduceOp, tensor, op);
  const int root = Root(opts.rootRank, opts.rootTensor, op);
  at::Tensor dense = Dense(tensor);
  TorchWork::Finish finish = CopyBack(tensor, dense);
  if (rank_ == root)
    finish = Then(std::move(finish), Scale({tensor}, reduction));
  return Submit({group_->Reduce(View(dense, dtype), root, reduction.op),
                 {tensor},
                 {tensor, dense},
                 std::move(finish)},
                OpType::REDUCE);
}

ProcessGroupCohort::Issued ProcessGroupCohort::AllGatherList(Tensors& out,
                                                             at::Tensor& input,
                                                             const char* op) {
  const Dtype dtype = Check(input, op);
  CheckAll(out, input, op);
  at::Tensor dense = Dense(input);
  const std::vector<size_t> counts = Counts(out);
  bool even = true;
  for (size_t count : counts) {
    even = even && count == static_cast<size_t>(input.numel());
  }
  Issued issued{nullptr, out, out, nullptr};
  issued.keep.insert(issued.keep.end(), {input, dense});
  BufferView gathered = Consecutive(out, dtype);
  if (gathered.data == nullptr) {
    at::Tensor staging = Staging(static_cast<int64_t>(Total(counts)), input);
    gathered = View(staging, dtype);
    issued.keep.push_back(staging);
    issued.finish = Unflatten(staging, out);
  }
  issued.work = even ? group_->AllGather(View(dense, dtype), gathered)
                     : group_->AllGatherV(View(dense, dtype), gathered, counts);
  return issued;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::allgather(
    std::vector<Tensors>& outputs, Tensors& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* op = "allgather";
  at::NoGradGuard no_grad;
  at::Tensor& input = One(inputs, op);
  Tensors& out = PerRank(outputs, size_, op, "output");
  return Submit(AllGatherList(out, input, op), OpType::ALLGATHER);
}

ProcessGroupCohort::Issued ProcessGroupCohort::AllGatherFlat(at::Tensor& output,
                                                             at::Tensor& input,
                                                             const char* op) {
  const Dtype dtype = Check(input, op);
  CheckAll({output}, input, op);
  TORCH_CHECK(output.numel() == input.numel() * size_, "cohort backend: ", op,
              " needs an output of ", size_, " x the input's ", input.numel(),
              " elements, got ", output.numel());
  at::Tensor in = Dense(input);
  at::Tensor out = Dense(output);
  return {group_->AllGather(View(in, dtype), View(out, dtype)),
          {output},
          {input, in, output, out},
          CopyBack(output, out)};
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  at::NoGradGuard no_grad;
  return Submit(AllGatherFlat(output, input, "_allgather_base"),
                OpType::_ALLGATHER_BASE);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::allgather_coalesced(
    std::vector<Tensors>& output_lists, Tensors& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* op = "allgather_coalesced";
  at::NoGradGuard no_grad;
  TORCH_CHECK(output_lists.size() == inputs.size(), "cohort backend: ", op,
              " needs one output list per input, got ", output_lists.size(),
              " lists for ", inputs.size(), " inputs");
  std::vector<Issued> ops;
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(static_cast<int>(output_lists[i].size()) == size_,
                "cohort backend: ", op, " needs one output tensor per rank (",
                size_, ") in each list, got ", output_lists[i].size());
    ops.push_back(AllGatherList(output_lists[i], inputs[i], op));
  }
  return Submit(Merge(std::move(ops)), OpType::ALLGATHER_COALESCED);
}

#if COHORT_TORCH_BACKEND
ProcessGroupCohort::Issued ProcessGroupCohort::EachPair(
    Tensors& outputs, Tensors& inputs, const char* op,
    const std::function<Issued(at::Tensor&, at::Tensor&)>& issue) {
  TORCH_CHECK(outputs.size() == inputs.size(), "cohort backend: ", op,
              " needs one output per input, got ", outputs.size(), " for ",
              inputs.size());
  std::vector<Issued> ops;
  for (size_t i = 0; i < inputs.size(); ++i) {
    ops.push_back(issue(outputs[i], inputs[i]));
  }
  return Merge(std::move(ops));
}

c10::intrusive_ptr<c10d::Work>
ProcessGroupCohort::allgather_into_tensor_coalesced(
    Tensors& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) {
  const char* op = "allgather_into_tensor_coalesced";
  at::NoGradGuard no_grad;
  return Submit(EachPair(outputs, inputs, op,
                         [&](at::Tensor& output, at::Tensor& input) {
                           return AllGatherFlat(output, input, op);
                         }),
                OpType::COALESCED);
}
#endif

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::gather(
    std::vector<Tensors>& outputs, Tensors& inputs,
    const c10d::GatherOptions& opts) {
  const char* op = "gather";
  at::NoGradGuard no_grad;
  at::Tensor& input = One(inputs, op);
  const Dtype dtype = Check(input, op);
  const int root = Root(opts.rootRank, 0, op);
  at::Tensor dense = Dense(input);
  Issued issued{nullptr, {}, {input, dense}, nullptr};
  BufferView gathered{nullptr, 0, dtype};
  if (rank_ == root) {
    Tensors& out = PerRank(outputs, size_, op, "output");
    CheckAll(out, input, op);
    CheckNumel(out, input.numel(), op, "output");
    issued.outputs = out;
    issued.keep.insert(issued.keep.end(), out.begin(), out.end());
    gathered = Consecutive(out, dtype);
    if (gathered.data == nullptr) {
      at::Tensor staging = Staging(input.numel() * size_, input);
      gathered = View(staging, dtype);
      issued.keep.push_back(staging);
      issued.finish = Unflatten(staging, out);
    }
  }
  issued.work = group_->Gather(View(dense, dtype), gathered, root);
  return Submit(std::move(issued), OpType::GATHER);
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
  Issued issued{nullptr, {output}, {output, out}, CopyBack(output, out)};
  BufferView scattered{nullptr, 0, dtype};
  if (rank_ == root) {
    Tensors& in = PerRank(inputs, size_, op, "input");
    CheckAll(in, output, op);
    CheckNumel(in, output.numel(), op, "input");
    issued.keep.insert(issued.keep.end(), in.begin(), in.end());
    scattered = Consecutive(in, dtype);
    if (scattered.data == nullptr) {
      at::Tensor staging = Flatten(in);
      scattered = View(staging, dtype);
      issued.keep.push_back(staging);
    }
  }
  issued.work = group_->Scatter(scattered, View(out, dtype), root);
  return Submit(std::move(issued), OpType::SCATTER);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::reduce_scatter(
    Tensors& outputs, std::vector<Tensors>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter";
  at::NoGradGuard no_grad;
  at::Tensor& output = One(outputs, op);
  const Dtype dtype = Check(output, op);
  const Reduction reduction = CohortReduction(opts.reduceOp, output, op);
  Tensors& in = PerRank(inputs, size_, op, "input");
  CheckAll(in, output, op);
  CheckNumel(in, output.numel(), op, "input");
  at::Tensor out = Dense(output);
  Issued issued{nullptr,
                {output},
                {output, out},
                Then(CopyBack(output, out), Scale({output}, reduction))};
  issued.keep.insert(issued.keep.end(), in.begin(), in.end());
  BufferView flat = Consecutive(in, dtype);
  if (flat.data == nullptr) {
    at::Tensor staging = Flatten(in);
    flat = View(staging, dtype);
    issued.keep.push_back(staging);
  }
  issued.work = group_->ReduceScatter(flat, View(out, dtype), reduction.op);
  return Submit(std::move(issued), OpType::REDUCE_SCATTER);
}

ProcessGroupCohort::Issued ProcessGroupCohort::ReduceScatterFlat(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceOp& reduce_op,
    const char* op) {
  const Dtype dtype = Check(input, op);
  CheckAll({output}, input, op);
  TORCH_CHECK(input.numel() == output.numel() * size_, "cohort backend: ", op,
              " needs an input of ", size_, " x the output's ", output.numel(),
              " elements, got ", input.numel());
  const Reduction reduction = CohortReduction(reduce_op, input, op);
  at::Tensor in = Dense(input);
  at::Tensor out = Dense(output);
  return {
      group_->ReduceScatter(View(in, dtype), View(out, dtype), reduction.op),
      {output},
      {input, in, output, out},
      Then(CopyBack(output, out), Scale({output}, reduction))};
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  at::NoGradGuard no_grad;
  return Submit(
      ReduceScatterFlat(output, input, opts.reduceOp, "_reduce_scatter_base"),
      OpType::_REDUCE_SCATTER_BASE);
}

#if COHORT_TORCH_BACKEND
c10::intrusive_ptr<c10d::Work>
ProcessGroupCohort::reduce_scatter_tensor_coalesced(
    Tensors& outputs, Tensors& inputs, const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter_tensor_coalesced";
  at::NoGradGuard no_grad;
  return Submit(EachPair(outputs, inputs, op,
                         [&](at::Tensor& output, at::Tensor& input) {
                           return ReduceScatterFlat(output, input,
                                                    opts.reduceOp, op);
                         }),
                OpType::COALESCED);
}
#endif

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
  std::shared_ptr<cohort::Work> work;
  if (output_split_sizes.empty() && input_split_sizes.empty()) {
    work = group_->AllToAll(View(in, dtype), View(out, dtype));
  } else {
    work = group_->AllToAllV(
        View(in, dtype), SplitCounts(input, input_split_sizes, size_, "input"),
        View(out, dtype),
        SplitCounts(output, output_split_sizes, size_, "output"));
  }
  return Submit({std::move(work),
                 {output},
                 {input, in, output, out},
                 CopyBack(output, out)},
                OpType::ALLTOALL_BASE);
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
  Issued issued{nullptr, outputs, outputs, nullptr};
  issued.keep.insert(issued.keep.end(), inputs.begin(), inputs.end());
  BufferView in = Consecutive(inputs, dtype);
  if (in.data == nullptr) {
    at::Tensor staging = Flatten(inputs);
    in = View(staging, dtype);
    issued.keep.push_back(staging);
  }
  const std::vector<size_t> recv_counts = Counts(outputs);
  BufferView out = Consecutive(outputs, dtype);
  if (out.data == nullptr) {
    at::Tensor staging =
        Staging(static_cast<int64_t>(Total(recv_counts)), inputs[0]);
    out = View(staging, dtype);
    issued.keep.push_back(staging);
    issued.finish = Unflatten(staging, outputs);
  }
  issued.work = group_->AllToAllV(in, Counts(inputs), out, recv_counts);
  return Submit(std::move(issued), OpType::ALLTOALL);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::barrier(
    const c10d::BarrierOptions& opts) {
  return Submit({group_->Barrier(), {}, {}, nullptr}, OpType::BARRIER);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::send(Tensors& tensors,
                                                        int dst_rank, int tag) {
  const char* op = "send";
  at::NoGradGuard no_grad;
  at::Tensor& tensor = One(tensors, op);
  const Dtype dtype = Check(tensor, op);
  TORCH_CHECK(tag >= 0, "cohort backend: send needs a tag >= 0, got ", tag);
  at::Tensor dense = Dense(tensor);
  return Submit(
      {group_->Send(View(dense, dtype), dst_rank, static_cast<uint32_t>(tag)),
       {tensor},
       {tensor, dense},
       nullptr},
      OpType::SEND);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::recv(Tensors& tensors,
                                                        int src_rank, int tag) {
  const char* op = "recv";
  at::NoGradGuard no_grad;
  at::Tensor& tensor = One(tensors, op);
  const Dtype dtype = Check(tensor, op);
  TORCH_CHECK(tag >= 0, "cohort backend: recv needs a tag >= 0, got ", tag);
  at::Tensor dense = Dense(tensor);
  return Submit(
      {group_->Recv(View(dense, dtype), src_rank, static_cast<uint32_t>(tag)),
       {tensor},
       {tensor, dense},
       CopyBack(tensor, dense)},
      OpType::RECV);
}

}  // namespace cohort
