// NcclProcessGroup: the ProcessGroup backend over NCCL, for buffers in GPU
// memory. Every BufferView's data is a device pointer on this rank's device
// (device()).
//
// Bootstrap. Ranks meet through a cohort::Store, the same that Gloo's
// bootstrap uses, under options.store_prefix: the root rank publishes its
// ncclUniqueId under a key fresh for each communicator (comm/0 for the
// group's own, counting up), every rank reads it and starts NCCL's init,
// nonblocking, and polls it. Above ranks_per_root ranks several roots each
// publish an id (ncclCommInitRankScalable; nccl_bootstrap.h says which
// ranks). Creating the group is bounded by ONE deadline, options.group.
// timeout from the call: the store's wait for the ids and NCCL's init
// share it. A root that never published its id is named (DEADLINE_EXCEEDED
// "... was not published by rank 0 (root 0 of 1, key ...)"), and an init
// that does not complete by the deadline is aborted with DEADLINE_EXCEEDED
// naming the ranks that never reached it. Subgroups come from Split
// (ncclCommSplit), which needs no store.
//
// Ops. The op engine (op_engine.h) checks, queues and verifies the ops as
// for every backend (with host_memory off: NCCL does the arithmetic on the
// device). The group owns one CUDA stream per communicator; each op's body
// enqueues NCCL's calls on it, records a CUDA event and polls the event, so
// a Work completes once its op has run on the GPU, and MakeStreamWait lets
// a caller's stream wait for the op instead, without blocking the host.
// Ops run one at a time, in issue order (an NCCL communicator matches calls
// by their order): options.group.threads is ignored.
//  - AllReduce, Broadcast, Reduce, AllGather and ReduceScatter are NCCL's
//    own collectives; AVG is ncclAvg. NCCL reduces f16 and bf16 in their
//    own precision on the device (process_group.h's f32 accumulation is the
//    host backends'), and AVG of integers is NCCL's integer average.
//  - Gather, Scatter, AllGatherV, AllToAll and AllToAllV are grouped sends
//    and receives (ncclGroupStart/End) plus a device copy of the rank's own
//    block; Barrier is a one-element all-reduce.
//  - Send and Recv are enqueued on the same stream when issued. NCCL has no
//    tags: messages between two ranks match in issue order, and a Send and
//    its Recv must stand at the same place among the collectives on both
//    ranks (the stream runs them in order). The tag is only named in errors.
//  - verify_ops costs one small all-gather on the device per collective
//    (128 bytes per rank, through a device buffer).
//
// Errors. A watchdog thread per communicator (watched_comm.h) polls NCCL's
// asynchronous error and the deadline of the op in flight (the group's
// timeout from when the op starts), and aborts the communicator
// (ncclCommAbort; communicators are nonblocking, so abort never waits on a
// peer) on an asynchronous error (UNAVAILABLE), an expired deadline
// (DEADLINE_EXCEEDED) or a failed call. The op in flight then fails with
// that status, named by the op and rank ("AllReduce SUM of 4 f32 on rank 1
// of 2: ..."), and the group is broken as a Gloo group is: every later op
// ends with FAILED_PRECONDITION naming the first failure. The status also
// goes to options.error_reporter, e.g. to cohortd's membership
// (GroupMember::ReportError), so that other nodes learn of it without
// waiting out their own timeout.
#ifndef COHORT_WORKER_COLLECTIVE_NCCL_NCCL_PROCESS_GROUP_H_
#define COHORT_WORKER_COLLECTIVE_NCCL_NCCL_PROCESS_GROUP_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "client/store.h"
#include "worker/collective/collective_op.h"
#include "worker/collective/nccl/nccl_api.h"
#include "worker/collective/nccl/watched_comm.h"
#include "worker/collective/op_engine.h"
#include "worker/collective/process_group.h"

