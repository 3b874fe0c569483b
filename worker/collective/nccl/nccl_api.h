// NcclApi and NcclCommunicator: the NCCL and CUDA calls the NCCL backend
// makes, behind an interface of cohort's own types, so that everything
// around them (bootstrap, the watchdog, op validation, Work completion) is
// built and tested without a GPU or even CUDA's headers. Two
// implementations: cuda_nccl_api.h (the real one, over libnccl and
// libcudart) and fake_nccl_api.h (in-process ranks on host memory, for
// tests, with injectable asynchronous errors and hangs).
//
// Communicators are nonblocking (NCCL's ncclConfig_t blocking = 0): every
// call returns at once, and a call that NCCL left in progress (an init, a
// split, the connection setup of a first collective) is finished by
// polling Ready(). The caller serializes the calls on one communicator;
// Abort() may be called between any two of them (from another thread, as
// long as no call is running), and unblocks whatever the GPU waits for.
#ifndef COHORT_WORKER_COLLECTIVE_NCCL_NCCL_API_H_
#define COHORT_WORKER_COLLECTIVE_NCCL_NCCL_API_H_

#include <array>
#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/collective/dtype.h"
#include "worker/collective/elementwise.h"

namespace cohort {

// ncclUniqueId's bytes (NCCL_UNIQUE_ID_BYTES): what the root of a
// communicator publishes in the store for the others.
inline constexpr size_t kNcclUniqueIdBytes = 128;
struct NcclUniqueId {
  std::array<char, kNcclUniqueIdBytes> bytes{};
};

// An event recorded on a communicator's stream: it fires once everything
// enqueued on the stream before it has run.
class NcclEvent {
 public:
  virtual ~NcclEvent() = default;
  // true once fired, false before; an error if CUDA reports one for the
  // work before it. Never blocks.
  virtual absl::StatusOr<bool> Query() = 0;
  // Makes `stream` (a cudaStream_t; null is the legacy default stream)
  // wait for the event before its later work, without blocking the host.
  virtual absl::Status MakeStreamWait(void* stream) = 0;
};

enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice };

// One rank's NCCL communicator with the CUDA stream its ops run on. The
// collective calls enqueue on that stream and return: their buffers are
// device pointers, to be kept until an event recorded after them fires.
// Counts are elements of `dtype`. Every call returns OK (possibly still in
// progress: see Ready), or the error NCCL or CUDA reported, with its text.
class NcclCommunicator {
 public:
  // Destroys the communicator (ncclCommDestroy, or the remains of an
  // aborted one) and its stream.
  virtual ~NcclCommunicator() = default;

  // ncclCommGetAsyncError: true when the communicator is ready for the
  // next call, false while an init, a split or an enqueue is in progress,
  // or the asynchronous error it reported (a peer failed, a network error).
  virtual absl::StatusOr<bool> Ready() = 0;

  // ncclCommAbort: stops every op of the communicator on the GPU, without
  // waiting for peers. The communicator takes no further calls.
  virtual void Abort() = 0;

  // ncclGroupStart / ncclGroupEnd around calls that must progress together
  // (the sends and receives of one op).
  virtual absl::Status GroupStart() = 0;
  virtual absl::Status GroupEnd() = 0;

  virtual absl::Status AllReduce(const void* send, void* recv, size_t count,
                                 Dtype dtype, ReduceOp op) = 0;
  virtual absl::Status Broadcast(const void* send, void* recv, size_t count,
                                 Dtype dtype, int root) = 0;
  virtual absl::Status Reduce(const void* send, void* recv, size_t count,
                              Dtype dtype, ReduceOp op, int root) = 0;
  // `count` elements from every rank, rank r's at recv + r * count.
  virtual absl::Status AllGather(const void* send, void* recv, size_t count,
                                 Dtype dtype) = 0;
  // `count` elements of the result per rank; send holds size * count.
  virtual absl::Status ReduceScatter(const void* send, void* recv, size_t count,
                                     Dtype dtype, ReduceOp op) = 0;
  virtual absl::Status Send(const void* send, size_t count, Dtype dtype,
                            int peer) = 0;
  virtual absl::Status Recv(void* recv, size_t count, Dtype dtype,
                            int peer) = 0;

