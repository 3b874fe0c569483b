#include "worker/collective/nccl/cuda_nccl_api.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "worker/collective/elementwise.h"
#include "worker/collective/nccl/cuda_kernels.h"
#include "worker/collective/nccl/nccl_types.h"

namespace cohort {
namespace {

static_assert(sizeof(ncclUniqueId) == kNcclUniqueIdBytes,
              "NcclUniqueId must hold an ncclUniqueId");

// How long a healthy communicator's destruction waits for ncclCommFinalize
// (which flushes its last ops) before aborting it instead.
constexpr absl::Duration kFinalizeTimeout = absl::Seconds(10);

absl::Status FromCuda(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(error),
                                          " (", cudaGetErrorString(error),
                                          ")"));
}

// A nonblocking communicator's config: calls return ncclInProgress instead
// of blocking, so that nothing waits on a peer where it cannot be aborted.
ncclConfig_t NonblockingConfig() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

class CudaEvent final : public NcclEvent {
 public:
  explicit CudaEvent(cudaEvent_t event) : event_(event) {}
  ~CudaEvent() override { cudaEventDestroy(event_); }

  absl::StatusOr<bool> Query() override {
    const cudaError_t error = cudaEventQuery(event_);
    if (error == cudaSuccess) return true;
    if (error == cudaErrorNotReady) return false;
    return FromCuda(error, "cudaEventQuery");
  }

  absl::Status MakeStreamWait(void* stream) override {
    return FromCuda(
        cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), event_, 0),
        "cudaStreamWaitEvent");
  }

 private:
  const cudaEvent_t event_;
};

// cudaMemcpyAsync / cudaMemsetAsync on `stream` of `device`.
absl::Status CopyOn(int device, cudaStream_t stream, void* dst, const void* src,
                    size_t bytes, CopyKind kind) {
  cudaSetDevice(device);
  cudaMemcpyKind cuda_kind = cudaMemcpyDeviceToDevice;
  if (kind == CopyKind::kHostToDevice) cuda_kind = cudaMemcpyHostToDevice;
  if (kind == CopyKind::kDeviceToHost) cuda_kind = cudaMemcpyDeviceToHost;
  return FromCuda(cudaMemcpyAsync(dst, src, bytes, cuda_kind, stream),
                  "cudaMemcpyAsync");
}

absl::Status MemsetOn(int device, cudaStream_t stream, void* dst, int value,
                      size_t bytes) {
  cudaSetDevice(device);
  return FromCuda(cudaMemsetAsync(dst, value, bytes, stream),
                  "cudaMemsetAsync");
}

absl::StatusOr<cudaEvent_t> NewEvent() {
  cudaEvent_t event;
  absl::Status created =
      FromCuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
               "cudaEventCreateWithFlags");
  if (!created.ok()) return created;
  return event;
}

absl::StatusOr<cuda_kernels::FloatKind> Kind(Dtype dtype) {
  switch (dtype) {
    case Dtype::kF32:
      return cuda_kernels::FloatKind::kF32;
    case Dtype::kF16:
      return cuda_kernels::FloatKind::kF16;
    case Dtype::kBF16:
      return cuda_kernels::FloatKind::kBF16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("the Convert kernel takes f32, f16 and bf16, not ",
                       DtypeName(dtype)));
  }
}

class CudaCommunicator final : public NcclCommunicator {
 public:
  CudaCommunicator(int device, ncclComm_t comm, cudaStream_t stream)
      : device_(device), comm_(comm), stream_(stream) {}

  // The child of a nonblocking ncclCommSplit of `parent`. NCCL finishes
  // the split in the background and only then writes the new handle (seen
  // with NCCL 2.28 on an H200: until then it is NULL), so Split hands it
  // &comm_ to write, and Ready() polls the parent until the split is done.
  CudaCommunicator(int device, ncclComm_t parent, cudaStream_t stream,
                   bool /*split*/)
      : device_(device), comm_(nullptr), stream_(stream), parent_(parent) {}

