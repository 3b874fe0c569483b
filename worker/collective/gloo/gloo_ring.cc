#include "worker/collective/gloo/gloo_ring.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gloo/common/error.h"
#include "gloo/transport/unbound_buffer.h"
#include "worker/collective/op_checks.h"
#include "worker/collective/reduce.h"

namespace cohort {
namespace {

using gloo::transport::UnboundBuffer;

// Blocks travel in segments of at most this many bytes: small enough that
// reducing one segment overlaps receiving the next, large enough that the
// per-message cost (a notification each way, a wake-up) stays small. On
// the 2-core development VM, 2 MiB beat 128 KiB, 512 KiB and 8 MiB for 4
// and 64 MiB all-reduces and reduce-scatters of 2 ranks (bench/README.md).
constexpr size_t kSegmentBytes = 2 << 20;

bool IsTimeout(const gloo::IoException& e) {
  return std::strstr(e.what(), "imed out") != nullptr;
}

// Waits for one receive (or send) on `buffer`, whose peer is `peer`: a
// timeout throws PeersTimedOut naming it (gloo's own IoException where
// `peer` is -1: a buffer sending to several peers cannot tell which).
void WaitRecv(UnboundBuffer& buffer, std::chrono::milliseconds timeout,
              const char* what, int peer) {
  try {
    if (!buffer.waitRecv(timeout)) {
      throw gloo::IoException(std::string(what) + ": receive aborted");
    }
  } catch (const PeersTimedOut&) {
    throw;
  } catch (const gloo::IoException& e) {
    if (!IsTimeout(e)) throw;
    throw PeersTimedOut({peer}, std::string(what) + ": " + e.what());
  }
}

void WaitSend(UnboundBuffer& buffer, std::chrono::milliseconds timeout,
              const char* what, int peer = -1) {
  try {
    if (!buffer.waitSend(timeout)) {
      throw gloo::IoException(std::string(what) + ": send aborted");
    }
  } catch (const PeersTimedOut&) {
    throw;
  } catch (const gloo::IoException& e) {
    if (!IsTimeout(e) || peer < 0) throw;
    throw PeersTimedOut({peer}, std::string(what) + ": " + e.what());
  }
}

// Waits for one message from every other rank, each posted on its own
// buffer (`from[rank]`, null for this rank). On a timeout, the peers whose
// message had not come by then are named: the one waited for and those
// whose messages a brief look does not find either.
void WaitRecvFromEach(const std::vector<std::unique_ptr<UnboundBuffer>>& from,
                      std::chrono::milliseconds timeout, const char* what) {
  for (size_t r = 0; r < from.size(); ++r) {
    if (from[r] == nullptr) continue;
    try {
      WaitRecv(*from[r], timeout, what, static_cast<int>(r));
    } catch (const PeersTimedOut& e) {
      std::vector<int> missing = e.ranks();
      for (size_t q = r + 1; q < from.size(); ++q) {
        if (from[q] == nullptr) continue;
        try {
          if (!from[q]->waitRecv(std::chrono::milliseconds(1))) {
            missing.push_back(static_cast<int>(q));
          }
        } catch (const gloo::IoException&) {
          missing.push_back(static_cast<int>(q));
        }
      }
      throw PeersTimedOut(std::move(missing), e.what());
    }
  }
}

// One receive buffer per other rank r, over `bytes` at base + r * stride.
std::vector<std::unique_ptr<UnboundBuffer>> BufferPerPeer(
    gloo::Context& context, char* base, size_t stride, size_t bytes) {
  std::vector<std::unique_ptr<UnboundBuffer>> buffers(context.size);
  for (int r = 0; r < context.size; ++r) {
    if (r != context.rank) {
      buffers[r] = context.createUnboundBuffer(base + r * stride, bytes);
    }
  }
  return buffers;
}

// How a ring cuts a buffer of `count` elements into context.size blocks
// and each block into segments, the same on every rank. Block b is
// elements [b * block_count, ...) (the last blocks may be short or empty);
// every block has `segments` segments of `segment_count` elements (the last
// ones short or empty).
struct RingLayout {
  RingLayout(size_t count, size_t block_count, size_t element_bytes, int steps)
      : count(count), block_count(block_count) {
    segment_count = std::max<size_t>(1, kSegmentBytes / element_bytes);
    // Slots hold step * segments + segment in 24 bits.
    const size_t max_segments = (size_t{1} << 24) / (steps + 1);
    if ((block_count + segment_count - 1) / segment_count > max_segments) {
      segment_count = (block_count + max_segments - 1) / max_segments;
    }
    segments =
        std::max<size_t>(1, (block_count + segment_count - 1) / segment_count);
  }

