// GlooProcessGroup: the ProcessGroup backend over Gloo's TCP transport, for
// CPU buffers.
//
// Ranks find each other through a cohort::Store: each publishes its
// listening address under the group's store prefix and connects to every
// other rank (gloo's full mesh). Collectives run on the group's own threads
// in issue order, each with a tag derived from its position in that order,
// so that up to `threads` consecutive ops can be in flight at once without
// their messages mixing.
//
// Reductions use reduce.h's kernels. f16 and bf16 buffers are widened to
// f32 for the whole collective and rounded once at the end, so the result
// does not depend on the order in which the algorithm combined the ranks;
// the price is twice the bytes on the wire for those dtypes.
#ifndef COHORT_WORKER_COLLECTIVE_GLOO_GLOO_PROCESS_GROUP_H_
#define COHORT_WORKER_COLLECTIVE_GLOO_GLOO_PROCESS_GROUP_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "client/store.h"
#include "gloo/context.h"
#include "gloo/transport/unbound_buffer.h"
#include "worker/collective/op_checks.h"
#include "worker/collective/process_group.h"

namespace cohort {

struct GlooOptions {
  ProcessGroupOptions group;
  // Where this group's rendezvous keys live in the store. Every rank of a
  // group uses the same prefix, and each group (each creation) its own: a
  // rank that finds another incarnation's keys would dial stale addresses.
  std::string store_prefix = "gloo";
  // The address this rank listens on and publishes to its peers: a host
  // name or an IP. Empty: the address of this machine's host name.
  std::string bind_address;
  // A network interface ("eth0") whose address to use instead; overrides
  // bind_address when set.
  std::string interface;
};

class GlooProcessGroup final : public ProcessGroup {
 public:
  // Connects to the other `size` - 1 ranks through `store`; blocks until
  // all have arrived, or options.group.timeout passes (DEADLINE_EXCEEDED
  // naming the missing keys, hence ranks). INVALID_ARGUMENT for a rank
  // outside [0, size) or bad options. Sets SIGPIPE to be ignored if it has
  // its default action (as Python does), so that a dead peer fails the op
  // instead of killing this process.
  static absl::StatusOr<std::unique_ptr<GlooProcessGroup>> Create(
      std::shared_ptr<Store> store, int rank, int size,
      const GlooOptions& options);

  // Waits for the ops already issued to end (each is bounded by the
  // timeout), then closes the connections.
  ~GlooProcessGroup() override;

  // A new group of some of this group's ranks, under its own store prefix,
  // with this group's options. `ranks` are distinct ranks of this group; in
  // the new group they are numbered in increasing order. Only those ranks
  // call it (it does not involve the others), and they create groups of the
  // same rank list in the same order. Blocks like Create.
  absl::StatusOr<std::unique_ptr<GlooProcessGroup>> NewGroup(
      absl::Span<const int> ranks);

  // Splits this group, as MPI_Comm_split: every rank calls it (a collective
  // on this group), and the ranks that pass the same `color` form a new
  // group, numbered by `key` and then by rank in this group. A negative
  // color joins no group: OK with a null group.
  absl::StatusOr<std::unique_ptr<GlooProcessGroup>> Split(int color, int key);

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  std::shared_ptr<Work> Broadcast(BufferView buffer, int root) override;
  std::shared_ptr<Work> AllReduce(BufferView buffer, ReduceOp op) override;
  std::shared_ptr<Work> Reduce(BufferView buffer, int root,
                               ReduceOp op) override;
  std::shared_ptr<Work> AllGather(BufferView input, BufferView output) override;
  std::shared_ptr<Work> AllGatherV(BufferView input, BufferView output,
                                   absl::Span<const size_t> counts) override;
  std::shared_ptr<Work> Gather(BufferView input, BufferView output,
                               int root) override;
  std::shared_ptr<Work> Scatter(BufferView input, BufferView output,
                                int root) override;
  std::shared_ptr<Work> AllToAll(BufferView input, BufferView output) override;
  std::shared_ptr<Work> AllToAllV(
      BufferView input, absl::Span<const size_t> send_counts, BufferView output,
      absl::Span<const size_t> recv_counts) override;
  // A ring over gloo's point-to-point buffers: each rank sends and receives
  // (size - 1) / size of the input, the least any algorithm can.
  std::shared_ptr<Work> ReduceScatter(BufferView input, BufferView output,
                                      ReduceOp op) override;
  std::shared_ptr<Work> Barrier() override;
  std::shared_ptr<Work> Send(BufferView buffer, int dst_rank,
                             uint32_t tag) override;
  std::shared_ptr<Work> Recv(BufferView buffer, int src_rank,
                             uint32_t tag) override;

