// What is the device's own in the NCCL backend, checked on one GPU (NCCL
// takes one rank per device, so multi-rank behaviour stays with the fake's
// tests): the real NcclApi's init, split, abort and error reporting; the
// order between a caller's stream and the communicator's (WaitForStream,
// MakeStreamWait); and the watchdog aborting an op that never completes.
// An op is made to hang by a host function that blocks a stream until the
// test opens its gate, with the communicator's stream made to wait for it.
//
// Built only where CUDA is (worker/collective/nccl/BUILD); without a GPU
// every case is SKIPPED with CUDA's reason.
#include <cuda_runtime.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/in_process_store.h"
#include "worker/collective/nccl/cuda_nccl_api.h"
#include "worker/collective/nccl/nccl_backend.h"

namespace cohort {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

#define SKIP_WITHOUT_GPU()                                               \
  if (absl::StatusOr<int> devices = CudaNcclApi()->DeviceCount();        \
      !devices.ok()) {                                                   \
    GTEST_SKIP() << "SKIPPED: " << devices.status().message();          \
  }

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

// Polls Ready() until the communicator is ready or fails; an error if it
// is still in progress after `limit` (an init of one rank takes well under
// a second; the limit only keeps a broken NCCL from hanging the test).
absl::Status AwaitReady(NcclCommunicator& comm,
                        absl::Duration limit = absl::Seconds(60)) {
  const absl::Time give_up = absl::Now() + limit;
  while (true) {
    absl::StatusOr<bool> ready = comm.Ready();
    if (!ready.ok()) return ready.status();
    if (*ready) return absl::OkStatus();
    if (absl::Now() > give_up) {
      return absl::DeadlineExceededError("still in progress");
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
}

absl::Status AwaitEvent(NcclEvent& event) {
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (true) {
    absl::StatusOr<bool> fired = event.Query();
    if (!fired.ok()) return fired.status();
    if (*fired) return absl::OkStatus();
    if (absl::Now() > give_up) return absl::DeadlineExceededError("not fired");
    absl::SleepFor(absl::Milliseconds(1));
  }
}

// A host function that blocks the stream it is enqueued on until Open().
class Gate {
 public:
  // Enqueues the wait on `stream`: later work on it runs after Open().
  cudaError_t Block(cudaStream_t stream) {
    return cudaLaunchHostFunc(stream, &Gate::Wait, this);
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  static void CUDART_CB Wait(void* self) {
    Gate* gate = static_cast<Gate*>(self);
    std::unique_lock<std::mutex> lock(gate->mu_);
    gate->cv_.wait(lock, [gate] { return gate->open_; });
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// One rank's communicator on device 0, ready.
std::unique_ptr<NcclCommunicator> WorldOfOne(NcclApi& api) {
  absl::StatusOr<NcclUniqueId> id = api.GetUniqueId();
  EXPECT_TRUE(id.ok()) << id.status();
  if (!id.ok()) return nullptr;
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
      api.InitRank(0, 1, 0, {*id});
  EXPECT_TRUE(comm.ok()) << comm.status();
  if (!comm.ok()) return nullptr;
  absl::Status ready = AwaitReady(**comm);
  EXPECT_TRUE(ready.ok()) << "init: " << ready;
  return ready.ok() ? std::move(*comm) : nullptr;
}

std::vector<float> ReadBack(NcclApi& api, NcclCommunicator& comm,
                            const void* device, size_t count) {
  std::vector<float> out(count);
  EXPECT_TRUE(comm.Copy(out.data(), device, count * 4, CopyKind::kDeviceToHost)
                  .ok());
  auto event = comm.RecordEvent();
  EXPECT_TRUE(event.ok() && AwaitEvent(**event).ok());
  return out;
}

TEST(NcclDevice, InitSplitAndAbortOnTheRealNccl) {
  SKIP_WITHOUT_GPU();
  std::shared_ptr<NcclApi> api = CudaNcclApi();
  std::unique_ptr<NcclCommunicator> comm = WorldOfOne(*api);
  ASSERT_NE(comm, nullptr);

  constexpr size_t kCount = 1 << 16;
  std::vector<float> values(kCount);
  for (size_t i = 0; i < kCount; ++i) values[i] = 0.5f * i - 3.0f;
  void* in = *api->Alloc(0, kCount * 4);
  void* out = *api->Alloc(0, kCount * 4);
  ASSERT_TRUE(
      comm->Copy(in, values.data(), kCount * 4, CopyKind::kHostToDevice).ok());
  // Out of place at world 1: the result is the input, through NCCL.
  ASSERT_TRUE(comm->AllReduce(in, out, kCount, Dtype::kF32, ReduceOp::kSum)
                  .ok());
  EXPECT_EQ(ReadBack(*api, *comm, out, kCount), values);

  // A split with a color is a communicator of its own, ready after polling;
  // one without (negative color) is none.
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> child = comm->Split(7, 0);
  ASSERT_TRUE(child.ok()) << child.status();
  ASSERT_NE(*child, nullptr);
  absl::Status child_ready = AwaitReady(**child);
  ASSERT_TRUE(child_ready.ok()) << "the split's init: " << child_ready;
  ASSERT_TRUE(comm->Memset(out, 0, kCount * 4).ok());
  ASSERT_TRUE(
      (*child)->Broadcast(in, out, kCount, Dtype::kF32, /*root=*/0).ok());
  EXPECT_EQ(ReadBack(*api, **child, out, kCount), values);
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> none = comm->Split(-1, 0);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, nullptr);

  // Abort ends the child at once; its destruction then waits for nothing,
  // and the parent goes on serving.
  (*child)->Abort();
  child->reset();
  ASSERT_TRUE(AwaitReady(*comm).ok());
  ASSERT_TRUE(comm->AllReduce(in, in, kCount, Dtype::kF32, ReduceOp::kMax)
                  .ok());
  EXPECT_EQ(ReadBack(*api, *comm, in, kCount), values);
  api->Free(in);
  api->Free(out);
}

TEST(NcclDevice, AnInitThatCannotCompleteIsAbortedWithoutWaiting) {
  SKIP_WITHOUT_GPU();
  std::shared_ptr<NcclApi> api = CudaNcclApi();
  absl::StatusOr<NcclUniqueId> id = api->GetUniqueId();
  ASSERT_TRUE(id.ok());
  // Rank 0 of 2, whose peer never comes: the nonblocking init stays in
  // progress (it never blocks the caller), and Abort ends it.
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
      api->InitRank(0, 2, 0, {*id});
  ASSERT_TRUE(comm.ok()) << comm.status();
  absl::Status ready = AwaitReady(**comm, absl::Seconds(2));
  EXPECT_EQ(ready.code(), absl::StatusCode::kDeadlineExceeded) << ready;
  (*comm)->Abort();
  comm->reset();
  // The device is still usable.
  std::unique_ptr<NcclCommunicator> fresh = WorldOfOne(*api);
  EXPECT_NE(fresh, nullptr);
}

TEST(NcclDevice, AnInvalidCallIsRefusedInNcclsWordsAndReportedOrHarmless) {
  SKIP_WITHOUT_GPU();
  std::shared_ptr<NcclApi> api = CudaNcclApi();
  std::unique_ptr<NcclCommunicator> comm = WorldOfOne(*api);
  ASSERT_NE(comm, nullptr);
  void* buffer = *api->Alloc(0, 64);
  // Root 3 of a world of 1.
  absl::Status refused = comm->Broadcast(buffer, buffer, 16, Dtype::kF32, 3);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.message(), HasSubstr("ncclBroadcast"));
  EXPECT_THAT(refused.message(), HasSubstr("invalid argument"));
  // NCCL either keeps the communicator usable or reports the error through
  // ncclCommGetAsyncError (the watchdog's poll), in its own words.
  absl::StatusOr<bool> ready = comm->Ready();
  std::printf("after an invalid call, Ready() = %s\n",
              ready.ok() ? (*ready ? "true" : "false")
                         : std::string(ready.status().message()).c_str());
  if (ready.ok()) {
    EXPECT_TRUE(*ready);
    EXPECT_TRUE(comm->AllReduce(buffer, buffer, 16, Dtype::kF32,
                                ReduceOp::kSum)
                    .ok());
    auto event = comm->RecordEvent();
    ASSERT_TRUE(event.ok());
    EXPECT_TRUE(AwaitEvent(**event).ok());
  } else {
    EXPECT_THAT(ready.status().message(),
                AnyOf(HasSubstr("invalid"), HasSubstr("Invalid")));
    comm->Abort();
  }
  api->Free(buffer);
}

// A group of one rank on device 0 over an in-process store.
std::unique_ptr<NcclProcessGroup> GroupOfOne(absl::Duration timeout) {
  NcclOptions options;
  options.device = 0;
  options.group.timeout = timeout;
  options.watchdog_interval = absl::Milliseconds(20);
  auto group =
      CreateNcclProcessGroup(std::make_shared<InProcessStore>(), 0, 1, options);
  EXPECT_TRUE(group.ok()) << group.status();
  return group.ok() ? std::move(*group) : nullptr;
}

// The op waits for the caller's stream (WaitForStream), and the caller's
// second stream waits for the op (MakeStreamWait), on the GPU: while the
// first stream is held, neither the op nor the work behind it completes;
// once released, the op saw the copy before it and the copy after it saw
// the op's output.
TEST(NcclDevice, OpsOrderAfterAndBeforeTheCallersStreams) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<NcclProcessGroup> g = GroupOfOne(absl::Seconds(60));
  ASSERT_NE(g, nullptr);
  constexpr size_t kCount = 1 << 20;
  float* pinned_in = nullptr;
  float* pinned_out = nullptr;
  CUDA_OK(cudaMallocHost(&pinned_in, kCount * 4));
  CUDA_OK(cudaMallocHost(&pinned_out, kCount * 4));
  for (size_t i = 0; i < kCount; ++i) pinned_in[i] = 1.0f + (i % 1000);
  std::memset(pinned_out, 0, kCount * 4);
  void* x = *g->api().Alloc(g->device(), kCount * 4);
  ASSERT_TRUE(g->Memset(x, 0, kCount * 4).ok());

  cudaStream_t writer, reader;
  CUDA_OK(cudaStreamCreateWithFlags(&writer, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&reader, cudaStreamNonBlocking));
  Gate gate;
  CUDA_OK(gate.Block(writer));
  CUDA_OK(cudaMemcpyAsync(x, pinned_in, kCount * 4, cudaMemcpyHostToDevice,
                          writer));
  ASSERT_TRUE(g->WaitForStream(writer).ok());
  std::shared_ptr<Work> work =
      g->AllReduce(BufferView{x, kCount, Dtype::kF32}, ReduceOp::kSum);
  ASSERT_TRUE(g->MakeStreamWait(work, reader).ok());
  CUDA_OK(cudaMemcpyAsync(pinned_out, x, kCount * 4, cudaMemcpyDeviceToHost,
                          reader));
  cudaEvent_t read;
  CUDA_OK(cudaEventCreateWithFlags(&read, cudaEventDisableTiming));
  CUDA_OK(cudaEventRecord(read, reader));

  // Held: give a wrong order every chance to show.
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(work->IsCompleted()) << "the op ran before the stream it waits for";
  EXPECT_EQ(cudaEventQuery(read), cudaErrorNotReady)
      << "the reader's copy ran before the op it waits for";
  EXPECT_EQ(pinned_out[5], 0.0f);

  gate.Open();
  ASSERT_TRUE(work->Wait().ok()) << work->status();
  CUDA_OK(cudaEventSynchronize(read));
  for (size_t i = 0; i < kCount; ++i) {
    ASSERT_EQ(pinned_out[i], pinned_in[i]) << i;
  }
  CUDA_OK(cudaEventDestroy(read));
  CUDA_OK(cudaStreamDestroy(writer));
  CUDA_OK(cudaStreamDestroy(reader));
  g->api().Free(x);
  CUDA_OK(cudaFreeHost(pinned_in));
  CUDA_OK(cudaFreeHost(pinned_out));
}

// NcclProcessGroup::Split over the real ncclCommSplit: a group of its own
// whose ops run; a negative color joins none.
TEST(NcclDevice, AGroupSplitsIntoAWorkingGroup) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<NcclProcessGroup> g = GroupOfOne(absl::Seconds(60));
  ASSERT_NE(g, nullptr);
  absl::StatusOr<std::unique_ptr<NcclProcessGroup>> child = g->Split(3, 0);
  ASSERT_TRUE(child.ok()) << child.status();
  ASSERT_NE(*child, nullptr);
  EXPECT_EQ((*child)->size(), 1);
  std::vector<float> values = {1.5f, -2.0f, 7.0f};
  void* x = *g->api().Alloc(g->device(), 12);
  ASSERT_TRUE(
      (*child)->Copy(x, values.data(), 12, CopyKind::kHostToDevice).ok());
  absl::Status reduced =
      (*child)->AllReduce(BufferView{x, 3, Dtype::kF32}, ReduceOp::kSum)->Wait();
  ASSERT_TRUE(reduced.ok()) << reduced;
  std::vector<float> got(3);
  ASSERT_TRUE((*child)->Copy(got.data(), x, 12, CopyKind::kDeviceToHost).ok());
  EXPECT_EQ(got, values);
  absl::StatusOr<std::unique_ptr<NcclProcessGroup>> none = g->Split(-1, 0);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(*none, nullptr);
  // The parent still works.
  EXPECT_TRUE(
      g->AllReduce(BufferView{x, 3, Dtype::kF32}, ReduceOp::kSum)->Wait().ok());
  g->api().Free(x);
}

// Last in this file: it leaves an aborted communicator behind.
TEST(NcclDevice, TheWatchdogAbortsAnOpThatHangs) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<NcclProcessGroup> g = GroupOfOne(absl::Seconds(3));
  ASSERT_NE(g, nullptr);
  void* x = *g->api().Alloc(g->device(), 64);
  ASSERT_TRUE(g->Memset(x, 0, 64).ok());
  cudaStream_t held;
  CUDA_OK(cudaStreamCreateWithFlags(&held, cudaStreamNonBlocking));
  Gate gate;
  CUDA_OK(gate.Block(held));
  ASSERT_TRUE(g->WaitForStream(held).ok());

  // A backstop: if the abort itself waited for the held stream, the gate
  // opens 10 s after the deadline, and the test says so below.
  std::atomic<bool> released{false}, ended{false};
  std::thread backstop([&] {
    const absl::Time limit = absl::Now() + absl::Seconds(13);
    while (!ended && absl::Now() < limit) absl::SleepFor(absl::Milliseconds(10));
    released = !ended;
    gate.Open();
  });
  absl::Status hung =
      g->AllReduce(BufferView{x, 16, Dtype::kF32}, ReduceOp::kSum)->Wait();
  ended = true;
  EXPECT_FALSE(released) << "the op ended only once its stream was released:"
                            " the abort waited on the GPU";
  EXPECT_EQ(hung.code(), absl::StatusCode::kDeadlineExceeded) << hung;
  EXPECT_THAT(hung.message(), HasSubstr("watchdog aborted"));
  EXPECT_THAT(hung.message(), HasSubstr("AllReduce"));
  // The group is broken, as a Gloo group is after a failure.
  absl::Status after = g->Barrier()->Wait();
  EXPECT_EQ(after.code(), absl::StatusCode::kFailedPrecondition) << after;

  gate.Open();
  backstop.join();
  CUDA_OK(cudaStreamSynchronize(held));
  CUDA_OK(cudaStreamDestroy(held));
  g->api().Free(x);
  g.reset();
  // Nothing sticky is left on the device: a new group works.
  std::unique_ptr<NcclProcessGroup> fresh = GroupOfOne(absl::Seconds(60));
  ASSERT_NE(fresh, nullptr);
  void* y = *fresh->api().Alloc(fresh->device(), 64);
  ASSERT_TRUE(fresh->Memset(y, 0, 64).ok());
  EXPECT_TRUE(
      fresh->AllReduce(BufferView{y, 16, Dtype::kF32}, ReduceOp::kSum)->Wait().ok());
  fresh->api().Free(y);
}

}  // namespace
}  // namespace cohort
