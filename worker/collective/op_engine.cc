#include "worker/collective/op_engine.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/collective/reduce.h"

namespace cohort {
namespace {

bool IsHalf(Dtype dtype) {
  return dtype == Dtype::kF16 || dtype == Dtype::kBF16;
}

// The dtype a reduction of `dtype` computes in: f32 for f16 and bf16, so
// that they accumulate in f32 and round once; else `dtype` itself.
Dtype ComputeDtype(Dtype dtype) { return IsHalf(dtype) ? Dtype::kF32 : dtype; }

// A buffer of `count` elements in the compute dtype of `dtype`, owned by
// the engine, that a reduction's body runs on instead of the caller's.
class ComputeBuffer {
 public:
  ComputeBuffer(Dtype dtype, size_t count)
      : view_{nullptr, count, ComputeDtype(dtype)}, bytes_(view_.bytes()) {
    view_.data = bytes_.data();
  }
  // Moving keeps the vector's heap block, so view_ stays valid; a copy
  // would point into the source.
  ComputeBuffer(ComputeBuffer&&) = default;
  ComputeBuffer(const ComputeBuffer&) = delete;
  ComputeBuffer& operator=(const ComputeBuffer&) = delete;

  // A copy of `source`, widened to f32 if it is f16 or bf16.
  static ComputeBuffer CopyOf(const BufferView& source) {
    ComputeBuffer copy(source.dtype, source.count);
    if (IsHalf(source.dtype)) {
      WidenToF32(source.dtype, source.data,
                 static_cast<float*>(copy.view_.data), source.count);
    } else if (source.count > 0) {
      std::memcpy(copy.view_.data, source.data, source.bytes());
    }
    return copy;
  }

  const BufferView& view() const { return view_; }

  // Writes the elements to `target`, rounding to target.dtype.
  void CopyTo(const BufferView& target) const {
    if (IsHalf(target.dtype)) {
      NarrowFromF32(target.dtype, static_cast<const float*>(view_.data),
                    target.data, target.count);
    } else if (target.count > 0) {
      std::memcpy(target.data, view_.data, target.bytes());
    }
  }

 private:
  BufferView view_;
  std::vector<char> bytes_;  // operator new's alignment suits every dtype.
};

}  // namespace

OpEngine::OpEngine(int rank, int size, const OpEngineOptions& options,
                   Transport* transport)
    : rank_(rank),
      size_(size),
      options_(options),
      transport_(transport),
      recorder_(options_.group.flight_records > 0
                    ? std::make_shared<FlightRecorder>(
                          options_.group.flight_records)
                    : nullptr) {
  for (int i = 0; i < options_.group.threads; ++i) {
    op_threads_.emplace_back([this] { RunOps(); });
  }
  transfer_thread_ = std::thread([this] { RunTransfers(); });
}

OpEngine::~OpEngine() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : op_threads_) t.join();
  transfer_thread_.join();
}

std::shared_ptr<Work> OpEngine::Submit(CollectiveOp op, Body body,
                                       bool checks_itself) {
  absl::Status valid = op.Check(shape());
  if (!valid.ok()) return Work::Done(valid);
  auto work = std::make_shared<Work>();
  std::string name = op.Name();
  absl::MutexLock lock(&mu_);
  // Recorded under the lock, so that the recorder's seqs follow the queue's
  // order, which is the same on every rank.
  const uint64_t flight = recorder_ ? recorder_->Queued(op) : 0;
  // Each op takes two tags: one for its body, one for CheckSameOpEverywhere.
  ops_.push_back(QueuedOp{std::move(name), flight, next_tag_, std::move(op),
                          std::move(body), checks_itself, work});
  next_tag_ += 2;
  return work;
}

std::shared_ptr<Work> OpEngine::Post(const PointToPointOp& op) {
  absl::Status valid = op.Check(shape());
  if (!valid.ok()) return Work::Done(valid);
  {
    absl::MutexLock lock(&mu_);
    absl::Status broken = BrokenStatus();
    if (!broken.ok()) return Work::Done(broken);
  }
  auto work = std::make_shared<Work>();
  std::string name = op.Name();
  const uint64_t flight = recorder_ ? recorder_->Queued(op) : 0;
  // Posted now, not queued behind anything.
  if (recorder_) recorder_->Started(flight);
  absl::StatusOr<std::unique_ptr<Transfer>> transfer = transport_->Post(op);
  if (!transfer.ok()) {
    Finish(work, flight, Where(name, transfer.status()));
    return work;
  }
  absl::MutexLock lock(&mu_);
  transfers_.push_back(
      PostedTransfer{std::move(name), flight, std::move(*transfer), work});
  return work;
}

void OpEngine::RunOps() {
  while (true) {
    QueuedOp op;
    absl::Status broken;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !ops_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (ops_.empty()) return;  // Stopping, and nothing left to run.
      op = std::move(ops_.front());
      ops_.pop_front();
      broken = BrokenStatus();
    }
    if (!broken.ok()) {
      if (recorder_) recorder_->Ended(op.flight, broken);
      op.work->Complete(broken);
      continue;
    }
    if (recorder_) recorder_->Started(op.flight);
    Finish(op.work, op.flight, Where(op.name, RunOp(op)));
  }
}

