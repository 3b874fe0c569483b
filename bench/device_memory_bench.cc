// device_memory_bench: the NCCL backend's device-side costs on one GPU,
// which DDP and FSDP pay on every step (worker/parallel/group_memory.h):
//
//  1. Kernel throughput. The element-wise kernels (cuda_kernels.cu) over
//     --elements f32, as bytes each moves per second, beside the device's
//     own copy (cudaMemcpyAsync device to device) in the same run: the
//     kernels are memory-bound, so the copy is their ceiling.
//       add      dst += src           12 bytes an element (2 reads, 1 write)
//       convert  f32 -> bf16           6 bytes
//       adam     one Adam step        28 bytes (4 reads, 3 writes)
//       copy     device to device      8 bytes (1 read, 1 write)
//  2. The cost of one DeviceMemory call (the group's own stream: enqueue,
//     then wait for it), on 4 bytes, so that it is all launch and wait:
//     CopyToDevice, CopyToHost, Zero, AddF32.
//
// Each figure is the median of --rounds rounds; a round times --iters
// calls back to back (throughput: then one synchronize). It asserts
// nothing and prints the device it ran on. Without a GPU it exits 2
// saying why. tools/gpu_test.sh runs it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tests/testing/in_process_store.h"
#include "worker/collective/elementwise.h"
#include "worker/collective/nccl/cuda_nccl_api.h"
#include "worker/collective/nccl/nccl_backend.h"

ABSL_FLAG(size_t, elements, size_t{1} << 28,
          "f32 elements per kernel (the default, 2^28, is 1 GiB a buffer)");
ABSL_FLAG(int, rounds, 5, "rounds per figure (the median is printed)");
ABSL_FLAG(int, iters, 20, "kernels per throughput round");
ABSL_FLAG(int, calls, 2000, "calls per DeviceMemory round");

namespace cohort {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Fail(absl::string_view what, const absl::Status& status) {
  std::fprintf(stderr, "device_memory_bench: %.*s: %s\n",
               static_cast<int>(what.size()), what.data(),
               std::string(status.message()).c_str());
  return 1;
}

int Main() {
  std::shared_ptr<NcclApi> api = CudaNcclApi();
  absl::StatusOr<int> devices = api->DeviceCount();
  if (!devices.ok()) {
    std::fprintf(stderr, "device_memory_bench: %s\n",
                 std::string(devices.status().message()).c_str());
    return 2;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device 0: %s, %d multiprocessors, %.1f GiB\n", prop.name,
              prop.multiProcessorCount, prop.totalGlobalMem / double(1 << 30));

  const size_t n = absl::GetFlag(FLAGS_elements);
  const int rounds = absl::GetFlag(FLAGS_rounds);
  const int iters = absl::GetFlag(FLAGS_iters);
  absl::StatusOr<std::unique_ptr<DeviceStream>> stream = api->NewStream(0);
  if (!stream.ok()) return Fail("NewStream", stream.status());
  std::vector<void*> buffers;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<void*> b = api->Alloc(0, n * 4);
    if (!b.ok()) return Fail("Alloc", b.status());
    (*stream)->Memset(*b, 0, n * 4).IgnoreError();
    buffers.push_back(*b);
  }
  float* a = static_cast<float*>(buffers[0]);
  float* b = static_cast<float*>(buffers[1]);
  float* m = static_cast<float*>(buffers[2]);
  float* v = static_cast<float*>(buffers[3]);
  if (absl::Status s = (*stream)->Synchronize(); !s.ok()) {
    return Fail("Synchronize", s);
  }

  ElementwiseUpdate adam;
  adam.rule = ElementwiseUpdate::Rule::kAdam;
  adam.params = a;
  adam.grads = b;
  adam.state0 = m;
  adam.state1 = v;
  adam.count = n;
  adam.lr = 1e-3f;
  adam.beta1 = 0.9f;
  adam.beta2 = 0.999f;
  adam.eps = 1e-8f;
  adam.step_size = 1e-2f;
  adam.bc2_sqrt = 0.0447f;

