#include "worker/gloo_ring.h"

#include <memory>
#include <vector>

#include "gloo/common/error.h"
#include "gloo/transport/unbound_buffer.h"
#include "worker/reduce.h"

namespace cohort {

uint64_t MakeSlot(uint8_t prefix, uint32_t tag, uint32_t step) {
  return (static_cast<uint64_t>(prefix) << 56) |
         (static_cast<uint64_t>(tag) << 24) | (step & 0xffffff);
}

void RingReduceScatter(gloo::Context& context, void* blocks, size_t block_count,
                       Dtype dtype, ReduceOp op, uint32_t tag,
                       std::chrono::milliseconds timeout) {
  const int rank = context.rank;
  const int size = context.size;
  if (size == 1 || block_count == 0) return;
  const size_t block_bytes = block_count * DtypeSize(dtype);
  char* const base = static_cast<char*>(blocks);
  std::vector<char> incoming(block_bytes);
  std::unique_ptr<gloo::transport::UnboundBuffer> send_buffer =
      context.createUnboundBuffer(base, block_bytes * size);
  std::unique_ptr<gloo::transport::UnboundBuffer> recv_buffer =
      context.createUnboundBuffer(incoming.data(), incoming.size());
  const int next = (rank + 1) % size;
  const int prev = (rank + size - 1) % size;
  // Step s: send block (rank - 1 - s) to the next rank, receive block
  // (rank - 2 - s) from the previous one and fold in this rank's share.
  // Each block travels size - 1 hops, picking up one share per hop, and the
  // last block received is this rank's own, complete.
  for (int step = 0; step < size - 1; ++step) {
    const size_t send_block = (rank - 1 - step + 2 * size) % size;
    const size_t recv_block = (rank - 2 - step + 2 * size) % size;
    const uint64_t slot = MakeSlot(kRingReduceScatterSlotPrefix, tag, step);
    recv_buffer->recv(prev, slot, 0, block_bytes);
    send_buffer->send(next, slot, send_block * block_bytes, block_bytes);
    if (!recv_buffer->waitRecv(timeout)) {
      throw gloo::IoException("ring reduce-scatter: receive aborted");
    }
    char* sum = base + recv_block * block_bytes;
    Combine(dtype, op, sum, sum, incoming.data(), block_count);
    // The block sent is not written again; waiting here keeps one send of
    // this op in flight at a time, so a slow peer cannot pile them up.
    if (!send_buffer->waitSend(timeout)) {
      throw gloo::IoException("ring reduce-scatter: send aborted");
    }
  }
}

}  // namespace cohort
