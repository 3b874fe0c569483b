// OpEngine: what every ProcessGroup backend does around its op bodies, so
// that a backend supplies only the bodies and two transport primitives.
//
// It gives the backend, for each op the caller issues:
//  - argument checks before anything is queued (collective_op.h, through
//    op_checks.h): INVALID_ARGUMENT on a Work that is already complete;
//  - the queue: collectives run on `threads` threads of their own in issue
//    order, each with a tag from its position in that order (the same on
//    every rank), so consecutive ops in flight never mix their messages;
//  - verify_ops: the ranks compare each collective's name and fail it
//    with INVALID_ARGUMENT naming the ranks that issued another, before any
//    output is written. A body that can carry the names in its own first
//    exchange (the shared-memory transport does) checks itself; for the
//    others the engine exchanges the names before the body;
//  - errors that name the op and the rank ("AllReduce SUM of 4 f32 on rank
//    1 of 2: ..."), and the broken state: after a failure other than
//    INVALID_ARGUMENT every later op ends with FAILED_PRECONDITION naming
//    the first failure (process_group.h's rules);
//  - Send and Recv posted when issued and completed by a transfer thread,
//    each waited on for at most the group's timeout;
//  - with host_memory (CPU backends), the arithmetic process_group.h
//    promises, done one way for every op: a group of one copies or keeps
//    the buffers, an op of zero elements returns at once, and reductions
//    of f16 and bf16 run on f32 copies rounded once at the end, with AVG
//    a SUM divided once by the group's size.
//
// A body only moves the bytes: see Body for what it is handed.
#ifndef COHORT_WORKER_COLLECTIVE_OP_ENGINE_H_
#define COHORT_WORKER_COLLECTIVE_OP_ENGINE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/collective/collective_op.h"
#include "worker/collective/flight_recorder.h"
#include "worker/collective/op_checks.h"
#include "worker/collective/process_group.h"

namespace cohort {

struct OpEngineOptions {
  ProcessGroupOptions group;
  // Names the group in FAILED_PRECONDITION errors ("gloo process group is
  // unusable after an earlier failure: ...").
  std::string name = "process group";
  // Buffers are host memory, which the engine may read and write: it then
  // does the one-rank, empty and reduction arithmetic for every op (see
  // above). A backend whose buffers the CPU cannot touch (device memory)
  // sets false and its bodies get every op as issued.
  bool host_memory = true;
};

class OpEngine {
 public:
  // A posted Send or Recv that the transfer thread waits on.
  class Transfer {
   public:
    // Unregisters the caller's memory from the transport: afterwards no
    // late message can write into it. The engine destroys a transfer
    // before it completes its Work.
    virtual ~Transfer() = default;
    // Blocks until the message is sent or received, at most `timeout`.
    // OK, or DEADLINE_EXCEEDED / UNAVAILABLE with a message saying what
    // happened (the engine puts the op's name in front).
    virtual absl::Status Wait(absl::Duration timeout) = 0;
  };

  // The transport primitives a backend supplies besides op bodies.
  class Transport {
   public:
    virtual ~Transport() = default;
    // Writes every rank's `bytes` bytes at `mine` to `all`, rank r's at
    // r * bytes, using messages under `tag`, within the group's timeout.
    // verify_ops calls it on the op threads, once per collective.
    virtual absl::Status AllGatherBytes(const void* mine, size_t bytes,
                                        void* all, uint32_t tag) = 0;
    // Posts `op` (already checked) to the transport now, not behind queued
    // collectives, and returns the transfer to wait on.
    virtual absl::StatusOr<std::unique_ptr<Transfer>> Post(
        const PointToPointOp& op) = 0;
  };

  // What the engine hands a body besides the op.
  struct OpRun {
    // The same on every rank, unique among the ops in flight; tag + 1 is
    // the engine's.
    uint32_t tag = 0;
    // Set only for a body submitted as checking itself while verify_ops is
    // on: the op's name (CollectiveOp::Name() of the op as issued), which
    // the body must compare with every other rank's inside its first
    // exchange, and fail with INVALID_ARGUMENT naming the ranks that issued
    // another op before it writes any output. The engine then spends no
    // exchange of its own on the check.
    absl::string_view check;
  };

