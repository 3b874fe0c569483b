// Timelines across ranks: merging the per-rank Chrome-trace / Perfetto JSON
// files that COHORT_TRACE makes (worker/collective/trace/timeline.h) into
// one, and summarizing one: per step, compute, communication, the part of
// the communication no compute of that rank overlapped (exposed) and the
// part it did (overlap); per op, bandwidths as nccl-tests reports them.
// cohortctl trace merge / summary print these (docs/debugging.md). Pure
// functions of the files' text; no I/O.
#ifndef COHORT_CLIENT_TRACE_TIMELINE_H_
#define COHORT_CLIENT_TRACE_TIMELINE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "google/protobuf/struct.pb.h"

namespace cohort {

// A trace file's text with the name errors should give it.
struct TraceText {
  std::string name;
  std::string json;
};

// Parses a trace written by a cohort Timeline, or merged by MergeTraces.
// INVALID_ARGUMENT naming `name` for text that is not JSON, or JSON without
// a traceEvents array or otherData.cohort_trace.
absl::StatusOr<google::protobuf::Struct> ParseTrace(absl::string_view name,
                                                    absl::string_view json);

// One file holding every event of `traces`, each rank (otherData.rank; a
// merged input brings its ranks) its own process: pid R, named "rank R".
// otherData gets cohort_trace, merged: true and ranks: each input rank's
// own otherData. INVALID_ARGUMENT for an unparsable input or a rank that
// appears twice.
absl::StatusOr<std::string> MergeTraces(absl::Span<const TraceText> traces);

// One step on one rank, or the mean over ranks, in microseconds. Every
// figure is of the step's span [start, end]: compute is the time covered by
// the rank's compute spans, comm the time covered by its comm spans (each
// op from its start to its end, ops that failed included), overlap the
// time covered by both, exposed = comm - overlap (communication that no
// compute of that rank hid), other = step - compute - exposed (neither:
// the rest of the loop, or waiting with no op in flight).
struct StepTimes {
  double step_us = 0;
  double compute_us = 0;
  double comm_us = 0;
  double exposed_us = 0;
  double overlap_us = 0;
  double other_us = 0;
};

struct StepSummary {
  int step = 0;
  int ranks = 0;   // Ranks that have this step.
  StepTimes mean;  // Over those ranks.
};

struct RankSummary {
  int rank = 0;
  int steps = 0;
  StepTimes total;  // Over its steps.
  // Time covered by its comm spans anywhere in the trace (inside steps or
  // not), and from its first event's start to its last event's end.
  double all_comm_us = 0;
  double span_us = 0;
};

// The calls of one op with one dtype, size and group size, over every rank.
struct OpSummary {
  std::string op;
  std::string dtype;
  uint64_t bytes = 0;  // args.bytes: this rank's buffer (the input's).
  int ranks = 0;       // The group's size.
  int calls = 0;       // Spans, all ranks together, that ended OK.
  double median_us = 0;
  double total_us = 0;  // Sum of the spans' durations over all ranks.
  // nccl-tests' figures from the median span: algbw = size / time, size
  // being bytes (all_gather: bytes x ranks, the gathered output), busbw =
  // algbw x BusBandwidthFactor. Absent for ops they do not define (or a
  // median under a microsecond).
  std::optional<double> algbw_gbps;
  std::optional<double> busbw_gbps;
};

struct TraceSummary {
  std::vector<int> ranks;
  std::vector<StepSummary> steps;  // By step number.
  std::vector<RankSummary> per_rank;
  std::vector<OpSummary> ops;  // By op, then dtype, then size.
  bool has_compute = false;    // Any compute span at all.
  uint64_t dropped_ops = 0;    // otherData.dropped_ops, all ranks.
  int unfinished_ops = 0;      // Spans of ops still in flight.
  int failed_ops = 0;
};

// nccl-tests' bus bandwidth factor for `op` in a group of `ranks`:
// AllReduce 2(n-1)/n; AllGather, ReduceScatter and AllToAll (n-1)/n;
// Broadcast, Reduce, Send and Recv 1. nullopt for the others.
std::optional<double> BusBandwidthFactor(absl::string_view op, int ranks);

// INVALID_ARGUMENT for a trace whose events lack what the summary reads.
absl::StatusOr<TraceSummary> SummarizeTrace(
    const google::protobuf::Struct& trace);

// The summary as cohortctl trace summary prints it: per step (the mean over
// ranks), per rank, per op, in milliseconds; say what cannot be told when
// the trace has no compute spans (the torch backend's).
std::string FormatSummary(const TraceSummary& summary);

}  // namespace cohort

#endif  // COHORT_CLIENT_TRACE_TIMELINE_H_
