// FlightRecorder: the last `capacity` ops of one process group, kept in a
// fixed ring so that a hang or a failure can be explained after the fact
// (cohortctl diagnose lines the ranks' rings up by sequence number). The
// op engine records every collective as it is queued, started and ended;
// point-to-point ops are recorded too, with their peer.
//
// Cost: no lock and no allocation per event: an atomic increment to take
// a slot, relaxed stores into it and a clock read (a failed op's message
// alone takes a mutex and a string), so it can stay on for every op
// (bench/flight_recorder_bench measures it). A slot is reused after
// `capacity` more ops; Snapshot skips a slot being rewritten while it
// reads it.
//
// seq is a collective's position among the group's collectives, in issue
// order: collectives are issued in the same order on every rank, so equal
// seqs on two ranks are the same collective. Point-to-point ops count in a
// sequence of their own (Send and Recv need not line up across ranks).
// Issue order is the order of Queued calls, which the caller serializes
// (the op engine calls Queued under its queue's lock).
#ifndef COHORT_WORKER_COLLECTIVE_FLIGHT_RECORDER_H_
#define COHORT_WORKER_COLLECTIVE_FLIGHT_RECORDER_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "worker/collective/collective_op.h"

namespace cohort {

enum class FlightState : uint8_t { kQueued, kRunning, kDone, kFailed };
absl::string_view FlightStateName(FlightState state);

struct FlightRecord {
  uint64_t index = 0;  // Position among every op recorded (the handle).
  uint64_t seq = 0;    // Among collectives, or among Send/Recv.
  // "AllReduce", "Send", ...: the op's kind alone (no arguments).
  absl::string_view op;
  Dtype dtype = Dtype::kF32;
  ReduceOp reduce = ReduceOp::kSum;
  bool is_reduction = false;
  uint64_t count = 0;  // Elements this rank passes (the input's).
  int root = -1;       // Broadcast, Reduce, Gather, Scatter; Send/Recv peer.
  // Microseconds since the Unix epoch; 0 until the event happens.
  int64_t enqueued_us = 0;
  int64_t started_us = 0;
  int64_t ended_us = 0;
  FlightState state = FlightState::kQueued;
  std::string error;  // Failed ops only.
};

class FlightRecorder {
 public:
  static constexpr size_t kDefaultCapacity = 2000;

  // REQUIRES: capacity >= 1.
  explicit FlightRecorder(size_t capacity = kDefaultCapacity);

  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  // Records an op as queued now and returns its index, which the other two
  // calls take. An op whose slot was reused since (more than capacity ops
  // later) is no longer updated.
  uint64_t Queued(const CollectiveOp& op);
  uint64_t Queued(const PointToPointOp& op);
  void Started(uint64_t index);
  void Ended(uint64_t index, const absl::Status& status);

  // The ops still in the ring, oldest first.
  std::vector<FlightRecord> Snapshot() const;
  // Ops recorded so far, including those the ring has dropped.
  uint64_t recorded() const;
  size_t capacity() const { return capacity_; }

 private:
  // One cache line each, so that the issuing thread filling one op's slot
  // and the op thread ending the one before never share a line.
  struct alignas(64) Slot {
    // The op's index once its fields are written (release); kEmpty before.
    std::atomic<uint64_t> index{~uint64_t{0}};
    std::atomic<uint64_t> seq{0};
    std::atomic<uint64_t> count{0};
    std::atomic<int64_t> enqueued_us{0};
    std::atomic<int64_t> started_us{0};
    std::atomic<int64_t> ended_us{0};
    std::atomic<int32_t> root{-1};
    // op name index, dtype, reduce, is_reduction, state: a byte each.
    std::atomic<uint64_t> packed{0};
  };

  uint64_t Push(uint8_t name, Dtype dtype, ReduceOp reduce,
                bool is_reduction, uint64_t count, int root,
                bool point_to_point);
  Slot* SlotFor(uint64_t index);

  const size_t capacity_;
  std::unique_ptr<Slot[]> ring_;
  std::atomic<uint64_t> next_index_{0};
  std::atomic<uint64_t> next_collective_{0};
  std::atomic<uint64_t> next_p2p_{0};
  mutable absl::Mutex errors_mu_;
  // Failed ops' messages, by slot, with the index they belong to.
  std::vector<std::pair<uint64_t, std::string>> errors_
      ABSL_GUARDED_BY(errors_mu_);
};

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_FLIGHT_RECORDER_H_