  // An op's body: runs `op` with the group's other ranks, using messages
  // under run.tag, and returns OK or a status whose code follows
  // process_group.h (DEADLINE_EXCEEDED, UNAVAILABLE, ...) and whose message
  // says what failed; the engine puts the op's name and rank in front.
  // Bodies run on the engine's threads and must not throw.
  //
  // With host_memory, bodies run only for groups of more than one rank and
  // ops that move data (CollectiveOp::empty() is false), and a reduction's
  // body combines with op.reduce where kAvg means kSum (reduce.h's Combine
  // does so): the engine divides. Its buffers may be the engine's f32
  // copies of f16/bf16 ones, and a Reduce's buffer is always a copy that
  // the body may use as scratch on every rank.
  using Body =
      std::function<absl::Status(const CollectiveOp& op, const OpRun& run)>;

  // Starts options.group.threads op threads and the transfer thread.
  // REQUIRES: 0 <= rank < size, options.group.threads >= 1, and
  // `transport` outlives the engine.
  OpEngine(int rank, int size, const OpEngineOptions& options,
           Transport* transport);
  // Waits for the ops already issued to end (each bounded by the timeout),
  // then joins the threads. A backend destroys its engine before the state
  // its bodies use.
  ~OpEngine();

  OpEngine(const OpEngine&) = delete;
  OpEngine& operator=(const OpEngine&) = delete;

  // Checks `op` and queues it to run `body`; returns its Work at once.
  // `checks_itself`: the body verifies the op across ranks (see OpRun).
  std::shared_ptr<Work> Submit(CollectiveOp op, Body body,
                               bool checks_itself = false);

  // Checks `op` and posts it through the transport; returns its Work.
  std::shared_ptr<Work> Post(const PointToPointOp& op);

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Every op issued, as queued, started and ended (flight_recorder.h).
  // Shared, so that a reader (the dumper) may outlive the engine. Null
  // when options.group.flight_records is 0.
  std::shared_ptr<const FlightRecorder> flight_recorder() const {
    return recorder_;
  }
  absl::Duration timeout() const { return options_.group.timeout; }

 private:
  struct QueuedOp {
    std::string name;  // CollectiveOp::Name(), computed when issued.
    uint64_t flight;   // Its index in the flight recorder.
    uint32_t tag;
    CollectiveOp op;
    Body body;
    bool checks_itself;
    std::shared_ptr<Work> work;
  };

  struct PostedTransfer {
    std::string name;
    uint64_t flight;
    std::unique_ptr<Transfer> transfer;
    std::shared_ptr<Work> work;
  };

  GroupShape shape() const { return GroupShape{rank_, size_}; }
  void RunOps();
  void RunTransfers();
  // verify_ops, then the body (through the host-memory rules if they
  // apply). The status is not yet prefixed with the op's name.
  absl::Status RunOp(const QueuedOp& op);
  // INVALID_ARGUMENT naming the ranks that issued a different op than
  // this one in this position.
  absl::Status CheckSameOpEverywhere(const QueuedOp& op);
  absl::Status RunOnHost(const CollectiveOp& op, const OpRun& run,
                         const Body& body);
  absl::Status RunReductionOnHost(const CollectiveOp& op, const OpRun& run,
                                  const Body& body);
  // `status` with "`name` on rank R of N: " in front of its message.
  absl::Status Where(absl::string_view name, const absl::Status& status) const;
  // Completes `work` with `status`; a failure that is not about arguments
  // breaks the group.
  void Finish(const std::shared_ptr<Work>& work, uint64_t flight,
              absl::Status status);
  absl::Status BrokenStatus() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int rank_;
  const int size_;
  const OpEngineOptions options_;
  Transport* const transport_;
  const std::shared_ptr<FlightRecorder> recorder_;  // Null: none kept.

  mutable absl::Mutex mu_;
  uint32_t next_tag_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // The first failure that broke the group, or OK.
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  std::deque<QueuedOp> ops_ ABSL_GUARDED_BY(mu_);
  std::deque<PostedTransfer> transfers_ ABSL_GUARDED_BY(mu_);

  std::vector<std::thread> op_threads_;
  std::thread transfer_thread_;
};

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_OP_ENGINE_H_