absl::Status OpEngine::RunOp(const QueuedOp& op) {
  OpRun run{op.tag, absl::string_view()};
  if (options_.group.verify_ops && size_ > 1) {
    if (op.checks_itself) {
      run.check = op.name;
    } else {
      absl::Status same = CheckSameOpEverywhere(op);
      if (!same.ok()) return same;
    }
  }
  if (!options_.host_memory) return op.body(op.op, run);
  return RunOnHost(op.op, run, op.body);
}

absl::Status OpEngine::CheckSameOpEverywhere(const QueuedOp& op) {
  // Op names hold what every rank must agree on and nothing rank-specific,
  // so comparing them is the check, and the names make the error message.
  constexpr size_t kNameBytes = 128;
  std::vector<char> mine(kNameBytes, '\0');
  op.name.copy(mine.data(), kNameBytes - 1);
  std::vector<char> all(kNameBytes * size_);
  absl::Status exchanged = transport_->AllGatherBytes(mine.data(), kNameBytes,
                                                      all.data(), op.tag + 1);
  if (!exchanged.ok()) return exchanged;
  std::vector<RankOp> ranks;
  for (int r = 0; r < size_; ++r) {
    ranks.push_back({r, std::string(all.data() + r * kNameBytes)});
  }
  return CheckSameOp(mine.data(), ranks);
}

absl::Status OpEngine::RunOnHost(const CollectiveOp& op, const OpRun& run,
                                 const Body& body) {
  if (size_ == 1) {
    // Every collective of one rank leaves its input where its output goes;
    // AVG of one rank is the rank's own value.
    const size_t bytes = std::min(op.input.bytes(), op.output.bytes());
    if (!op.in_place() && bytes > 0) {
      std::memmove(op.output.data, op.input.data, bytes);
    }
    return absl::OkStatus();
  }
  if (op.empty()) return absl::OkStatus();
  if (op.is_reduction()) return RunReductionOnHost(op, run, body);
  return body(op, run);
}

absl::Status OpEngine::RunReductionOnHost(const CollectiveOp& op,
                                          const OpRun& run, const Body& body) {
  const bool receives_result = op.kind != OpKind::kReduce || rank_ == op.root;
  if (!IsHalf(op.input.dtype) && op.kind != OpKind::kReduce) {
    // The caller's own buffers, which the body reads and writes as the op
    // allows.
    absl::Status status = body(op, run);
    if (status.ok() && op.reduce == ReduceOp::kAvg) {
      DivideInPlace(op.output.dtype, op.output.data, op.output.count, size_);
    }
    return status;
  }
  // The body runs on copies: f32 ones for f16 and bf16, and for Reduce
  // (whose backends may use every rank's buffer as scratch) a copy that
  // keeps the other ranks' buffers as they were.
  CollectiveOp copy = op;
  ComputeBuffer input = ComputeBuffer::CopyOf(op.input);
  ComputeBuffer output(op.output.dtype,
                       op.in_place() ? size_t{0} : op.output.count);
  copy.input = input.view();
  copy.output = op.in_place() ? input.view() : output.view();
  absl::Status status = body(copy, run);
  if (!status.ok() || !receives_result) return status;
  if (op.reduce == ReduceOp::kAvg) {
    DivideInPlace(copy.output.dtype, copy.output.data, copy.output.count,
                  size_);
  }
  (op.in_place() ? input : output).CopyTo(op.output);
  return absl::OkStatus();
}

void OpEngine::RunTransfers() {
  while (true) {
    PostedTransfer transfer;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !transfers_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (transfers_.empty()) return;
      transfer = std::move(transfers_.front());
      transfers_.pop_front();
    }
    // Waiting in post order only delays reporting: every transfer is
    // already posted, so none waits on this thread to make progress.
    absl::Status status = transfer.transfer->Wait(options_.group.timeout);
    // Unregister the caller's memory before telling the caller it may
    // reuse it: a late message must find no buffer to write into.
    transfer.transfer.reset();
    Finish(transfer.work, transfer.flight, Where(transfer.name, status));
  }
}

absl::Status OpEngine::Where(absl::string_view name,
                             const absl::Status& status) const {
  if (status.ok()) return status;
  return absl::Status(
      status.code(), absl::StrCat(name, " on rank ", rank_, " of ", size_, ": ",
                                  status.message()));
}

void OpEngine::Finish(const std::shared_ptr<Work>& work, uint64_t flight,
                      absl::Status status) {
  if (recorder_) recorder_->Ended(flight, status);
  if (!status.ok() && status.code() != absl::StatusCode::kInvalidArgument) {
    absl::MutexLock lock(&mu_);
    if (broken_.ok()) broken_ = status;
  }
  if (!status.ok() && options_.group.on_op_failure) {
    options_.group.on_op_failure(status);
  }
  work->Complete(std::move(status));
}

absl::Status OpEngine::BrokenStatus() const {
  if (broken_.ok()) return broken_;
  return absl::FailedPreconditionError(absl::StrCat(
      options_.name,
      " is unusable after an earlier failure: ", broken_.ToString()));
}

}  // namespace cohort