  // ncclCommSplit, a collective of this communicator: the ranks passing
  // the same color get a new communicator, ranked by key and then by rank
  // here. A negative color joins none: OK with null. The new one is in
  // progress until Ready() says otherwise.
  virtual absl::StatusOr<std::unique_ptr<NcclCommunicator>> Split(int color,
                                                                  int key) = 0;

  // Records an event on the stream (after everything enqueued so far).
  virtual absl::StatusOr<std::unique_ptr<NcclEvent>> RecordEvent() = 0;
  // Makes the stream wait for what was enqueued on `stream` (a
  // cudaStream_t) so far, without blocking the host.
  virtual absl::Status WaitForStream(void* stream) = 0;
  // cudaMemcpyAsync / cudaMemsetAsync on the stream.
  virtual absl::Status Copy(void* dst, const void* src, size_t bytes,
                            CopyKind kind) = 0;
  virtual absl::Status Memset(void* dst, int value, size_t bytes) = 0;
};

// A CUDA stream of its own on one device, for memory work that must not
// queue behind a communicator's collectives in flight (DeviceMemory: the
// copies, zeroing and arithmetic of DDP and FSDP). Calls enqueue and
// return; Synchronize() waits for all of them. Not thread-safe.
class DeviceStream {
 public:
  // Destroys the stream (after the work enqueued on it).
  virtual ~DeviceStream() = default;
  // cudaMemcpyAsync / cudaMemsetAsync.
  virtual absl::Status Copy(void* dst, const void* src, size_t bytes,
                            CopyKind kind) = 0;
  virtual absl::Status Memset(void* dst, int value, size_t bytes) = 0;
  // The element-wise kernels (cuda_kernels.h in the real implementation):
  // dst[i] += src[i] over `count` f32;
  virtual absl::Status AddF32(float* dst, const float* src, size_t count) = 0;
  // dst[i] = src[i] * scale between f32, f16 and bf16 (nearest even);
  virtual absl::Status Convert(void* dst, Dtype dst_dtype, const void* src,
                               Dtype src_dtype, size_t count, float scale) = 0;
  // one optimizer step (elementwise.h).
  virtual absl::Status Update(const ElementwiseUpdate& update) = 0;
  // cudaStreamSynchronize: waits for everything enqueued; the error CUDA
  // reports for it, if any.
  virtual absl::Status Synchronize() = 0;
};

class NcclApi {
 public:
  virtual ~NcclApi() = default;

  // The number of CUDA devices this process sees (at least 1), or
  // FAILED_PRECONDITION "no CUDA device visible: " followed by CUDA's
  // error text (cudaGetDeviceCount's).
  virtual absl::StatusOr<int> DeviceCount() = 0;

  // A fresh ncclUniqueId (ncclGetUniqueId: this process becomes the
  // communicator's bootstrap root).
  virtual absl::StatusOr<NcclUniqueId> GetUniqueId() = 0;

  // Starts creating rank `rank` of an `nranks` communicator on `device`,
  // nonblocking: ncclCommInitRankConfig for one id, ncclCommInitRankScalable
  // for several (the same ids, in the same order, on every rank). Poll the
  // result's Ready().
  virtual absl::StatusOr<std::unique_ptr<NcclCommunicator>> InitRank(
      int device, int nranks, int rank, absl::Span<const NcclUniqueId> ids) = 0;

  // A new DeviceStream on `device` (cudaStreamCreateWithFlags, not
  // synchronizing with the legacy default stream).
  virtual absl::StatusOr<std::unique_ptr<DeviceStream>> NewStream(
      int device) = 0;

  // cudaMalloc / cudaFree of device memory on `device`.
  virtual absl::StatusOr<void*> Alloc(int device, size_t bytes) = 0;
  virtual void Free(void* device_memory) = 0;
};

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_NCCL_NCCL_API_H_