  ~CudaCommunicator() override {
    cudaSetDevice(device_);
    if (comm_ == nullptr) {
      // A split that never completed: nothing of the child's to destroy
      // (its parent's abort or destruction ends the split).
      cudaStreamDestroy(stream_);
      return;
    }
    if (!aborted_) {
      bool finalized =
          FromNcclResult(ncclCommFinalize(comm_), "ncclCommFinalize").ok();
      const absl::Time give_up = absl::Now() + kFinalizeTimeout;
      while (finalized) {
        absl::StatusOr<bool> ready = Ready();
        if (!ready.ok() || absl::Now() > give_up) finalized = false;
        if (!ready.ok() || *ready) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (finalized) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    cudaStreamDestroy(stream_);
  }

  absl::StatusOr<bool> Ready() override {
    absl::StatusOr<bool> splitting = SplitInProgress();
    if (!splitting.ok() || *splitting) {
      return splitting.ok() ? absl::StatusOr<bool>(false) : splitting.status();
    }
    ncclResult_t state = ncclSuccess;
    absl::Status polled = FromNcclResult(ncclCommGetAsyncError(comm_, &state),
                                         "ncclCommGetAsyncError", comm_);
    if (!polled.ok()) return polled;
    if (state == ncclInProgress) return false;
    absl::Status error =
        FromNcclResult(state, "asynchronous NCCL error", comm_);
    if (!error.ok()) return error;
    return true;
  }

  void Abort() override {
    if (aborted_) return;
    aborted_ = true;
    cudaSetDevice(device_);
    // A split still in progress has no handle of its own yet: abort the
    // parent, whose operation it is (NCCL takes no other call on it until
    // the split ends, so nothing else can end it).
    absl::StatusOr<bool> splitting = SplitInProgress();
    if (splitting.ok() && *splitting) {
      ncclCommAbort(parent_);
      parent_ = nullptr;
      return;
    }
    if (comm_ != nullptr) ncclCommAbort(comm_);
  }

  absl::Status GroupStart() override {
    return FromNcclResult(ncclGroupStart(), "ncclGroupStart", comm_);
  }
  absl::Status GroupEnd() override {
    return FromNcclResult(ncclGroupEnd(), "ncclGroupEnd", comm_);
  }

  absl::Status AllReduce(const void* send, void* recv, size_t count,
                         Dtype dtype, ReduceOp op) override {
    return Enqueue("ncclAllReduce", dtype, op, [&](auto type, auto redop) {
      return ncclAllReduce(send, recv, count, type, redop, comm_, stream_);
    });
  }

  absl::Status Broadcast(const void* send, void* recv, size_t count,
                         Dtype dtype, int root) override {
    return Enqueue(
        "ncclBroadcast", dtype, ReduceOp::kSum, [&](auto type, auto) {
          return ncclBroadcast(send, recv, count, type, root, comm_, stream_);
        });
  }

  absl::Status Reduce(const void* send, void* recv, size_t count, Dtype dtype,
                      ReduceOp op, int root) override {
    return Enqueue("ncclReduce", dtype, op, [&](auto type, auto redop) {
      return ncclReduce(send, recv, count, type, redop, root, comm_, stream_);
    });
  }

  absl::Status AllGather(const void* send, void* recv, size_t count,
                         Dtype dtype) override {
    return Enqueue(
        "ncclAllGather", dtype, ReduceOp::kSum, [&](auto type, auto) {
          return ncclAllGather(send, recv, count, type, comm_, stream_);
        });
  }

  absl::Status ReduceScatter(const void* send, void* recv, size_t count,
                             Dtype dtype, ReduceOp op) override {
    return Enqueue("ncclReduceScatter", dtype, op, [&](auto type, auto redop) {
      return ncclReduceScatter(send, recv, count, type, redop, comm_, stream_);
    });
  }

  absl::Status Send(const void* send, size_t count, Dtype dtype,
                    int peer) override {
    return Enqueue("ncclSend", dtype, ReduceOp::kSum, [&](auto type, auto) {
      return ncclSend(send, count, type, peer, comm_, stream_);
    });
  }

  absl::Status Recv(void* recv, size_t count, Dtype dtype, int peer) override {
    return Enqueue("ncclRecv", dtype, ReduceOp::kSum, [&](auto type, auto) {
      return ncclRecv(recv, count, type, peer, comm_, stream_);
    });
  }

  absl::StatusOr<std::unique_ptr<NcclCommunicator>> Split(int color,
                                                          int key) override {
    cudaSetDevice(device_);
    ncclConfig_t config = NonblockingConfig();
    if (color < 0) {
      // NCCL writes no handle (NULL) for a rank outside every color, into
      // storage that must outlive the call; the parent's Ready() tells
      // when the split is done.
      absl::Status split = FromNcclResult(
          ncclCommSplit(comm_, NCCL_SPLIT_NOCOLOR, key, &no_color_, &config),
          "ncclCommSplit", comm_);
      if (!split.ok()) return split;
      return std::unique_ptr<NcclCommunicator>();
    }
    cudaStream_t stream;
    absl::Status created =
        FromCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                 "cudaStreamCreateWithFlags");
    if (!created.ok()) return created;
    // The child owns the handle's storage, which NCCL writes when the
    // split completes, after this call has returned.
    auto child = std::make_unique<CudaCommunicator>(device_, comm_, stream,
                                                    /*split=*/true);
    absl::Status split = FromNcclResult(
        ncclCommSplit(comm_, color, key, &child->comm_, &config),
        "ncclCommSplit", comm_);
    if (!split.ok()) {
      child->parent_ = nullptr;  // Nothing in progress to wait for.
      return split;
    }
    return std::unique_ptr<NcclCommunicator>(std::move(child));
  }

  absl::StatusOr<std::unique_ptr<NcclEvent>> RecordEvent() override {
    cudaSetDevice(device_);
    absl::StatusOr<cudaEvent_t> event = NewEvent();
    if (!event.ok()) return event.status();
    auto wrapped = std::make_unique<CudaEvent>(*event);
    absl::Status recorded =
        FromCuda(cudaEventRecord(*event, stream_), "cudaEventRecord");
    if (!recorded.ok()) return recorded;
    return std::unique_ptr<NcclEvent>(std::move(wrapped));
  }

  absl::Status WaitForStream(void* stream) override {
    cudaSetDevice(device_);
    absl::StatusOr<cudaEvent_t> event = NewEvent();
    if (!event.ok()) return event.status();
    CudaEvent owner(*event);
    absl::Status recorded =
        FromCuda(cudaEventRecord(*event, static_cast<cudaStream_t>(stream)),
                 "cudaEventRecord on the caller's stream");
    if (!recorded.ok()) return recorded;
    // Destroying the event after the wait is enqueued is allowed: CUDA
    // releases it once the wait has been satisfied.
    return owner.MakeStreamWait(stream_);
  }

  absl::Status Copy(void* dst, const void* src, size_t bytes,
                    CopyKind kind) override {
    return CopyOn(device_, stream_, dst, src, bytes, kind);
  }

  absl::Status Memset(void* dst, int value, size_t bytes) override {
    return MemsetOn(device_, stream_, dst, value, bytes);
  }

 private:
  // Sets the device (the calling thread's current device may be another),
  // maps the dtype and op, and makes the call.
  template <typename Call>
  absl::Status Enqueue(absl::string_view what, Dtype dtype, ReduceOp op,
                       Call call) {
    absl::StatusOr<ncclDataType_t> type = ToNcclDataType(dtype);
    if (!type.ok()) return type.status();
    absl::StatusOr<ncclRedOp_t> redop = ToNcclRedOp(op);
    if (!redop.ok()) return redop.status();
    absl::Status device = FromCuda(cudaSetDevice(device_), "cudaSetDevice");
    if (!device.ok()) return device;
    return FromNcclResult(call(*type, *redop), what, comm_);
  }

  // For a child still being split (parent_ set): true while the parent
  // reports the split in progress; once it completed, forgets the parent
  // and returns false (an error if it failed, or made no handle).
  absl::StatusOr<bool> SplitInProgress() {
    if (parent_ == nullptr) return false;
    ncclResult_t state = ncclSuccess;
    absl::Status polled =
        FromNcclResult(ncclCommGetAsyncError(parent_, &state),
                       "ncclCommGetAsyncError of the split's parent", parent_);
    if (!polled.ok()) return polled;
    if (state == ncclInProgress) return true;
    absl::Status error = FromNcclResult(state, "ncclCommSplit", parent_);
    if (!error.ok()) return error;
    parent_ = nullptr;
    if (comm_ == nullptr) {
      return absl::InternalError(
          "ncclCommSplit completed without a communicator for this rank");
    }
    return false;
  }

  const int device_;
  // Written by NCCL when a split completes (see the split constructor).
  ncclComm_t comm_;
  // Where a split without a color writes its (NULL) handle.
  ncclComm_t no_color_ = nullptr;
  const cudaStream_t stream_;
  // While a split that makes this communicator is in progress: its parent.
  ncclComm_t parent_ = nullptr;
  bool aborted_ = false;
};

class CudaDeviceStream final : public DeviceStream {
 public:
  CudaDeviceStream(int device, cudaStream_t stream)
      : device_(device), stream_(stream) {}
  ~CudaDeviceStream() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }

