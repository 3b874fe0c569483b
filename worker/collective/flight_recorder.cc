#include "worker/collective/flight_recorder.h"

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/time/clock.h"

namespace cohort {
namespace {

constexpr absl::string_view kStateNames[] = {"queued", "running", "done",
                                             "failed"};

bool HasRoot(OpKind kind) {
  return kind == OpKind::kBroadcast || kind == OpKind::kReduce ||
         kind == OpKind::kGather || kind == OpKind::kScatter;
}

int64_t NowMicros() { return absl::GetCurrentTimeNanos() / 1000; }

}  // namespace

absl::string_view FlightStateName(FlightState state) {
  return kStateNames[static_cast<int>(state)];
}

FlightRecorder::FlightRecorder(size_t capacity)
    : capacity_(capacity), ring_(new Slot[capacity == 0 ? 1 : capacity]) {
  static_assert(sizeof(Slot) == 64, "a slot is one cache line");
  if (capacity == 0) {
    std::fprintf(stderr, "FlightRecorder: capacity must be >= 1\n");
    std::abort();
  }
  errors_.resize(capacity, {~uint64_t{0}, std::string()});
}

namespace {

// The op names a slot can hold, by the byte it stores.
constexpr absl::string_view kOpNames[] = {
    "Broadcast", "AllReduce",  "Reduce",   "AllGather",
    "AllGatherV", "Gather",    "Scatter",  "AllToAll",
    "AllToAllV",  "ReduceScatter", "Barrier", "Send", "Recv"};
constexpr uint8_t kSend = 11;
constexpr uint8_t kRecv = 12;

uint64_t Pack(uint8_t name, Dtype dtype, ReduceOp reduce, bool is_reduction,
              FlightState state) {
  return uint64_t{name} | uint64_t{static_cast<uint8_t>(dtype)} << 8 |
         uint64_t{static_cast<uint8_t>(reduce)} << 16 |
         uint64_t{is_reduction} << 24 |
         uint64_t{static_cast<uint8_t>(state)} << 32;
}

}  // namespace

uint64_t FlightRecorder::Push(uint8_t name, Dtype dtype, ReduceOp reduce,
                              bool is_reduction, uint64_t count, int root,
                              bool point_to_point) {
  const int64_t now = NowMicros();
  const uint64_t index = next_index_.fetch_add(1, std::memory_order_relaxed);
  const uint64_t seq = (point_to_point ? next_p2p_ : next_collective_)
                           .fetch_add(1, std::memory_order_relaxed);
  Slot& slot = ring_[index % capacity_];
  // Readers that see the old index mid-rewrite discard what they read.
  slot.index.store(~uint64_t{0}, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  slot.seq.store(seq, std::memory_order_relaxed);
  slot.count.store(count, std::memory_order_relaxed);
  slot.enqueued_us.store(now, std::memory_order_relaxed);
  slot.started_us.store(0, std::memory_order_relaxed);
  slot.ended_us.store(0, std::memory_order_relaxed);
  slot.root.store(root, std::memory_order_relaxed);
  slot.packed.store(
      Pack(name, dtype, reduce, is_reduction, FlightState::kQueued),
      std::memory_order_relaxed);
  slot.index.store(index, std::memory_order_release);
  return index;
}

uint64_t FlightRecorder::Queued(const CollectiveOp& op) {
  return Push(static_cast<uint8_t>(op.kind),
              op.input.count > 0 ? op.input.dtype : op.output.dtype,
              op.reduce, op.is_reduction(), op.input.count,
              HasRoot(op.kind) ? op.root : -1, /*point_to_point=*/false);
}

uint64_t FlightRecorder::Queued(const PointToPointOp& op) {
  return Push(op.is_send ? kSend : kRecv, op.buffer.dtype, ReduceOp::kSum,
              false, op.buffer.count, op.peer, /*point_to_point=*/true);
}

FlightRecorder::Slot* FlightRecorder::SlotFor(uint64_t index) {
  Slot& slot = ring_[index % capacity_];
  return slot.index.load(std::memory_order_acquire) == index ? &slot : nullptr;
}

void FlightRecorder::Started(uint64_t index) {
  Slot* slot = SlotFor(index);
  if (slot == nullptr) return;
  slot->started_us.store(NowMicros(), std::memory_order_relaxed);
  const uint64_t packed = slot->packed.load(std::memory_order_relaxed);
  slot->packed.store((packed & ~(uint64_t{0xff} << 32)) |
                         uint64_t{static_cast<uint8_t>(FlightState::kRunning)}
                             << 32,
                     std::memory_order_relaxed);
}

void FlightRecorder::Ended(uint64_t index, const absl::Status& status) {
  Slot* slot = SlotFor(index);
  if (slot == nullptr) return;
  const int64_t now = NowMicros();
  if (slot->started_us.load(std::memory_order_relaxed) == 0) {
    slot->started_us.store(now, std::memory_order_relaxed);  // Never ran.
  }
  slot->ended_us.store(now, std::memory_order_relaxed);
  if (!status.ok()) {
    absl::MutexLock lock(&errors_mu_);
    errors_[index % capacity_] = {index, status.ToString()};
  }
  const FlightState state =
      status.ok() ? FlightState::kDone : FlightState::kFailed;
  const uint64_t packed = slot->packed.load(std::memory_order_relaxed);
  slot->packed.store((packed & ~(uint64_t{0xff} << 32)) |
                         uint64_t{static_cast<uint8_t>(state)} << 32,
                     std::memory_order_release);
}

std::vector<FlightRecord> FlightRecorder::Snapshot() const {
  const uint64_t end = next_index_.load(std::memory_order_acquire);
  const uint64_t first = end > capacity_ ? end - capacity_ : 0;
  std::vector<FlightRecord> out;
  out.reserve(end - first);
  for (uint64_t i = first; i < end; ++i) {
    const Slot& slot = ring_[i % capacity_];
    if (slot.index.load(std::memory_order_acquire) != i) continue;
    FlightRecord r;
    r.index = i;
    const uint64_t packed = slot.packed.load(std::memory_order_acquire);
    r.op = kOpNames[packed & 0xff];
    r.dtype = static_cast<Dtype>((packed >> 8) & 0xff);
    r.reduce = static_cast<ReduceOp>((packed >> 16) & 0xff);
    r.is_reduction = ((packed >> 24) & 0xff) != 0;
    r.state = static_cast<FlightState>((packed >> 32) & 0xff);
    r.seq = slot.seq.load(std::memory_order_relaxed);
    r.count = slot.count.load(std::memory_order_relaxed);
    r.root = slot.root.load(std::memory_order_relaxed);
    r.enqueued_us = slot.enqueued_us.load(std::memory_order_relaxed);
    r.started_us = slot.started_us.load(std::memory_order_relaxed);
    r.ended_us = slot.ended_us.load(std::memory_order_relaxed);
    if (slot.index.load(std::memory_order_acquire) != i) continue;  // Reused.
    if (r.state == FlightState::kFailed) {
      absl::MutexLock lock(&errors_mu_);
      if (errors_[i % capacity_].first == i) r.error = errors_[i % capacity_].second;
    }
    out.push_back(std::move(r));
  }
  return out;
}

uint64_t FlightRecorder::recorded() const {
  return next_index_.load(std::memory_order_acquire);
}

}  // namespace cohort
