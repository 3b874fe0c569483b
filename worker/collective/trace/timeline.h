// Timeline: one rank's Chrome-trace / Perfetto JSON file of what it spent
// its time on, for `cohortctl trace merge` and `cohortctl trace summary`
// (docs/debugging.md). A rank writes <dir>/trace-rank<R>.json, one process
// (pid R, named "rank R") whose threads are
//  - "compute": the spans the program adds (the trainer's forward,
//    backward and optimizer, inside a "step" span per step), and
//  - "comm <group>", one per group added: each op of the group's
//    FlightRecorder as a span from its start to its end, the time it was
//    queued in its args.
// Events are complete events ("ph":"X", ts and dur in microseconds since the
// Unix epoch, so that ranks on one host line up); their "cat" is "step",
// "compute" or "comm". A comm span's args: op, seq (the group's collective
// or Send/Recv sequence number), dtype, count (elements this rank passed:
// the input's), bytes (count x the dtype's size), ranks (the group's size),
// queued_us, reduce (reductions), root or peer (where the op has one), step
// (the step whose span the op was queued in, when there is one), state
// ("done", "failed" with error, or "running"/"queued" for an op not ended
// when the file was written).
//
// Cost: nothing unless a program makes a Timeline (FromEnvironment returns
// null when COHORT_TRACE is unset). When on: a span is a string append
// under a mutex; a background thread drains the groups' recorders (every
// drain_every; EndStep also drains a group whose ring is half full, so
// that no op is overwritten before it is read) and rewrites the file every
// flush_every, atomically (a temporary file, then rename), so a job that is
// killed still leaves its last flush. Ops the ring dropped before they were
// read are counted in the file's otherData (dropped_ops).
#ifndef COHORT_WORKER_COLLECTIVE_TRACE_TIMELINE_H_
#define COHORT_WORKER_COLLECTIVE_TRACE_TIMELINE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/collective/flight_recorder.h"

namespace cohort {

inline constexpr char kTraceEnv[] = "COHORT_TRACE";

struct TimelineOptions {
  // The folder the file goes in (made if missing): <dir>/trace-rank<rank>.json.
  std::string dir;
  int rank = 0;        // The process's rank in the job: the trace's pid.
  int world_size = 1;  // Recorded in otherData.
  // What wrote the file ("trainer", "torch"), recorded in otherData.
  std::string source;
  // How often the background thread reads the groups' recorders.
  absl::Duration drain_every = absl::Milliseconds(200);
  // How often it rewrites the file (and once at Open and at the end).
  absl::Duration flush_every = absl::Seconds(5);
  // Events kept at most; later ones are counted (dropped_events), not kept.
  size_t max_events = 2'000'000;
};

class Timeline {
 public:
  // A Timeline writing to $COHORT_TRACE for `rank`, or null when that
  // variable is unset or empty. An error when the folder cannot be made or
  // written.
  static absl::StatusOr<std::unique_ptr<Timeline>> FromEnvironment(
      int rank, int world_size, absl::string_view source);
  // Makes the folder, writes a first (empty) file and starts the background
  // thread. INVALID_ARGUMENT for an empty dir or a negative rank.
  static absl::StatusOr<std::unique_ptr<Timeline>> Open(
      TimelineOptions options);

  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;
  // Stops the thread, reads every group once more and writes the file.
  ~Timeline();

  // Adds a thread "comm <name>" with the ops of `recorder`
  // (ProcessGroup::flight_recorder()), a group of `group_size` ranks, from
  // the next op it records on (earlier ones are skipped). A null recorder (a
  // group that keeps none) adds nothing and returns -1. Returns the id
  // RemoveGroup takes.
  int AddGroup(absl::string_view name,
               std::shared_ptr<const FlightRecorder> recorder, int group_size);
  // Reads the group's ops one last time (ops still in flight are written as
  // they stand: "running" or "queued") and lets go of its recorder.
  void RemoveGroup(int id);