  struct Kernel {
    const char* name;
    double bytes_per_element;
    std::function<absl::Status()> launch;
  };
  std::vector<Kernel> kernels = {
      {"copy (device to device)", 8,
       [&] {
         return (*stream)->Copy(a, b, n * 4, CopyKind::kDeviceToDevice);
       }},
      {"add (dst += src)", 12, [&] { return (*stream)->AddF32(a, b, n); }},
      {"convert (f32 -> bf16)", 6,
       [&] {
         return (*stream)->Convert(m, Dtype::kBF16, b, Dtype::kF32, n, 1.0f);
       }},
      {"adam (one step)", 28, [&] { return (*stream)->Update(adam); }},
  };
  std::printf("\nkernel throughput, %zu f32 elements (%.2f GiB a buffer), "
              "median of %d rounds of %d\n",
              n, n * 4.0 / (1 << 30), rounds, iters);
  std::printf("%-26s %12s %12s %10s\n", "kernel", "time/call", "GB/s",
              "vs copy");
  double copy_rate = 0;
  for (const Kernel& k : kernels) {
    for (int w = 0; w < 2; ++w) k.launch().IgnoreError();
    (*stream)->Synchronize().IgnoreError();
    std::vector<double> seconds;
    for (int r = 0; r < rounds; ++r) {
      const absl::Time start = absl::Now();
      for (int i = 0; i < iters; ++i) {
        if (absl::Status s = k.launch(); !s.ok()) return Fail(k.name, s);
      }
      if (absl::Status s = (*stream)->Synchronize(); !s.ok()) {
        return Fail(k.name, s);
      }
      seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start) / iters);
    }
    const double t = Median(seconds);
    const double rate = k.bytes_per_element * n / t / 1e9;
    if (copy_rate == 0) copy_rate = rate;
    std::printf("%-26s %9.1f us %12.0f %9.2fx\n", k.name, t * 1e6, rate,
                rate / copy_rate);
  }
  for (void* p : buffers) api->Free(p);

  // One DeviceMemory call, through a group of one rank.
  NcclOptions options;
  options.device = 0;
  options.group.timeout = absl::Seconds(60);
  auto group =
      CreateNcclProcessGroup(std::make_shared<InProcessStore>(), 0, 1, options);
  if (!group.ok()) return Fail("CreateNcclProcessGroup", group.status());
  DeviceMemory& memory = *(*group)->device_memory();
  absl::StatusOr<void*> small = memory.Allocate(64);
  absl::StatusOr<void*> other = memory.Allocate(64);
  if (!small.ok() || !other.ok()) {
    return Fail("Allocate", small.ok() ? other.status() : small.status());
  }
  float host[16] = {};
  float* d = static_cast<float*>(*small);
  const float* s = static_cast<const float*>(*other);
  struct Call {
    const char* name;
    std::function<absl::Status()> run;
  };
  std::vector<Call> calls = {
      {"CopyToDevice (4 B)", [&] { return memory.CopyToDevice(d, host, 4); }},
      {"CopyToHost (4 B)", [&] { return memory.CopyToHost(host, d, 4); }},
      {"Zero (4 B)", [&] { return memory.Zero(d, 4); }},
      {"AddF32 (1 element)", [&] { return memory.AddF32(d, s, 1); }},
  };
  const int per_round = absl::GetFlag(FLAGS_calls);
  std::printf("\nDeviceMemory calls (enqueue on the group's memory stream and "
              "wait), median of %d rounds of %d\n",
              rounds, per_round);
  std::printf("%-26s %12s\n", "call", "time/call");
  for (const Call& c : calls) {
    for (int w = 0; w < 100; ++w) c.run().IgnoreError();
    std::vector<double> seconds;
    for (int r = 0; r < rounds; ++r) {
      const absl::Time start = absl::Now();
      for (int i = 0; i < per_round; ++i) {
        if (absl::Status st = c.run(); !st.ok()) return Fail(c.name, st);
      }
      seconds.push_back(absl::ToDoubleSeconds(absl::Now() - start) /
                        per_round);
    }
    std::printf("%-26s %9.2f us\n", c.name, Median(seconds) * 1e6);
  }
  memory.Free(*small);
  memory.Free(*other);
  return 0;
}

}  // namespace
}  // namespace cohort

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return cohort::Main();
}