  // First element and length of segment k of block b.
  size_t Begin(int b, size_t k) const {
    const size_t block_begin = std::min(count, b * block_count);
    const size_t block_end = std::min(count, block_begin + block_count);
    return std::min(block_end, block_begin + k * segment_count);
  }
  size_t Length(int b, size_t k) const {
    const size_t block_begin = std::min(count, b * block_count);
    const size_t block_end = std::min(count, block_begin + block_count);
    return std::min(block_end, Begin(b, k) + segment_count) - Begin(b, k);
  }
  // Offset of segment k inside a scratch block.
  size_t ScratchBegin(size_t k) const { return k * segment_count; }

  size_t count;
  size_t block_count;
  size_t segment_count;
  size_t segments;
};

int Mod(int a, int n) { return ((a % n) + n) % n; }

// The check of an op carried beside its data (see gloo_ring.h): posted when
// constructed, compared by Verify before the caller waits for data.
class CheckExchange {
 public:
  CheckExchange(gloo::Context& context, absl::string_view check, uint32_t tag)
      : context_(context), active_(!check.empty() && context.size > 1) {
    if (!active_) return;
    mine_.assign(kCheckBytes, '\0');
    check.substr(0, kCheckBytes - 1).copy(mine_.data(), kCheckBytes - 1);
    // Fowler-Noll-Vo over the name: the data slots' salt.
    uint32_t hash = 2166136261u;
    for (char c : check) hash = (hash ^ static_cast<uint8_t>(c)) * 16777619u;
    salt_ = 1 + hash % 0xfffffe;
    all_.assign(kCheckBytes * context.size, '\0');
    recv_ = BufferPerPeer(context, all_.data(), kCheckBytes, kCheckBytes);
    send_ = context.createUnboundBuffer(mine_.data(), mine_.size());
    // The slot of the engine's exchange (AllGatherBytes under tag + 1).
    const uint64_t slot = MakeSlot(kDirectAllGatherSlotPrefix, tag + 1, 0);
    for (int r = 0; r < context.size; ++r) {
      if (r != context.rank) recv_[r]->recv(r, slot, 0, kCheckBytes);
    }
    for (int r = 0; r < context.size; ++r) {
      if (r != context.rank) send_->send(r, slot, 0, kCheckBytes);
    }
  }

  // The step field of the op's data slots: 0 unchecked, else the name's.
  uint32_t salt() const { return salt_; }

  void Verify(std::chrono::milliseconds timeout, const char* what) {
    if (!active_) return;
    WaitRecvFromEach(recv_, timeout, what);
    for (int r = 1; r < context_.size; ++r) {
      if (!send_->waitSend(timeout)) {
        throw gloo::IoException(std::string(what) + ": check send aborted");
      }
    }
    std::vector<RankOp> ranks;
    for (int r = 0; r < context_.size; ++r) {
      const char* theirs = all_.data() + r * kCheckBytes;
      if (r != context_.rank) {
        ranks.push_back({r, std::string(theirs, strnlen(theirs, kCheckBytes))});
      }
    }
    absl::Status same = CheckSameOp(mine_.data(), ranks);
    if (!same.ok()) throw OpMismatch(std::string(same.message()));
  }

