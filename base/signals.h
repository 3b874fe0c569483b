// Stop signals taken synchronously: a process blocks them before it starts
// any thread, so every thread inherits the mask, and one thread takes them
// with sigwait/sigtimedwait instead of an async handler.
#ifndef COHORT_BASE_SIGNALS_H_
#define COHORT_BASE_SIGNALS_H_

#include <signal.h>

namespace cohort::base {

// Blocks SIGINT and SIGTERM in the calling thread and returns that
// set. REQUIRES: called before the process starts threads (gRPC's
// included), or they keep the default handlers and die on a signal.
sigset_t BlockStopSignals();

}  // namespace cohort::base

#endif  // COHORT_BASE_SIGNALS_H_
