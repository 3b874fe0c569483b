// GlooProcessGroup: the ProcessGroup backend over Gloo's TCP transport, for
// CPU buffers.
//
// Ranks find each other through a cohort::Store: each publishes its
// listening address under the group's store prefix and connects to every
// other rank (gloo's full mesh). The op engine (op_engine.h) queues the
// ops, tags them, verifies them across ranks, times them out and keeps the
// broken state; this class supplies the op bodies (gloo's collectives and
// gloo_ring.h's algorithms) and gloo's point-to-point buffers.
//
// Shared memory. At creation the ranks publish their host ids in the store.
// Ranks that share a host (and shm.enabled is on) map one segment
// (shm/shm_group.h, Gloo's transport among the ranks of a host):
//  - a group on one host runs every collective over it, one op at a time in
//    issue order (they are bound by memory bandwidth, so running two at once
//    would only split it), and verify_ops costs no exchange: the check rides
//    in the segment (OpEngine::OpRun);
//  - a group over several hosts runs AllReduce hierarchically: a reduce to
//    each host's first rank over shared memory, an all-reduce among those
//    leaders over TCP, and a broadcast from the leader over shared memory;
//    and Broadcast too: over shared memory on the root's host, among the
//    leaders over TCP from the root host's leader, then from each leader
//    over shared memory, so that the data crosses to each host once rather
//    than once per rank there. Its other collectives use TCP, and
//    verify_ops an exchange over TCP.
//
// Reductions use reduce.h's kernels. The engine widens f16 and bf16 buffers
// to f32 for the whole collective and rounds once at the end, so the result
// does not depend on the order in which the algorithm combined the ranks;
// the price is twice the bytes on the wire for those dtypes.
#ifndef COHORT_WORKER_COLLECTIVE_GLOO_GLOO_PROCESS_GROUP_H_
#define COHORT_WORKER_COLLECTIVE_GLOO_GLOO_PROCESS_GROUP_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "client/store.h"
#include "gloo/context.h"
#include "gloo/transport/device.h"
#include "worker/collective/collective_op.h"
#include "worker/collective/gloo/shm/shm_group.h"
#include "worker/collective/op_engine.h"
#include "worker/collective/process_group.h"

namespace cohort {

// Shared memory among the ranks of one host (GlooOptions::shm).
struct GlooShmOptions {
  // Collectives among ranks of one host run over shared memory
  // (shm/shm_group.h) instead of loopback TCP: all of them when the whole
  // group is on one host, and AllReduce and Broadcast hierarchically
  // otherwise (see the class comment). Send and Recv always use TCP.
  bool enabled = true;
  // Ranks with the same host id share memory. Empty: $COHORT_HOST_ID if
  // set, else the host name and the kernel's boot id. Tests set it to
  // simulate several hosts on one machine.
  std::string host_id;
  // ShmGroupOptions::slot_bytes.
  size_t slot_bytes = size_t{1} << 20;
};

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
  // Shared memory with the ranks of the same host.
  GlooShmOptions shm;
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
  ~GlooProcessGroup() override = default;

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
  std::shared_ptr<const FlightRecorder> flight_recorder() const override {
    return engine_.flight_recorder();
  }
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
  // An op body as gloo runs it: throws what gloo throws (Submit turns that
  // into a status).
  using Body = std::function<void(const CollectiveOp& op, uint32_t tag)>;

  // Which ranks share memory with this one, and how ops use it.
  struct Locality {
    std::unique_ptr<ShmGroup> shm;  // Null: no same-host peer (or off).
    bool whole_group = false;       // Every rank of the group is local.
    // Several hosts, and at least one has several ranks: AllReduce is
    // hierarchical.
    bool hierarchical = false;
    // With several hosts: this host's leader's context among the leaders
    // (null on other ranks, and when there is one host).
    std::shared_ptr<gloo::Context> leaders;
    // Every rank's host id, by rank (empty when shared memory is off), and
    // each host's first rank, in order (the leaders' ranks, when
    // `leaders` is set).
    std::vector<std::string> hosts;
    std::vector<int> leader_ranks;
  };

  GlooProcessGroup(std::shared_ptr<Store> store, int rank, int size,
                   const GlooOptions& options,
                   std::shared_ptr<gloo::Context> context, Locality locality);

  // Publishes this rank's host id under `store` (the group's prefix) and
  // sets up shared memory with the ranks of the same host.
  static absl::StatusOr<Locality> FindLocality(
      const std::shared_ptr<Store>& store, int rank, int size,
      const GlooOptions& options,
      std::shared_ptr<gloo::transport::Device> device);
  static OpEngineOptions EngineOptions(const ProcessGroupOptions& group,
                                       const Locality& locality);

  // The hierarchical AllReduce and Broadcast bodies (see the class
  // comment).
  absl::Status HierarchicalAllReduce(const CollectiveOp& op, uint32_t tag);
  absl::Status HierarchicalBroadcast(const CollectiveOp& op, uint32_t tag);

  // Creates the group of `rank` of `size` under this group's prefix
  // extended by `suffix`.
  absl::StatusOr<std::unique_ptr<GlooProcessGroup>> CreateChild(
      absl::string_view suffix, int rank, int size);

  // A body that carries the op's check itself (gloo_ring.h's Direct
  // functions): it gets the engine's OpRun.
  using CheckedBody =
      std::function<void(const CollectiveOp& op, const OpEngine::OpRun& run)>;

  // Every op: the engine runs `body` for `op` (or shared memory runs the op,
  // see the class comment).
  std::shared_ptr<Work> Submit(CollectiveOp op, Body body);
  std::shared_ptr<Work> SubmitChecked(CollectiveOp op, CheckedBody body);

  // Names peers for an error: `ranks` (of this group, or of the leaders'
  // context when `leaders`) grouped by host, "host 'b' (ranks 2, 3)"; with
  // no ranks (gloo did not say which), this rank's host and the others'
  // ("" when the group is on one host or the hosts are unknown).
  std::string Peers(const std::vector<int>& ranks, bool leaders = false) const;
  // Runs a gloo call of this group (of the leaders' context when
  // `leaders`): what it throws becomes a status naming the peers.
  absl::Status Call(const std::function<void()>& fn,
                    bool leaders = false) const;

  std::chrono::milliseconds timeout() const;
  // Every gloo collective's options take the op's tag and the group's
  // timeout.
  template <typename Options>
  void SetTagAndTimeout(Options& opts, uint32_t tag) const {
    opts.setTag(tag);
    opts.setTimeout(timeout());
  }

  const std::shared_ptr<Store> store_;  // Without this group's prefix.
  const int rank_;
  const int size_;
  const GlooOptions options_;
  const std::shared_ptr<gloo::Context> context_;
  const std::unique_ptr<OpEngine::Transport> transport_;
  const Locality locality_;

  absl::Mutex mu_;
  // Groups made so far by NewGroup, per rank list, and by Split: they make
  // each child's store prefix unique.
  std::map<std::vector<int>, int> new_groups_ ABSL_GUARDED_BY(mu_);
  int splits_ ABSL_GUARDED_BY(mu_) = 0;

  // Last, so that it is destroyed first: its threads run the bodies, which
  // use the members above.
  OpEngine engine_;
};

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_GLOO_GLOO_PROCESS_GROUP_H_
