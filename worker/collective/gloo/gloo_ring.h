// Algorithms that cohort runs over gloo's point-to-point buffers itself,
// where gloo (2022-05) has no native collective or a slower one on this
// transport (bench/README.md has the figures), and the slots their
// messages use.
#ifndef COHORT_WORKER_COLLECTIVE_GLOO_GLOO_RING_H_
#define COHORT_WORKER_COLLECTIVE_GLOO_GLOO_RING_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "gloo/common/error.h"
#include "gloo/context.h"
#include "worker/collective/dtype.h"

namespace cohort {

// Slot prefixes (the top byte of a gloo slot) for cohort's own messages.
// Gloo's collectives use small prefixes; these stay clear of them and of
// each other.
inline constexpr uint8_t kRingReduceScatterSlotPrefix = 0xc1;
inline constexpr uint8_t kPointToPointSlotPrefix = 0xc2;
inline constexpr uint8_t kRingAllReduceSlotPrefix = 0xc3;
inline constexpr uint8_t kDirectAllReduceSlotPrefix = 0xc4;
inline constexpr uint8_t kDirectAllGatherSlotPrefix = 0xc5;

// A slot unique to (prefix, tag, step): the tag in bits 24-55, the step
// (< 2^24) below.
uint64_t MakeSlot(uint8_t prefix, uint32_t tag, uint32_t step);

// Thrown by the functions below when peers did not answer within the
// timeout: ranks() are those (ranks of the context) whose messages had not
// come, or to which a send could not be written, so that the caller can
// name their hosts. A gloo::IoException, for callers that do not look.
class PeersTimedOut : public gloo::IoException {
 public:
  PeersTimedOut(std::vector<int> ranks, const std::string& what)
      : gloo::IoException(what), ranks_(std::move(ranks)) {}
  const std::vector<int>& ranks() const { return ranks_; }

 private:
  std::vector<int> ranks_;
};

// What every function below shares: `tag` must be the same on every rank
// and unique among the ops in flight; each throws what gloo throws
// (gloo::IoException when its connection to a peer breaks), and
// PeersTimedOut when peers do not answer within `timeout`. kAvg combines as
// kSum: the caller divides. The all-reduces leave bit-identical results on
// every rank.

// Ring reduce-scatter. `input` holds context.size blocks of `block_count`
// elements of `dtype`; `output` receives the `op` of every rank's block
// context.rank. `input` is only read. Each rank sends and receives
// (size - 1) blocks, (size - 1) / size of the input, the least any
// algorithm moves; blocks travel in segments so that reducing one overlaps
// receiving the next, and no copy of the input is made.
void RingReduceScatter(gloo::Context& context, const void* input, void* output,
                       size_t block_count, Dtype dtype, ReduceOp op,
                       uint32_t tag, std::chrono::milliseconds timeout);

// All-reduce in place: a ring reduce-scatter followed by a ring all-gather,
// 2 (size - 1) / size of the buffer sent and received per rank (the
// bandwidth optimum). Unlike gloo's ring, the two phases are not separated:
// each segment is forwarded as soon as it is reduced (or received), so at
// every moment both directions of every connection carry data.
void RingAllReduce(gloo::Context& context, void* data, size_t count,
                   Dtype dtype, ReduceOp op, uint32_t tag,
                   std::chrono::milliseconds timeout);

// Thrown by the Direct functions when `check` differs between ranks: the
// message names the ranks and what they issued.
class OpMismatch : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The Direct functions take an optional `check` (the op engine's
// OpRun::check): when non-empty, every rank sends it to every other beside
// its data, in the messages the op engine's own check exchange uses (so
// ranks that check inside the op and ranks whose engine checks before it
// understand each other), and compares them before it waits for any data
// or writes any output; on a difference it throws OpMismatch. The data
// receives are posted at once, under slots that carry a hash of `check` (so
// a peer that issued another op never matches them), and the data is sent
// once the check has passed: on a mismatch no rank sends anything, and
// nothing of a wrong size is ever received. The check then costs no
// exchange of its own: the names travel while the receives are posted,
// and a send finds its receive already posted.

// All-reduce in place for small buffers: every rank sends its buffer to
// every other and reduces all of them in rank order. One message latency
// instead of the ring's 2 (size - 1) dependent steps, for (size - 1) times
// the buffer on the wire: use it where latency dominates.
void DirectAllReduce(gloo::Context& context, void* data, size_t count,
                     Dtype dtype, ReduceOp op, uint32_t tag,
                     std::chrono::milliseconds timeout,
                     absl::string_view check = {});

// All-gather for small buffers: every rank sends its `bytes` of `input` to
// every other, and writes rank r's at output + r * bytes. One message
// latency instead of gloo's ring's size - 1 dependent steps. `input` may be
// this rank's slot of `output`.
void DirectAllGather(gloo::Context& context, const void* input, size_t bytes,
                     void* output, uint32_t tag,
                     std::chrono::milliseconds timeout,
                     absl::string_view check = {});

// The op engine's check exchange (OpEngine::Transport::AllGatherBytes) as
// the Direct functions speak it: CheckBytes() per rank under `tag`.
inline constexpr size_t kCheckBytes = 128;

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_GLOO_GLOO_RING_H_
