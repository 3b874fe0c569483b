#include "worker/collective/op_checks.h"

#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace cohort {
namespace {

absl::Status CheckSameDtype(absl::string_view op, const BufferView& input,
                            const BufferView& output) {
  if (input.dtype == output.dtype) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": input is ", DtypeName(input.dtype), " but output is ",
                   DtypeName(output.dtype)));
}

absl::Status CheckRoot(absl::string_view op, const GroupShape& group,
                       int root) {
  if (root >= 0 && root < group.size) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      op, ": root ", root, " is not a rank of a group of ", group.size));
}

// Both buffers valid and of one dtype.
absl::Status CheckPair(absl::string_view op, const BufferView& input,
                       const BufferView& output) {
  absl::Status status = CheckBuffer(op, "input", input);
  if (status.ok()) status = CheckBuffer(op, "output", output);
  if (status.ok()) status = CheckSameDtype(op, input, output);
  return status;
}

// `whole` must hold `size` blocks of `part` elements.
absl::Status CheckBlocks(absl::string_view op, absl::string_view whole_name,
                         size_t whole, size_t part, int size) {
  const size_t want = part * static_cast<size_t>(size);
  if (whole == want) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": ", whole_name, " has ", whole, " elements; ", size,
                   " ranks of ", part, " each need ", want));
}

// One count per rank, summing to `total`.
absl::Status CheckCounts(absl::string_view op, absl::string_view what,
                         absl::Span<const size_t> counts, int size,
                         size_t total) {
  if (counts.size() != static_cast<size_t>(size)) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": ", counts.size(), " ", what, " for a group of ", size));
  }
  size_t sum = 0;
  for (size_t count : counts) sum += count;
  if (sum == total) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what, " sum to ",
                                                 sum, " but the buffer has ",
                                                 total, " elements"));
}

}  // namespace

absl::Status CheckBuffer(absl::string_view op, absl::string_view what,
                         const BufferView& view) {
  if (view.count > std::numeric_limits<size_t>::max() / 8) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", what, " count ", view.count, " is too large"));
  }
  if (view.data == nullptr && view.count > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": ", what, " has ", view.count, " elements but no data"));
  }
  return absl::OkStatus();
}

absl::Status CheckBroadcast(const GroupShape& group, const BufferView& buffer,
                            int root) {
  absl::Status status = CheckBuffer("Broadcast", "buffer", buffer);
  if (status.ok()) status = CheckRoot("Broadcast", group, root);
  return status;
}

absl::Status CheckAllReduce(const GroupShape& group, const BufferView& buffer) {
  return CheckBuffer("AllReduce", "buffer", buffer);
}

absl::Status CheckReduce(const GroupShape& group, const BufferView& buffer,
                         int root) {
  absl::Status status = CheckBuffer("Reduce", "buffer", buffer);
  if (status.ok()) status = CheckRoot("Reduce", group, root);
  return status;
}

absl::Status CheckAllGather(const GroupShape& group, const BufferView& input,
                            const BufferView& output) {
  constexpr absl::string_view kOp = "AllGather";
  absl::Status status = CheckPair(kOp, input, output);
  if (status.ok()) {
    status = CheckBlocks(kOp, "output", output.count, input.count, group.size);
  }
  return status;
}

absl::Status CheckAllGatherV(const GroupShape& group, const BufferView& input,
                             const BufferView& output,
                             absl::Span<const size_t> counts) {
  constexpr absl::string_view kOp = "AllGatherV";
  absl::Status status = CheckPair(kOp, input, output);
  if (status.ok()) {
    status = CheckCounts(kOp, "counts", counts, group.size, output.count);
  }
  if (status.ok() && input.count != counts[group.rank]) {
    status = absl::InvalidArgumentError(
        absl::StrCat(kOp, ": input has ", input.count, " elements but counts[",
                     group.rank, "] is ", counts[group.rank]));
  }
  return status;
}

absl::Status CheckGather(const GroupShape& group, const BufferView& input,
                         const BufferView& output, int root) {
  constexpr absl::string_view kOp = "Gather";
  absl::Status status = CheckBuffer(kOp, "input", input);
  if (status.ok()) status = CheckRoot(kOp, group, root);
  if (status.ok() && group.rank == root) {
    status = CheckPair(kOp, input, output);
    if (status.ok()) {
      status =
          CheckBlocks(kOp, "output", output.count, input.count, group.size);
    }
  }
  return status;
}

absl::Status CheckScatter(const GroupShape& group, const BufferView& input,
                          const BufferView& output, int root) {
  constexpr absl::string_view kOp = "Scatter";
  absl::Status status = CheckBuffer(kOp, "output", output);
  if (status.ok()) status = CheckRoot(kOp, group, root);
  if (status.ok() && group.rank == root) {
    status = CheckPair(kOp, input, output);
    if (status.ok()) {
      status = CheckBlocks(kOp, "input", input.count, output.count, group.size);
    }
  }
  return status;
}

absl::Status CheckReduceScatter(const GroupShape& group,
                                const BufferView& input,
                                const BufferView& output) {
  constexpr absl::string_view kOp = "ReduceScatter";
  absl::Status status = CheckPair(kOp, input, output);
  if (status.ok()) {
    status = CheckBlocks(kOp, "input", input.count, output.count, group.size);
  }
  return status;
}

absl::Status CheckAllToAll(const GroupShape& group, const BufferView& input,
                           const BufferView& output) {
  constexpr absl::string_view kOp = "AllToAll";
  absl::Status status = CheckPair(kOp, input, output);
  if (status.ok() &&
      (input.count != output.count || input.count % group.size != 0)) {
    status = absl::InvalidArgumentError(absl::StrCat(
        kOp, ": input and output need the same count, a multiple of the ",
        "group's size ", group.size, "; they have ", input.count, " and ",
        output.count));
  }
  return status;
}

absl::Status CheckAllToAllV(const GroupShape& group, const BufferView& input,
                            absl::Span<const size_t> send_counts,
                            const BufferView& output,
                            absl::Span<const size_t> recv_counts) {
  constexpr absl::string_view kOp = "AllToAllV";
  absl::Status status = CheckPair(kOp, input, output);
  if (status.ok()) {
    status =
        CheckCounts(kOp, "send counts", send_counts, group.size, input.count);
  }
  if (status.ok()) {
    status =
        CheckCounts(kOp, "recv counts", recv_counts, group.size, output.count);
  }
  return status;
}

absl::Status CheckPointToPoint(const GroupShape& group, absl::string_view op,
                               const BufferView& buffer, int peer) {
  absl::Status status = CheckBuffer(op, "buffer", buffer);
  if (status.ok() && (peer < 0 || peer >= group.size || peer == group.rank)) {
    status = absl::InvalidArgumentError(
        absl::StrCat(op, ": the peer must be another rank of a group of ",
                     group.size, ", and this is rank ", group.rank));
  }
  return status;
}

absl::Status CheckSameOp(absl::string_view mine,
                         absl::Span<const RankOp> ranks) {
  std::vector<std::string> differences;
  for (const RankOp& r : ranks) {
    if (!r.name.empty() && r.name != mine) {
      differences.push_back(absl::StrCat("rank ", r.rank, " issued '", r.name, "'"));
    }
  }
  if (differences.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the ranks issued different ops: ", absl::StrJoin(differences, ", ")));
}

}  // namespace cohort