  // A span [start_us, end_us] on the compute thread, of category "compute";
  // step and layer go in its args when >= 0.
  void AddCompute(absl::string_view name, int64_t start_us, int64_t end_us,
                  int step, int layer = -1);
  // Step `step` runs from `start_us` until EndStep: a span of category
  // "step" around its compute spans; the ops queued in it get "step" in
  // their args (so the step is open before its first op is drained).
  // REQUIRES: steps in order, one at a time.
  void BeginStep(int step, int64_t start_us);
  // Ends the open step at `end_us`, and drains a group whose ring is half
  // full. Does nothing without an open step.
  void EndStep(int64_t end_us);

  // Reads the groups and writes the file now.
  absl::Status Flush();

  // <dir>/trace-rank<rank>.json.
  const std::string& path() const { return path_; }

  // Microseconds since the Unix epoch (the FlightRecorder's clock).
  static int64_t NowMicros();

 private:
  struct Group {
    int id = 0;
    std::string name;
    std::shared_ptr<const FlightRecorder> recorder;  // Null once removed.
    int size = 1;
    // Every op index below `next` was written (or lost); `handled` holds
    // those above it already written or lost while an earlier one was still
    // in flight.
    uint64_t next = 0;
    absl::flat_hash_set<uint64_t> handled;
    // The ops in flight at the last drain, written with their state.
    std::vector<FlightRecord> in_flight;
    // Ops that run at once (an engine with several threads, Send and Recv)
    // would overlap on one thread, which viewers cannot draw (spans on a
    // thread must nest): each op goes on the first lane, a thread of its
    // own ("comm <name> #2", ...), whose spans all ended before it started.
    // The latest end on each lane, and how many lanes are named in events_.
    std::vector<int64_t> lane_ends;
    int lanes_named = 0;
  };
  struct Step {
    int step;
    int64_t start_us;
    int64_t end_us;
  };

  explicit Timeline(TimelineOptions options);

  void Run();  // The background thread.
  void DrainLocked(Group& group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes `record` as a span on one of `group`'s lanes (`lane_ends`: the
  // group's, or a copy for an op in flight), naming the lane first if it
  // is not among the first `lanes_named`.
  void AppendOp(const Group& group, const FlightRecord& record, int64_t now_us,
                std::vector<int64_t>& lane_ends, int lanes_named,
                std::string& out) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes a finished op into events_ for good.
  void AddOpLocked(Group& group, const FlightRecord& record, int64_t now_us)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddEventLocked(std::string event) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Names the compute thread, before its first span.
  void NameComputeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int StepAt(int64_t us) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string ContentsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Write(const std::string& contents)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_);

  const TimelineOptions options_;
  const std::string path_;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Group> groups_ ABSL_GUARDED_BY(mu_);
  std::vector<Step> steps_ ABSL_GUARDED_BY(mu_);  // Ended ones.
  std::optional<Step> open_step_ ABSL_GUARDED_BY(mu_);
  // The events, each a JSON object followed by ",\n".
  std::string events_ ABSL_GUARDED_BY(mu_);
  size_t event_count_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t dropped_events_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t dropped_ops_ ABSL_GUARDED_BY(mu_) = 0;
  bool compute_named_ ABSL_GUARDED_BY(mu_) = false;

  // One writer of the file at a time; taken before mu_.
  absl::Mutex write_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::thread thread_;
};

// Adds a compute span from its construction to its destruction; nothing at
// all (no clock read) when `timeline` is null.
class ComputeSpan {
 public:
  ComputeSpan(Timeline* timeline, absl::string_view name, int step,
              int layer = -1)
      : timeline_(timeline), name_(name), step_(step), layer_(layer) {
    if (timeline_ != nullptr) start_us_ = Timeline::NowMicros();
  }
  ~ComputeSpan() {
    if (timeline_ != nullptr) {
      timeline_->AddCompute(name_, start_us_, Timeline::NowMicros(), step_,
                            layer_);
    }
  }
  ComputeSpan(const ComputeSpan&) = delete;
  ComputeSpan& operator=(const ComputeSpan&) = delete;

 private:
  Timeline* const timeline_;
  const absl::string_view name_;  // REQUIRES: outlives the span.
  const int step_;
  const int layer_;
  int64_t start_us_ = 0;
};

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_TRACE_TIMELINE_H_