namespace cohort {

struct NcclOptions {
  // timeout: bounds creating the group (store and NCCL init together) and
  // each op from its start. threads is ignored (always 1, see above).
  ProcessGroupOptions group;
  // Where the group's bootstrap keys live in the store; each group (each
  // creation) its own, as for Gloo.
  std::string store_prefix = "nccl";
  // The CUDA device of this rank. -1: $LOCAL_RANK if set (cohortrun and
  // torchrun set it), else the rank, modulo the devices visible.
  int device = -1;
  // Ranks per bootstrap root: above it, NCCL's scalable init with several
  // roots (nccl_bootstrap.h).
  int ranks_per_root = 128;
  // How often the watchdog polls each communicator.
  absl::Duration watchdog_interval = absl::Milliseconds(100);
  // Called once per communicator with the status that broke it (prefixed
  // with the group, communicator and rank), on the watchdog's or an op's
  // thread; keep it short. Empty: not reported beyond the ops' statuses.
  std::function<void(const absl::Status&)> error_reporter;
  // The NCCL and CUDA calls. Null: CudaNcclApi() where the group is made
  // by CreateNcclProcessGroup (nccl_backend.h); NcclProcessGroup::Create
  // requires one (tests pass fake_nccl_api.h's).
  std::shared_ptr<NcclApi> api;
};

class NcclProcessGroup final : public ProcessGroup {
 public:
  // Creates rank `rank` of `size` (see the class comment). FAILED_
  // PRECONDITION "no CUDA device visible: ..." without a GPU;
  // INVALID_ARGUMENT for a bad rank, size, device or options;
  // DEADLINE_EXCEEDED naming the missing ranks; NCCL's error otherwise.
  static absl::StatusOr<std::unique_ptr<NcclProcessGroup>> Create(
      std::shared_ptr<Store> store, int rank, int size,
      const NcclOptions& options);

  // Waits for the ops already issued to end (each bounded by the timeout),
  // then stops the watchdog and destroys the communicator.
  ~NcclProcessGroup() override;

  // Splits this group (ncclCommSplit), as MPI_Comm_split: every rank calls
  // it, in the same place among its ops; ranks passing the same `color`
  // form a new group, numbered by `key` and then by rank here. A negative
  // color joins none: OK with null. Blocks until the new communicator is
  // ready (bounded by the timeout). The new group has this one's options.
  absl::StatusOr<std::unique_ptr<NcclProcessGroup>> Split(int color, int key);

  int rank() const override { return rank_; }
  std::shared_ptr<const FlightRecorder> flight_recorder() const override {
    return engine_.flight_recorder();
  }
  int size() const override { return size_; }
  // The CUDA device every buffer of this group lives on.
  int device() const { return device_; }
  // The NCCL and CUDA calls this group makes (for device memory: Alloc,
  // Free).
  NcclApi& api() const { return *options_.api; }
  // Device memory on device(); its copies and kernels run on a stream of
  // their own (see Memory).
  DeviceMemory* device_memory() override { return &memory_; }

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
  std::shared_ptr<Work> ReduceScatter(BufferView input, BufferView output,
                                      ReduceOp op) override;
  std::shared_ptr<Work> Barrier() override;
  std::shared_ptr<Work> Send(BufferView buffer, int dst_rank,
                             uint32_t tag) override;
  std::shared_ptr<Work> Recv(BufferView buffer, int src_rank,
                             uint32_t tag) override;

  // Makes `stream` (a cudaStream_t) wait for the collective of `work`
  // without blocking the host until it completes: blocks only until the op
  // has been enqueued on the group's stream (the ops before it have been,
  // and with verify_ops every rank has issued it), at most the group's
  // timeout. OK at once if `work` has completed OK
  // (its output is ready); its error if it failed. INVALID_ARGUMENT for a
  // Work that is not a pending collective of this group (Send and Recv:
  // wait for their Work).
  absl::Status MakeStreamWait(const std::shared_ptr<Work>& work, void* stream);

  // Makes the group's stream wait for what the caller has enqueued on
  // `stream` so far (e.g. the kernel that wrote a buffer it is about to
  // reduce), without blocking the host. Applies to the ops issued after.
  absl::Status WaitForStream(void* stream);

  // Copies `bytes` on the group's stream, in order with its ops, and waits
  // for the copy (host and device memory alike). device_memory()'s copies
  // instead run on a stream of their own, not behind the ops.
  absl::Status Copy(void* dst, const void* src, size_t bytes, CopyKind kind);
  absl::Status Memset(void* dst, int value, size_t bytes);