 private:
  gloo::Context& context_;
  const bool active_;
  uint32_t salt_ = 0;
  std::vector<char> mine_;
  std::vector<char> all_;
  std::vector<std::unique_ptr<UnboundBuffer>> recv_;  // By rank.
  std::unique_ptr<UnboundBuffer> send_;
};

// Scratch memory for the calling thread, reused from op to op: a fresh
// allocation of a large block costs a page fault per 4 KiB on first touch,
// which took 40 % of a 64 MiB reduce-scatter's time here. Ops run on a
// group's few long-lived threads, so this holds at most kBlocks blocks of
// up to kMaxKeptBytes per thread; larger ones are freed after use.
class Scratch {
 public:
  static constexpr int kBlocks = 4;
  static constexpr size_t kMaxKeptBytes = 32 << 20;

  // Blocks [0, blocks) of `bytes` each; their contents are unspecified.
  Scratch(size_t bytes, int blocks) : bytes_(bytes), blocks_(blocks) {
    for (int i = 0; i < blocks_; ++i) {
      if (Blocks()[i].size() < bytes) Blocks()[i].resize(bytes);
    }
  }
  ~Scratch() {
    if (bytes_ > kMaxKeptBytes) {
      for (int i = 0; i < blocks_; ++i) std::vector<char>().swap(Blocks()[i]);
    }
  }
  char* operator[](int i) { return Blocks()[i].data(); }

