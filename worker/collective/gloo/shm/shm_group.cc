#include "worker/collective/gloo/shm/shm_group.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/collective/op_checks.h"
#include "worker/collective/reduce.h"

namespace cohort {
namespace {

#define RETURN_IF_ERROR(expr)          \
  do {                                 \
    absl::Status status_ = (expr);     \
    if (!status_.ok()) return status_; \
  } while (false)

std::vector<BarrierWords*> Words(const ShmSegment& segment) {
  std::vector<BarrierWords*> words;
  for (int q = 0; q < segment.size(); ++q) {
    words.push_back(&segment.control(q).barrier);
  }
  return words;
}

FutexBarrierOptions BarrierOptions(const ShmSegment& segment,
                                   absl::Duration spin) {
  FutexBarrierOptions options;
  options.spin = spin;
  options.timeout = segment.options().timeout;
  options.group_ranks = segment.options().group_ranks;
  options.failed = [s = &segment] { return s->FailedStatus(""); };
  return options;
}

// [begin, end) of the elements of a round of `count` that local rank `q` of
// `size` reduces: boundaries on 64-byte multiples so that two reducing
// ranks never write the same cache line.
std::pair<size_t, size_t> Portion(size_t count, size_t element, int q,
                                  int size) {
  const size_t align = std::max<size_t>(1, 64 / element);
  auto boundary = [&](int i) -> size_t {
    if (i >= size) return count;
    return count * i / size / align * align;
  };
  return {boundary(q), boundary(q + 1)};
}

// memcpy that accepts an empty range with null pointers (an empty vector's
// data()), which memcpy itself does not.
inline void CopyBytes(void* to, const void* from, size_t n) {
  if (n > 0) std::memcpy(to, from, n);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmGroup>> ShmGroup::Create(
    Store& store, absl::string_view key, int rank, int size,
    const ShmGroupOptions& options) {
  absl::StatusOr<std::unique_ptr<ShmSegment>> segment =
      ShmSegment::Create(store, key, rank, size, options);
  if (!segment.ok()) return segment.status();
  return std::unique_ptr<ShmGroup>(
      new ShmGroup(std::move(*segment), options.spin));
}

ShmGroup::ShmGroup(std::unique_ptr<ShmSegment> segment, absl::Duration spin)
    : segment_(std::move(segment)),
      rank_(segment_->rank()),
      size_(segment_->size()),
      barrier_(rank_, Words(*segment_), BarrierOptions(*segment_, spin)) {
  // Every local rank has mapped the segment and stored its pid.
  barrier_.NotePeers();
}

void ShmGroup::BeginOp(absl::string_view check, uint64_t aux) {
  deadline_ = absl::Now() + segment_->options().timeout;
  const uint32_t parity = ops_++ & 1;
  Control& me = control(rank_);
  const size_t n = std::min(check.size(), ShmSegment::kCheckBytes - 1);
  CopyBytes(me.check[parity], check.data(), n);
  me.check[parity][n] = '\0';
  me.aux[parity] = aux;
  check_pending_ = !check.empty();
}

absl::Status ShmGroup::Barrier() {
  RETURN_IF_ERROR(barrier_.Arrive(deadline_));
  if (check_pending_) {
    check_pending_ = false;
    return CompareChecks();
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::FailUnlessChecked(absl::Status status) {
  if (!status.ok() && status.code() != absl::StatusCode::kInvalidArgument) {
    Fail(status);
  }
  return status;
}

absl::Status ShmGroup::CompareChecks() {
  const uint32_t parity = (ops_ - 1) & 1;
  auto name = [&](int q) {
    const char* check = control(q).check[parity];
    return std::string(check, strnlen(check, ShmSegment::kCheckBytes));
  };
  std::vector<RankOp> ranks;
  for (int q = 0; q < size_; ++q)
    ranks.push_back({segment_->GroupRank(q), name(q)});
  return CheckSameOp(name(rank_), ranks);
}

uint64_t ShmGroup::MaxAux() const {
  const uint32_t parity = (ops_ - 1) & 1;
  uint64_t most = 0;
  for (int q = 0; q < size_; ++q) most = std::max(most, control(q).aux[parity]);
  return most;
}

absl::Status ShmGroup::Run(const CollectiveOp& op, absl::string_view check) {
  RETURN_IF_ERROR(segment_->FailedStatus(" earlier"));
  uint64_t aux = 0;
  if (op.kind == OpKind::kAllToAllV) {
    // The rounds this rank needs; every rank runs the most any needs.
    const size_t piece = std::max<size_t>(1, slot_bytes() / size_);
    const size_t element = DtypeSize(op.input.dtype);
    size_t largest = 0;
    for (size_t c : op.counts) largest = std::max(largest, c * element);
    for (size_t c : op.recv_counts) largest = std::max(largest, c * element);
    aux = (largest + piece - 1) / piece;
  }
  BeginOp(check, aux);
  absl::Status status;
  switch (op.kind) {
    case OpKind::kBroadcast:
      status = Broadcast(op.output, op.root);
      break;
    case OpKind::kAllReduce:
      status = AllReduceOrReduce(op.output, op.reduce, -1);
      break;
    case OpKind::kReduce:
      status = AllReduceOrReduce(op.output, op.reduce, op.root);
      break;
    case OpKind::kAllGather:
      status = AllGather(op, /*to_root_only=*/false);
      break;
    case OpKind::kGather:
      status = AllGather(op, /*to_root_only=*/true);
      break;
    case OpKind::kAllGatherV:
      status = AllGatherV(op);
      break;
    case OpKind::kScatter:
      status = Scatter(op);
      break;
    case OpKind::kAllToAll:
      status = AllToAll(op);
      break;
    case OpKind::kAllToAllV:
      status = AllToAllV(op);
      break;
    case OpKind::kReduceScatter:
      status = ReduceScatter(op);
      break;
    case OpKind::kBarrier:
      // Every op takes one round before its first barrier, so that ops
      // that stop there (a failed check) leave every rank's rounds alike.
      NextRound();
      status = Barrier();
      break;
  }
  return FailUnlessChecked(std::move(status));
}

absl::Status ShmGroup::ReduceToLeader(const BufferView& data, ReduceOp op,
                                      absl::string_view check) {
  BeginOp(check, 0);
  // A peer may be spending a timeout on other hosts (the op's check
  // exchange over TCP) before it arrives; if that fails it marks this group
  // failed with its status, which names them (see BroadcastFromLeader).
  deadline_ += segment_->options().timeout;
  return FailUnlessChecked(AllReduceOrReduce(data, op, 0));
}

absl::Status ShmGroup::BroadcastFromLeader(const BufferView& data,
                                           const absl::Status& leader_status) {
  BeginOp("", 0);
  const uint32_t parity = (ops_ - 1) & 1;
  if (rank_ == 0) {
    Control& me = control(0);
    me.status_code[parity] = static_cast<int32_t>(leader_status.code());
    const std::string note(
        leader_status.message().substr(0, ShmSegment::kCheckBytes - 1));
    std::memcpy(me.note[parity], note.c_str(), note.size() + 1);
    if (!leader_status.ok()) {
      // The others learn it at the first round's barrier; nothing is copied.
      NextRound();
      absl::Status arrived = Barrier();
      return arrived.ok() ? leader_status : arrived;
    }
    return Broadcast(data, 0);
  }
  // The first round's barrier publishes the leader's status. The leader
  // may spend up to a timeout of its own waiting on the other hosts before
  // it has one to publish, and that status names the hosts it waited for:
  // wait for it a timeout longer, rather than fail first naming only the
  // leader.
  deadline_ += segment_->options().timeout;
  const size_t bytes = data.bytes();
  char* out = static_cast<char*>(data.data);
  for (size_t off = 0; off == 0 || off < bytes; off += slot_bytes()) {
    const uint32_t round = NextRound();
    absl::Status arrived = Barrier();
    if (!arrived.ok()) {
      Fail(arrived);
      return arrived;
    }
    if (off == 0 && control(0).status_code[parity] != 0) {
      return absl::Status(
          static_cast<absl::StatusCode>(control(0).status_code[parity]),
          absl::StrCat(
              "rank ", segment_->GroupRank(0),
              ", this host's leader, failed: ", control(0).note[parity]));
    }
    const size_t n = std::min(slot_bytes(), bytes - off);
    CopyBytes(out + off, slot(0, round), n);
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::AllReduceOrReduce(const BufferView& data, ReduceOp op,
                                         int root) {
  const size_t element = DtypeSize(data.dtype);
  const size_t chunk = slot_bytes() / element;
  char* bytes = static_cast<char*>(data.data);
  for (size_t off = 0; off == 0 || off < data.count; off += chunk) {
    const size_t m = std::min(chunk, data.count - off);
    const uint32_t round = NextRound();
    CopyBytes(slot(rank_, round), bytes + off * element, m * element);
    RETURN_IF_ERROR(Barrier());
    // This rank's portion of the round, reduced into its own slot: its own
    // value first, then the others' in rank order.
    const auto [begin, end] = Portion(m, element, rank_, size_);
    if (end > begin) {
      char* mine = slot(rank_, round) + begin * element;
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        Combine(data.dtype, op, mine, mine, slot(q, round) + begin * element,
                end - begin);
      }
    }
    RETURN_IF_ERROR(Barrier());
    if (root >= 0 && root != rank_) continue;
    for (int q = 0; q < size_; ++q) {
      const auto [b, e] = Portion(m, element, q, size_);
      CopyBytes(bytes + (off + b) * element, slot(q, round) + b * element,
                (e - b) * element);
    }
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::Broadcast(const BufferView& data, int root) {
  const size_t bytes = data.bytes();
  char* buffer = static_cast<char*>(data.data);
  for (size_t off = 0; off == 0 || off < bytes; off += slot_bytes()) {
    const size_t n = std::min(slot_bytes(), bytes - off);
    const uint32_t round = NextRound();
    if (rank_ == root) CopyBytes(slot(root, round), buffer + off, n);
    RETURN_IF_ERROR(Barrier());
    if (rank_ != root) CopyBytes(buffer + off, slot(root, round), n);
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::AllGather(const CollectiveOp& op, bool to_root_only) {
  const size_t bytes = op.input.bytes();
  const char* in = static_cast<const char*>(op.input.data);
  char* out = static_cast<char*>(op.output.data);
  const bool reads = !to_root_only || rank_ == op.root;
  for (size_t off = 0; off == 0 || off < bytes; off += slot_bytes()) {
    const size_t n = std::min(slot_bytes(), bytes - off);
    const uint32_t round = NextRound();
    CopyBytes(slot(rank_, round), in + off, n);
    RETURN_IF_ERROR(Barrier());
    if (!reads) continue;
    for (int q = 0; q < size_; ++q) {
      CopyBytes(out + q * bytes + off, slot(q, round), n);
    }
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::AllGatherV(const CollectiveOp& op) {
  const size_t element = DtypeSize(op.input.dtype);
  std::vector<size_t> at(size_ + 1, 0);  // Byte offsets in the output.
  size_t largest = 0;
  for (int q = 0; q < size_; ++q) {
    at[q + 1] = at[q] + op.counts[q] * element;
    largest = std::max(largest, op.counts[q] * element);
  }
  const char* in = static_cast<const char*>(op.input.data);
  char* out = static_cast<char*>(op.output.data);
  const size_t s = slot_bytes();
  for (size_t lo = 0; lo == 0 || lo < largest; lo += s) {
    const uint32_t round = NextRound();
    auto part = [&](int q) {
      const size_t total = at[q + 1] - at[q];
      return total > lo ? std::min(s, total - lo) : size_t{0};
    };
    // Offsets only where bytes move: a rank may give nothing (a null input).
    if (const size_t n = part(rank_); n > 0) {
      std::memcpy(slot(rank_, round), in + lo, n);
    }
    RETURN_IF_ERROR(Barrier());
    for (int q = 0; q < size_; ++q) {
      if (const size_t n = part(q); n > 0) {
        std::memcpy(out + at[q] + lo, slot(q, round), n);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::Scatter(const CollectiveOp& op) {
  const size_t block = op.output.bytes();
  const size_t piece = std::max<size_t>(64, slot_bytes() / size_ / 64 * 64);
  const char* in = static_cast<const char*>(op.input.data);
  char* out = static_cast<char*>(op.output.data);
  for (size_t off = 0; off == 0 || off < block; off += piece) {
    const size_t n = std::min(piece, block - off);
    const uint32_t round = NextRound();
    if (rank_ == op.root) {
      for (int q = 0; q < size_; ++q) {
        CopyBytes(slot(rank_, round) + q * piece, in + q * block + off, n);
      }
    }
    RETURN_IF_ERROR(Barrier());
    CopyBytes(out + off, slot(op.root, round) + rank_ * piece, n);
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::AllToAll(const CollectiveOp& op) {
  const size_t block = op.output.bytes() / size_;
  const size_t piece = std::max<size_t>(64, slot_bytes() / size_ / 64 * 64);
  const char* in = static_cast<const char*>(op.input.data);
  char* out = static_cast<char*>(op.output.data);
  for (size_t off = 0; off == 0 || off < block; off += piece) {
    const size_t n = std::min(piece, block - off);
    const uint32_t round = NextRound();
    for (int q = 0; q < size_; ++q) {
      CopyBytes(slot(rank_, round) + q * piece, in + q * block + off, n);
    }
    RETURN_IF_ERROR(Barrier());
    for (int q = 0; q < size_; ++q) {
      CopyBytes(out + q * block + off, slot(q, round) + rank_ * piece, n);
    }
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::AllToAllV(const CollectiveOp& op) {
  const size_t element = DtypeSize(op.input.dtype);
  const size_t piece = std::max<size_t>(1, slot_bytes() / size_);
  std::vector<size_t> send_at(size_ + 1, 0), recv_at(size_ + 1, 0);
  for (int q = 0; q < size_; ++q) {
    send_at[q + 1] = send_at[q] + op.counts[q] * element;
    recv_at[q + 1] = recv_at[q] + op.recv_counts[q] * element;
  }
  auto part = [piece](size_t total, size_t lo) {
    return total > lo ? std::min(piece, total - lo) : size_t{0};
  };
  const char* in = static_cast<const char*>(op.input.data);
  char* out = static_cast<char*>(op.output.data);
  uint64_t rounds = 1;
  for (uint64_t k = 0; k < rounds; ++k) {
    const size_t lo = k * piece;
    const uint32_t round = NextRound();
    for (int q = 0; q < size_; ++q) {
      if (const size_t n = part(send_at[q + 1] - send_at[q], lo); n > 0) {
        std::memcpy(slot(rank_, round) + q * piece, in + send_at[q] + lo, n);
      }
    }
    RETURN_IF_ERROR(Barrier());
    if (k == 0) rounds = std::max<uint64_t>(1, MaxAux());
    for (int q = 0; q < size_; ++q) {
      if (const size_t n = part(recv_at[q + 1] - recv_at[q], lo); n > 0) {
        std::memcpy(out + recv_at[q] + lo, slot(q, round) + rank_ * piece, n);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ShmGroup::ReduceScatter(const CollectiveOp& op) {
  const size_t element = DtypeSize(op.output.dtype);
  const size_t count = op.output.count;
  const size_t piece_bytes =
      std::max<size_t>(64, slot_bytes() / size_ / 64 * 64);
  const size_t piece = piece_bytes / element;
  const char* in = static_cast<const char*>(op.input.data);
  char* out = static_cast<char*>(op.output.data);
  for (size_t off = 0; off == 0 || off < count; off += piece) {
    const size_t m = std::min(piece, count - off);
    const uint32_t round = NextRound();
    for (int q = 0; q < size_; ++q) {
      CopyBytes(slot(rank_, round) + q * piece_bytes,
                in + (q * count + off) * element, m * element);
    }
    RETURN_IF_ERROR(Barrier());
    // Rank order, straight from the slots into the caller's output.
    char* dst = out + off * element;
    const size_t mine = rank_ * piece_bytes;
    Combine(op.output.dtype, op.reduce, dst, slot(0, round) + mine,
            slot(1, round) + mine, m);
    for (int q = 2; q < size_; ++q) {
      Combine(op.output.dtype, op.reduce, dst, dst, slot(q, round) + mine, m);
    }
  }
  return absl::OkStatus();
}

}  // namespace cohort
