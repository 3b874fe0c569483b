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

  ~CudaCommunicator() override {
    cudaSetDevice(device_);
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
    ncclCommAbort(comm_);
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
    ncclComm_t child = nullptr;
    absl::Status split = FromNcclResult(
        ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key,
                      &child, &config),
        "ncclCommSplit", comm_);
    if (!split.ok()) return split;
    if (color < 0) return std::unique_ptr<NcclCommunicator>();
    cudaStream_t stream;
    absl::Status created =
        FromCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                 "cudaStreamCreateWithFlags");
    if (!created.ok()) {
      ncclCommAbort(child);
      return created;
    }
    return std::unique_ptr<NcclCommunicator>(
        new CudaCommunicator(device_, child, stream));
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

  const int device_;
  const ncclComm_t comm_;
  const cudaStream_t stream_;
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