  absl::Status Copy(void* dst, const void* src, size_t bytes,
                    CopyKind kind) override {
    return CopyOn(device_, stream_, dst, src, bytes, kind);
  }

  absl::Status Memset(void* dst, int value, size_t bytes) override {
    return MemsetOn(device_, stream_, dst, value, bytes);
  }

  absl::Status AddF32(float* dst, const float* src, size_t count) override {
    cudaSetDevice(device_);
    return FromCuda(static_cast<cudaError_t>(
                        cuda_kernels::LaunchAddF32(dst, src, count, stream_)),
                    "the AddF32 kernel");
  }

  absl::Status Convert(void* dst, Dtype dst_dtype, const void* src,
                       Dtype src_dtype, size_t count, float scale) override {
    absl::StatusOr<cuda_kernels::FloatKind> to = Kind(dst_dtype);
    if (!to.ok()) return to.status();
    absl::StatusOr<cuda_kernels::FloatKind> from = Kind(src_dtype);
    if (!from.ok()) return from.status();
    cudaSetDevice(device_);
    return FromCuda(static_cast<cudaError_t>(cuda_kernels::LaunchConvert(
                        dst, *to, src, *from, count, scale, stream_)),
                    "the Convert kernel");
  }

  absl::Status Update(const ElementwiseUpdate& update) override {
    cudaSetDevice(device_);
    return FromCuda(
        static_cast<cudaError_t>(cuda_kernels::LaunchUpdate(update, stream_)),
        "the optimizer Update kernel");
  }

