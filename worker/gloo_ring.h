// Algorithms that cohort runs over gloo's point-to-point buffers itself,
// where gloo (2022-05) has no native collective, and the slots their
// messages use.
#ifndef COHORT_WORKER_GLOO_RING_H_
#define COHORT_WORKER_GLOO_RING_H_

#include <chrono>
#include <cstddef>
#include <cstdint>

#include "gloo/context.h"
#include "worker/dtype.h"

namespace cohort {

// Slot prefixes (the top byte of a gloo slot) for cohort's own messages.
// Gloo's collectives use small prefixes; these stay clear of them and of
// each other.
inline constexpr uint8_t kRingReduceScatterSlotPrefix = 0xc1;
inline constexpr uint8_t kPointToPointSlotPrefix = 0xc2;

// A slot unique to (prefix, tag, step): the tag in bits 24-55, the step
// (< 2^24) below.
uint64_t MakeSlot(uint8_t prefix, uint32_t tag, uint32_t step);

// Ring reduce-scatter, in place. `blocks` holds context.size blocks of
// `block_count` elements of `dtype`. Afterwards block context.rank holds
// the `op` of every rank's block context.rank (kAvg sums: the caller
// divides); the other blocks hold partial results. Each rank sends and
// receives (size - 1) blocks, (size - 1) / size of the buffer, the least
// any algorithm moves. `tag` must be the same on every rank and unique
// among the ops in flight. Throws what gloo throws: gloo::IoException when
// a peer does not answer within `timeout` or its connection breaks.
void RingReduceScatter(gloo::Context& context, void* blocks, size_t block_count,
                       Dtype dtype, ReduceOp op, uint32_t tag,
                       std::chrono::milliseconds timeout);

}  // namespace cohort

#endif  // COHORT_WORKER_GLOO_RING_H_
