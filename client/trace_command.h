// `cohortctl trace`: merging and summarizing the timelines COHORT_TRACE
// makes (client/trace_timeline.h, docs/debugging.md). Local files only; no
// cohortd.
#ifndef COHORT_CLIENT_TRACE_COMMAND_H_
#define COHORT_CLIENT_TRACE_COMMAND_H_

#include <string>
#include <vector>

namespace cohort {

// Runs `cohortctl trace ARGS...` (ARGS without "trace"):
//   merge DIR|FILE... -o OUT   every rank's file (a folder's trace-rank*.json)
//                              into OUT, written atomically
//   summary DIR|FILE...        the per-step and per-op summary on stdout
// Returns the exit status: 0, 1 for a failure (message on stderr), 2 for
// misuse.
int TraceCommand(const std::vector<std::string>& args);

}  // namespace cohort

#endif  // COHORT_CLIENT_TRACE_COMMAND_H_