  absl::Status Synchronize() override {
    cudaSetDevice(device_);
    return FromCuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

 private:
  const int device_;
  const cudaStream_t stream_;
};

class CudaNcclApiImpl final : public NcclApi {
 public:
  absl::StatusOr<int> DeviceCount() override {
    int count = 0;
    const cudaError_t error = cudaGetDeviceCount(&count);
    if (error != cudaSuccess) {
      return absl::FailedPreconditionError(absl::StrCat(
          "no CUDA device visible: cudaGetDeviceCount: ",
          cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
    }
    if (count == 0) {
      return absl::FailedPreconditionError(
          "no CUDA device visible: cudaGetDeviceCount found 0 devices");
    }
    return count;
  }

  absl::StatusOr<NcclUniqueId> GetUniqueId() override {
    ncclUniqueId id;
    absl::Status made = FromNcclResult(ncclGetUniqueId(&id), "ncclGetUniqueId");
    if (!made.ok()) return made;
    NcclUniqueId out;
    std::memcpy(out.bytes.data(), &id, sizeof(id));
    return out;
  }

  absl::StatusOr<std::unique_ptr<NcclCommunicator>> InitRank(
      int device, int nranks, int rank,
      absl::Span<const NcclUniqueId> ids) override {
    absl::Status set = FromCuda(cudaSetDevice(device), "cudaSetDevice");
    if (!set.ok()) return set;
    std::vector<ncclUniqueId> nccl_ids(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      std::memcpy(&nccl_ids[i], ids[i].bytes.data(), sizeof(ncclUniqueId));
    }
    cudaStream_t stream;
    absl::Status created =
        FromCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                 "cudaStreamCreateWithFlags");
    if (!created.ok()) return created;
    ncclConfig_t config = NonblockingConfig();
    ncclComm_t comm = nullptr;
    const ncclResult_t result =
        nccl_ids.size() == 1
            ? ncclCommInitRankConfig(&comm, nranks, nccl_ids[0], rank, &config)
            : ncclCommInitRankScalable(&comm, nranks, rank,
                                       static_cast<int>(nccl_ids.size()),
                                       nccl_ids.data(), &config);
    absl::Status started =
        FromNcclResult(result,
                       nccl_ids.size() == 1 ? "ncclCommInitRankConfig"
                                            : "ncclCommInitRankScalable",
                       comm);
    if (!started.ok()) {
      if (comm != nullptr) ncclCommAbort(comm);
      cudaStreamDestroy(stream);
      return started;
    }
    return std::unique_ptr<NcclCommunicator>(
        new CudaCommunicator(device, comm, stream));
  }

  absl::StatusOr<std::unique_ptr<DeviceStream>> NewStream(int device) override {
    absl::Status set = FromCuda(cudaSetDevice(device), "cudaSetDevice");
    if (!set.ok()) return set;
    cudaStream_t stream;
    absl::Status created =
        FromCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                 "cudaStreamCreateWithFlags");
    if (!created.ok()) return created;
    return std::unique_ptr<DeviceStream>(new CudaDeviceStream(device, stream));
  }

  absl::StatusOr<void*> Alloc(int device, size_t bytes) override {
    absl::Status set = FromCuda(cudaSetDevice(device), "cudaSetDevice");
    if (!set.ok()) return set;
    void* memory = nullptr;
    absl::Status allocated = FromCuda(cudaMalloc(&memory, bytes), "cudaMalloc");
    if (!allocated.ok()) return allocated;
    return memory;
  }

  void Free(void* device_memory) override { cudaFree(device_memory); }
};

}  // namespace

std::shared_ptr<NcclApi> CudaNcclApi() {
  static auto* const api =
      new std::shared_ptr<NcclApi>(std::make_shared<CudaNcclApiImpl>());
  return *api;
}

}  // namespace cohort
