// The argument checks of every ProcessGroup op, shared by the backends so
// that each rejects the same calls with the same words. Each returns OK or
// INVALID_ARGUMENT with a message that names the op and the bad value; none
// looks at buffer contents or talks to peers.
#ifndef COHORT_WORKER_COLLECTIVE_OP_CHECKS_H_
#define COHORT_WORKER_COLLECTIVE_OP_CHECKS_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "worker/collective/process_group.h"

namespace cohort {

// Where the calling rank sits: its rank and the group's size.
struct GroupShape {
  int rank = 0;
  int size = 1;
};

// A view with data for its elements and a byte count that fits size_t.
absl::Status CheckBuffer(absl::string_view op, absl::string_view what,
                         const BufferView& view);

absl::Status CheckBroadcast(const GroupShape& group, const BufferView& buffer,
                            int root);
absl::Status CheckAllReduce(const GroupShape& group, const BufferView& buffer);
absl::Status CheckReduce(const GroupShape& group, const BufferView& buffer,
                         int root);
absl::Status CheckAllGather(const GroupShape& group, const BufferView& input,
                            const BufferView& output);
absl::Status CheckAllGatherV(const GroupShape& group, const BufferView& input,
                             const BufferView& output,
                             absl::Span<const size_t> counts);
// `output` is checked on the root only.
absl::Status CheckGather(const GroupShape& group, const BufferView& input,
                         const BufferView& output, int root);
// `input` is checked on the root only.
absl::Status CheckScatter(const GroupShape& group, const BufferView& input,
                          const BufferView& output, int root);
absl::Status CheckReduceScatter(const GroupShape& group,
                                const BufferView& input,
                                const BufferView& output);
absl::Status CheckAllToAll(const GroupShape& group, const BufferView& input,
                           const BufferView& output);
absl::Status CheckAllToAllV(const GroupShape& group, const BufferView& input,
                            absl::Span<const size_t> send_counts,
                            const BufferView& output,
                            absl::Span<const size_t> recv_counts);
// verify_ops' verdict, worded the same by every transport that compares
// op names: INVALID_ARGUMENT naming each rank whose op (a CollectiveOp
// name) differs from `mine`, or OK. An empty name (a rank that publishes
// none) is not compared.
struct RankOp {
  int rank;
  std::string name;
};
absl::Status CheckSameOp(absl::string_view mine,
                         absl::Span<const RankOp> ranks);

// Send and Recv: `op` names the call ("Send to rank 3 with tag 7").
absl::Status CheckPointToPoint(const GroupShape& group, absl::string_view op,
                               const BufferView& buffer, int peer);

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_OP_CHECKS_H_
