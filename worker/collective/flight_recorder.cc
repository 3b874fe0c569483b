#include "worker/collective/flight_recorder.h"

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/time/clock.h"

namespace cohort {
namespace {

constexpr absl::string_view kStateNames[] = {"queued", "running", "done",
                                             "failed"};

absl::string_view KindName(OpKind kind) {
  switch (kind) {
    case OpKind::kBroadcast:
      return "Broadcast";
    case OpKind::kAllReduce:
      return "AllReduce";
    case OpKind::kReduce:
      return "Reduce";
    case OpKind::kAllGather:
      return "AllGather";
    case OpKind::kAllGatherV:
      return "AllGatherV";
    case OpKind::kGather:
      return "Gather";
    case OpKind::kScatter:
      return "Scatter";
    case OpKind::kAllToAll:
      return "AllToAll";
    case OpKind::kAllToAllV:
      return "AllToAllV";
    case OpKind::kReduceScatter:
      return "ReduceScatter";
    case OpKind::kBarrier:
      return "Barrier";
  }
  return "Unknown";
}

bool HasRoot(OpKind kind) {
  return kind == OpKind::kBroadcast || kind == OpKind::kReduce ||
         kind == OpKind::kGather || kind == OpKind::kScatter;
}

int64_t NowMicros() { return absl::ToUnixMicros(absl::Now()); }

}  // namespace

absl::string_view FlightStateName(FlightState state) {
  return kStateNames[static_cast<int>(state)];
}

FlightRecorder::FlightRecorder(size_t capacity) {
  if (capacity == 0) {
    std::fprintf(stderr, "FlightRecorder: capacity must be >= 1\n");
    std::abort();
  }
  ring_.resize(capacity);
}

uint64_t FlightRecorder::Push(FlightRecord record, bool point_to_point) {
  record.enqueued_us = NowMicros();
  absl::MutexLock lock(&mu_);
  const uint64_t index = next_index_++;
  record.index = index;
  record.seq = point_to_point ? next_p2p_++ : next_collective_++;
  ring_[index % ring_.size()] = std::move(record);
  return index;
}

uint64_t FlightRecorder::Queued(const CollectiveOp& op) {
  FlightRecord r;
  r.op = KindName(op.kind);
  r.dtype = op.input.count > 0 ? op.input.dtype : op.output.dtype;
  r.reduce = op.reduce;
  r.is_reduction = op.is_reduction();
  r.count = op.input.count;
  r.root = HasRoot(op.kind) ? op.root : -1;
  return Push(std::move(r), /*point_to_point=*/false);
}

uint64_t FlightRecorder::Queued(const PointToPointOp& op) {
  FlightRecord r;
  r.op = op.is_send ? "Send" : "Recv";
  r.dtype = op.buffer.dtype;
  r.count = op.buffer.count;
  r.root = op.peer;
  return Push(std::move(r), /*point_to_point=*/true);
}

FlightRecord* FlightRecorder::SlotFor(uint64_t index) {
  FlightRecord& slot = ring_[index % ring_.size()];
  return slot.index == index ? &slot : nullptr;
}

void FlightRecorder::Started(uint64_t index) {
  const int64_t now = NowMicros();
  absl::MutexLock lock(&mu_);
  if (FlightRecord* r = SlotFor(index); r != nullptr) {
    r->started_us = now;
    r->state = FlightState::kRunning;
  }
}

void FlightRecorder::Ended(uint64_t index, const absl::Status& status) {
  const int64_t now = NowMicros();
  absl::MutexLock lock(&mu_);
  FlightRecord* r = SlotFor(index);
  if (r == nullptr) return;
  if (r->started_us == 0) r->started_us = now;  // Failed before it ran.
  r->ended_us = now;
  r->state = status.ok() ? FlightState::kDone : FlightState::kFailed;
  if (!status.ok()) r->error = status.ToString();
}

std::vector<FlightRecord> FlightRecorder::Snapshot() const {
  absl::MutexLock lock(&mu_);
  std::vector<FlightRecord> out;
  const uint64_t first =
      next_index_ > ring_.size() ? next_index_ - ring_.size() : 0;
  out.reserve(next_index_ - first);
  for (uint64_t i = first; i < next_index_; ++i) {
    out.push_back(ring_[i % ring_.size()]);
  }
  return out;
}

uint64_t FlightRecorder::recorded() const {
  absl::MutexLock lock(&mu_);
  return next_index_;
}

}  // namespace cohort