 private:
  static std::vector<char>* Blocks() {
    thread_local std::vector<char> blocks[kBlocks];
    return blocks;
  }
  const size_t bytes_;
  const int blocks_;
};

}  // namespace

uint64_t MakeSlot(uint8_t prefix, uint32_t tag, uint32_t step) {
  return (static_cast<uint64_t>(prefix) << 56) |
         (static_cast<uint64_t>(tag) << 24) | (step & 0xffffff);
}

// Step s (of size - 1) sends block (rank - 1 - s) to the next rank and
// receives block (rank - 2 - s) from the previous one, folding in this
// rank's share of it. Each block travels size - 1 hops, picking up one
// share per hop, and the last block received is this rank's own, complete.
// A segment received at step s is forwarded at step s + 1 as soon as it is
// reduced, out of one of two accumulators (by step parity).
// Long: about 110 lines on purpose: the setup and the steps share the
// scratch and accumulator buffers, the parity of each, and which sends are
// still in flight; cut apart, every piece would take all of that by
// reference, and the pipeline would no longer read top to bottom, step by
// step, as Gloo's own algorithms do (STYLE.md).
void RingReduceScatter(gloo::Context& context, const void* input, void* output,
                       size_t block_count, Dtype dtype, ReduceOp op,
                       uint32_t tag, std::chrono::milliseconds timeout) {
  constexpr char kWhat[] = "ring reduce-scatter";
  const int rank = context.rank;
  const int size = context.size;
  const size_t esize = DtypeSize(dtype);
  const size_t block_bytes = block_count * esize;
  const char* const in = static_cast<const char*>(input);
  char* const out = static_cast<char*>(output);
  if (block_count == 0) return;
  if (size == 1) {
    std::memmove(out, in, block_bytes);
    return;
  }
  const int steps = size - 1;
  const RingLayout layout(block_count * size, block_count, esize, steps);
  const int next = (rank + 1) % size;
  const int prev = (rank + size - 1) % size;
  // gloo only reads a buffer it sends from.
  char* const readable = const_cast<char*>(in);

  // Received segments land in scratch blocks 0 and 1 (by step parity);
  // with more than two ranks, running sums that go on to the next rank in
  // blocks 2 and 3.
  const int parities = std::min(steps, 2);
  Scratch memory(block_bytes, steps > 1 ? 4 : parities);
  std::vector<std::unique_ptr<UnboundBuffer>> scratch[2];
  std::vector<std::unique_ptr<UnboundBuffer>> acc[2];
  std::vector<bool> acc_sending[2];
  for (int p = 0; p < parities; ++p) {
    for (size_t k = 0; k < layout.segments; ++k) {
      const size_t at = layout.ScratchBegin(k) * esize;
      const size_t bytes = layout.Length(rank, k) * esize;
      const size_t room = std::max<size_t>(bytes, 1);
      scratch[p].push_back(
          at < block_bytes ? context.createUnboundBuffer(memory[p] + at, room)
                           : nullptr);
      acc[p].push_back(
          steps > 1 && at < block_bytes
              ? context.createUnboundBuffer(memory[2 + p] + at, room)
              : nullptr);
    }
    acc_sending[p].assign(layout.segments, false);
  }
  // Step 0 sends straight from the input.
  std::vector<std::unique_ptr<UnboundBuffer>> first_sends;
  auto post_recvs = [&](int s) {
    const int b = Mod(rank - 2 - s, size);
    for (size_t k = 0; k < layout.segments; ++k) {
      const size_t n = layout.Length(b, k);
      if (n == 0) continue;
      scratch[s % 2][k]->recv(
          prev,
          MakeSlot(kRingReduceScatterSlotPrefix, tag, s * layout.segments + k),
          0, n * esize);
    }
  };
  post_recvs(0);
  {
    const int b = Mod(rank - 1, size);
    for (size_t k = 0; k < layout.segments; ++k) {
      const size_t n = layout.Length(b, k);
      if (n == 0) continue;
      first_sends.push_back(context.createUnboundBuffer(
          readable + layout.Begin(b, k) * esize, n * esize));
      first_sends.back()->send(
          next, MakeSlot(kRingReduceScatterSlotPrefix, tag, k), 0, n * esize);
    }
  }
  for (int s = 0; s < steps; ++s) {
    if (s + 1 < steps) post_recvs(s + 1);
    const int b = Mod(rank - 2 - s, size);
    const bool last = s == steps - 1;
    for (size_t k = 0; k < layout.segments; ++k) {
      const size_t n = layout.Length(b, k);
      if (n == 0) continue;
      WaitRecv(*scratch[s % 2][k], timeout, kWhat, prev);
      const size_t in_at = layout.Begin(b, k) * esize;
      const size_t at = layout.ScratchBegin(k) * esize;
      char* dst;
      if (last) {
        dst = out + at;
      } else {
        // This accumulator was sent two steps ago; its bytes must be out
        // before they are overwritten.
        if (acc_sending[s % 2][k]) {
          WaitSend(*acc[s % 2][k], timeout, kWhat, next);
          acc_sending[s % 2][k] = false;
        }
        dst = memory[2 + s % 2] + at;
      }
      Combine(dtype, op, dst, in + in_at, memory[s % 2] + at, n);
      if (!last) {
        acc[s % 2][k]->send(next,
                            MakeSlot(kRingReduceScatterSlotPrefix, tag,
                                     (s + 1) * layout.segments + k),
                            0, n * esize);
        acc_sending[s % 2][k] = true;
      }
    }
  }
  for (auto& send : first_sends) WaitSend(*send, timeout, kWhat, next);
  for (int p = 0; p < 2; ++p) {
    for (size_t k = 0; k < acc_sending[p].size(); ++k) {
      if (acc_sending[p][k]) WaitSend(*acc[p][k], timeout, kWhat, next);
    }
  }
}

// Steps 0 .. size - 2 are the reduce-scatter above, in place; steps
// size - 1 .. 2 size - 3 the all-gather. Both use one rule: step s sends
// block (rank - 1 - s) and receives block (rank - 2 - s), so the block
// received at step s is the one sent at step s + 1, segment by segment.
// Long: about 90 lines, for the reason RingReduceScatter is: its buffers,
// the posted receives and the sends in flight are one pipeline's state,
// read top to bottom.
void RingAllReduce(gloo::Context& context, void* data, size_t count,
                   Dtype dtype, ReduceOp op, uint32_t tag,
                   std::chrono::milliseconds timeout) {
  constexpr char kWhat[] = "ring all-reduce";
  const int rank = context.rank;
  const int size = context.size;
  if (size == 1 || count == 0) return;
  const size_t esize = DtypeSize(dtype);
  const size_t block_count = (count + size - 1) / size;
  const int steps = 2 * (size - 1);
  const int reduce_steps = size - 1;
  const RingLayout layout(count, block_count, esize, steps);
  const int next = (rank + 1) % size;
  const int prev = (rank + size - 1) % size;
  char* const base = static_cast<char*>(data);

  // One unbound buffer per (block, segment) of the data, and per segment of
  // the two scratch blocks that reduce-scatter steps receive into: waiting
  // on a buffer then waits for exactly that segment, whatever order the
  // segments arrive in.
  std::vector<std::unique_ptr<UnboundBuffer>> region(size * layout.segments);
  for (int b = 0; b < size; ++b) {
    for (size_t k = 0; k < layout.segments; ++k) {
      const size_t n = layout.Length(b, k);
      if (n == 0) continue;
      region[b * layout.segments + k] = context.createUnboundBuffer(
          base + layout.Begin(b, k) * esize, n * esize);
    }
  }
  const size_t block_bytes = block_count * esize;
  const int parities = std::min(reduce_steps, 2);
  Scratch scratch_memory(block_bytes, parities);
  std::vector<std::unique_ptr<UnboundBuffer>> scratch[2];
  for (int p = 0; p < parities; ++p) {
    scratch[p].resize(layout.segments);
    for (size_t k = 0; k < layout.segments; ++k) {
      const size_t at = layout.ScratchBegin(k) * esize;
      if (at >= block_bytes) continue;
      scratch[p][k] = context.createUnboundBuffer(
          scratch_memory[p] + at,
          std::min(block_bytes - at, layout.segment_count * esize));
    }
  }
  auto slot = [&](int s, size_t k) {
    return MakeSlot(kRingAllReduceSlotPrefix, tag, s * layout.segments + k);
  };
  std::vector<UnboundBuffer*> sent;
  auto send = [&](int s, size_t k) {
    const int b = Mod(rank - 1 - s, size);
    const size_t n = layout.Length(b, k);
    if (n == 0) return;
    UnboundBuffer* buffer = region[b * layout.segments + k].get();
    buffer->send(next, slot(s, k), 0, n * esize);
    sent.push_back(buffer);
  };
  auto recv_buffer = [&](int s, size_t k) -> UnboundBuffer* {
    const int b = Mod(rank - 2 - s, size);
    if (s < reduce_steps) return scratch[s % 2][k].get();
    return region[b * layout.segments + k].get();
  };
  auto post_recvs = [&](int s) {
    const int b = Mod(rank - 2 - s, size);
    for (size_t k = 0; k < layout.segments; ++k) {
      const size_t n = layout.Length(b, k);
      if (n == 0) continue;
      recv_buffer(s, k)->recv(prev, slot(s, k), 0, n * esize);
    }
  };
  post_recvs(0);
  for (size_t k = 0; k < layout.segments; ++k) send(0, k);
  for (int s = 0; s < steps; ++s) {
    if (s + 1 < steps) post_recvs(s + 1);
    const int b = Mod(rank - 2 - s, size);
    for (size_t k = 0; k < layout.segments; ++k) {
      const size_t n = layout.Length(b, k);
      if (n == 0) continue;
      WaitRecv(*recv_buffer(s, k), timeout, kWhat, prev);
      if (s < reduce_steps) {
        char* mine = base + layout.Begin(b, k) * esize;
        Combine(dtype, op, mine, mine,
                scratch_memory[s % 2] + layout.ScratchBegin(k) * esize, n);
      }
      if (s + 1 < steps) send(s + 1, k);
    }
  }
  for (UnboundBuffer* buffer : sent) WaitSend(*buffer, timeout, kWhat, next);
}

void DirectAllReduce(gloo::Context& context, void* data, size_t count,
                     Dtype dtype, ReduceOp op, uint32_t tag,
                     std::chrono::milliseconds timeout,
                     absl::string_view check) {
  constexpr char kWhat[] = "direct all-reduce";
  const int rank = context.rank;
  const int size = context.size;
  if (size == 1 || count == 0) return;
  CheckExchange checked(context, check, tag);
  const size_t bytes = count * DtypeSize(dtype);
  char* const mine = static_cast<char*>(data);
  // Every rank's buffer by rank; this rank's own slot holds a copy of its
  // buffer only where the reduction below would read it after overwriting
  // it (ranks past 1). The thread's reused scratch, not a fresh vector: a
  // new 256 KiB-1 MiB block is an mmap, a zero fill and a page fault per
  // 4 KiB on every call, which made medium all-reduces cost more per byte
  // than small and large ones.
  Scratch scratch(bytes * size, 1);
  char* const all = scratch[0];
  std::vector<std::unique_ptr<UnboundBuffer>> recv_buffers =
      BufferPerPeer(context, all, bytes, bytes);
  std::unique_ptr<UnboundBuffer> send_buffer =
      context.createUnboundBuffer(mine, bytes);
  const uint64_t slot =
      MakeSlot(kDirectAllReduceSlotPrefix, tag, checked.salt());
  for (int r = 0; r < size; ++r) {
    if (r != rank) recv_buffers[r]->recv(r, slot, 0, bytes);
  }
  // Sends wait for the check: on a mismatch no rank sends, so the posted
  // receives (whose slot no other op uses) are simply never matched.
  checked.Verify(timeout, kWhat);
  for (int r = 0; r < size; ++r) {
    if (r != rank) send_buffer->send(r, slot, 0, bytes);
  }
  if (rank > 1) std::memcpy(all + rank * bytes, mine, bytes);
  WaitRecvFromEach(recv_buffers, timeout, kWhat);
  for (int r = 1; r < size; ++r) WaitSend(*send_buffer, timeout, kWhat);
  // In rank order on every rank, so every rank gets the same bits.
  auto source = [&](int r) -> const char* {
    return r == rank && rank <= 1 ? mine : all + r * bytes;
  };
  Combine(dtype, op, mine, source(0), source(1), count);
  for (int r = 2; r < size; ++r) {
    Combine(dtype, op, mine, mine, source(r), count);
  }
}

void DirectAllGather(gloo::Context& context, const void* input, size_t bytes,
                     void* output, uint32_t tag,
                     std::chrono::milliseconds timeout,
                     absl::string_view check) {
  constexpr char kWhat[] = "direct all-gather";
  const int rank = context.rank;
  const int size = context.size;
  char* const out = static_cast<char*>(output);
  if (bytes == 0) return;
  if (size == 1) {
    std::memmove(out + rank * bytes, input, bytes);
    return;
  }
  CheckExchange checked(context, check, tag);
  std::vector<std::unique_ptr<UnboundBuffer>> buffers =
      BufferPerPeer(context, out, bytes, bytes);
  // Sent from the input itself, so that this rank's slot of the output is
  // written only once the check has passed.
  std::unique_ptr<UnboundBuffer> source =
      context.createUnboundBuffer(const_cast<void*>(input), bytes);
  const uint64_t slot =
      MakeSlot(kDirectAllGatherSlotPrefix, tag, checked.salt());
  for (int r = 0; r < size; ++r) {
    if (r != rank) buffers[r]->recv(r, slot, 0, bytes);
  }
  checked.Verify(timeout, kWhat);  // Before any send: see DirectAllReduce.
  for (int r = 0; r < size; ++r) {
    if (r != rank) source->send(r, slot, 0, bytes);
  }
  for (int r = 1; r < size; ++r) WaitSend(*source, timeout, kWhat);
  std::memmove(out + rank * bytes, input, bytes);
  WaitRecvFromEach(buffers, timeout, kWhat);
}

}  // namespace cohort