 private:
  // An op's CUDA event, once the body has recorded it (MakeStreamWait).
  struct OpEvent {
    absl::Mutex mu;
    std::shared_ptr<NcclEvent> event ABSL_GUARDED_BY(mu);
    bool finished ABSL_GUARDED_BY(mu) = false;
  };
  // What a body enqueues on the communicator (one or more NCCL calls).
  using Enqueue = std::function<absl::Status(NcclCommunicator& comm,
                                             const CollectiveOp& op)>;

  NcclProcessGroup(std::shared_ptr<Store> store, int rank, int size, int device,
                   const NcclOptions& options, std::string comm_name,
                   std::unique_ptr<WatchedComm> comm);

  // "nccl process group 'P' (communicator C), rank R of N".
  static std::string Where(const NcclOptions& options,
                           absl::string_view comm_name, int rank, int size);
  static WatchdogOptions Watchdog(const NcclOptions& options);

  // Every collective: the engine runs a body that enqueues `enqueue`,
  // records an event (published for MakeStreamWait) and awaits it under a
  // watch of the op's deadline. Empty ops enqueue nothing.
  std::shared_ptr<Work> Submit(CollectiveOp op, Enqueue enqueue);
  // Runs `enqueue` and an event under a watch, and awaits the event.
  absl::Status RunOnStream(
      absl::string_view name,
      absl::FunctionRef<absl::Status(NcclCommunicator&)> enqueue,
      OpEvent* published);
  // A device buffer of at least `bytes` for verify_ops and Barrier.
  absl::StatusOr<void*> Scratch(size_t bytes);

  class Transport;
  class Transfer;

  // DeviceMemory over the api and a DeviceStream of the group's own (not
  // the communicator's): its copies, zeroing and kernels do not queue
  // behind collectives in flight, which DDP and FSDP never let touch the
  // same buffers. Each call enqueues and synchronizes that stream.
  class Memory final : public DeviceMemory {
   public:
    explicit Memory(NcclProcessGroup& group) : group_(group) {}
    absl::StatusOr<void*> Allocate(size_t bytes) override {
      return group_.api().Alloc(group_.device_, bytes);
    }
    void Free(void* data) override { group_.api().Free(data); }
    absl::Status CopyToDevice(void* dst, const void* src,
                              size_t bytes) override {
      return Copy(dst, src, bytes, CopyKind::kHostToDevice);
    }
    absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
      return Copy(dst, src, bytes, CopyKind::kDeviceToHost);
    }
    absl::Status CopyOnDevice(void* dst, const void* src,
                              size_t bytes) override {
      return Copy(dst, src, bytes, CopyKind::kDeviceToDevice);
    }
    absl::Status Zero(void* data, size_t bytes) override;
    absl::Status AddF32(float* dst, const float* src, size_t count) override;
    absl::Status Convert(BufferView dst, BufferView src, float scale) override;
    absl::Status Update(const ElementwiseUpdate& update) override;

   private:
    absl::Status Copy(void* dst, const void* src, size_t bytes, CopyKind kind);
    // Runs `enqueue` on the memory stream (created on first use) and
    // waits for it; errors name `what` and the group.
    absl::Status Run(absl::string_view what,
                     absl::FunctionRef<absl::Status(DeviceStream&)> enqueue);

    NcclProcessGroup& group_;
    absl::Mutex mu_;
    std::unique_ptr<DeviceStream> stream_ ABSL_GUARDED_BY(mu_);
  };

  const std::shared_ptr<Store> store_;
  const int rank_;
  const int size_;
  const int device_;
  const NcclOptions options_;
  const std::string comm_name_;
  const std::unique_ptr<WatchedComm> comm_;
  const std::unique_ptr<OpEngine::Transport> transport_;
  Memory memory_{*this};

  absl::Mutex mu_;
  int splits_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<const Work*, std::shared_ptr<OpEvent>> events_
      ABSL_GUARDED_BY(mu_);
  // Device memory freed when the group is destroyed, after the engine.
  struct DeviceBuffer {
    NcclApi* api = nullptr;
    void* data = nullptr;
    size_t bytes = 0;
    ~DeviceBuffer() {
      if (data != nullptr) api->Free(data);
    }
  };
  // Scratch for verify_ops and Barrier (engine thread only).
  DeviceBuffer scratch_;

  // Last, so that it is destroyed first: its thread runs the bodies.
  OpEngine engine_;
};

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_NCCL_NCCL_PROCESS_GROUP_H_