 private:
  // A collective's body; `tag` is the same on every rank. Throws what gloo
  // throws; Run turns that into a status.
  using Body = std::function<void(uint32_t tag)>;

  struct QueuedOp {
    // Says what the op does in the words every rank must agree on, e.g.
    // "AllReduce SUM of 4 f32": the op's errors start with it.
    std::string name;
    uint32_t tag;
    Body body;
    std::shared_ptr<Work> work;
  };

  // A posted Send or Recv that the waiter thread completes.
  struct PostedTransfer {
    std::string name;
    bool is_send;
    std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
    std::shared_ptr<Work> work;
  };

  GlooProcessGroup(std::shared_ptr<Store> store, int rank, int size,
                   const GlooOptions& options,
                   std::shared_ptr<gloo::Context> context);

  // Creates the group of `rank` of `size` under this group's prefix
  // extended by `suffix`.
  absl::StatusOr<std::unique_ptr<GlooProcessGroup>> CreateChild(
      absl::string_view suffix, int rank, int size);

  std::shared_ptr<Work> Enqueue(std::string name, Body body);
  std::shared_ptr<Work> Post(std::string name, BufferView buffer, int peer,
                             uint32_t tag, bool is_send);
  // Every gloo collective's options take the op's tag and the group's
  // timeout.
  template <typename Options>
  void SetTagAndTimeout(Options& opts, uint32_t tag) const {
    opts.setTag(tag);
    opts.setTimeout(std::chrono::milliseconds(
        absl::ToInt64Milliseconds(options_.group.timeout)));
  }

  GroupShape shape() const { return GroupShape{rank_, size_}; }
  void RunOps();
  // INVALID_ARGUMENT naming the ranks that issued a different op than
  // this one in this position (see ProcessGroupOptions::verify_ops).
  absl::Status CheckSameOpEverywhere(const QueuedOp& op);
  void RunTransfers();
  // Runs `fn`, turning what it throws into a status that names `name`.
  absl::Status Run(absl::string_view name, const std::function<void()>& fn);
  // Completes `work` with `status`; a failure that is not about arguments
  // breaks the group (see process_group.h).
  void Finish(const std::shared_ptr<Work>& work, absl::Status status);
  absl::Status BrokenStatus() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void DoAllReduce(BufferView buffer, ReduceOp op, uint32_t tag);
  void DoReduce(BufferView buffer, int root, ReduceOp op, uint32_t tag);
  void DoReduceScatter(BufferView input, BufferView output, ReduceOp op,
                       uint32_t tag);

  const std::shared_ptr<Store> store_;  // Without this group's prefix.
  const int rank_;
  const int size_;
  const GlooOptions options_;
  const std::shared_ptr<gloo::Context> context_;

  mutable absl::Mutex mu_;
  uint32_t next_tag_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // The first failure that broke the group, or OK.
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  std::deque<QueuedOp> ops_ ABSL_GUARDED_BY(mu_);
  std::deque<PostedTransfer> transfers_ ABSL_GUARDED_BY(mu_);
  // Groups made so far by NewGroup, per rank list, and by Split: they make
  // each child's store prefix unique.
  std::map<std::vector<int>, int> new_groups_ ABSL_GUARDED_BY(mu_);
  int splits_ ABSL_GUARDED_BY(mu_) = 0;

  std::vector<std::thread> op_threads_;
  std::thread transfer_thread_;
};

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_GLOO_GLOO_PROCESS_GROUP_H_
