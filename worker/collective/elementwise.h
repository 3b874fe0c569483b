// The element-wise f32 arithmetic that data parallelism runs on its own
// buffers (gradient accumulation, optimizer steps), written once for every
// place it runs: host loops (worker/parallel), the fake NCCL's "device"
// (host memory) and the CUDA kernels of the NCCL backend, which nvcc
// compiles from this same header. One formula everywhere means a step on a
// GPU computes what the host reference computes, bit for bit where the
// hardware rounds alike (the kernels are built without FMA contraction).
//
// Plain C++ only: no Abseil, no standard containers (nvcc compiles it).
#ifndef COHORT_WORKER_COLLECTIVE_ELEMENTWISE_H_
#define COHORT_WORKER_COLLECTIVE_ELEMENTWISE_H_

#include <math.h>
#include <stddef.h>

#if defined(__CUDACC__)
#define COHORT_HOST_DEVICE __host__ __device__
#else
#define COHORT_HOST_DEVICE
#endif

namespace cohort {

// One optimizer step over `count` f32 elements, torch.optim's rules (see
// worker/parallel/optimizer.h): every pointer is in the same memory (host,
// or one device's).
struct ElementwiseUpdate {
  enum class Rule : int {
    kSgd = 0,          // param -= lr * g
    kSgdMomentum = 1,  // buf = first_step ? g : momentum * buf + g;
                       // param -= lr * buf (state0 = buf)
    kAdam = 2,         // state0 = exp_avg, state1 = exp_avg_sq
  };
  Rule rule = Rule::kSgd;
  float* params = nullptr;
  const float* grads = nullptr;
  float* state0 = nullptr;
  float* state1 = nullptr;
  size_t count = 0;

  float lr = 0.0f;
  // g = grad + weight_decay * param (L2, as torch.optim's SGD and Adam).
  float weight_decay = 0.0f;
  float momentum = 0.0f;
  bool first_step = false;
  float beta1 = 0.0f;
  float beta2 = 0.0f;
  float eps = 0.0f;
  // Adam's bias corrections folded once per step on the host (in double,
  // as torch does with Python floats): step_size = lr / (1 - beta1^t),
  // bc2_sqrt = sqrt(1 - beta2^t).
  float step_size = 0.0f;
  float bc2_sqrt = 1.0f;
};

// Each rule at element i.
COHORT_HOST_DEVICE inline void SgdAt(const ElementwiseUpdate& u, size_t i) {
  const float g = u.grads[i] + u.weight_decay * u.params[i];
  u.params[i] -= u.lr * g;
}

COHORT_HOST_DEVICE inline void SgdMomentumAt(const ElementwiseUpdate& u,
                                             size_t i) {
  const float g = u.grads[i] + u.weight_decay * u.params[i];
  // torch.optim.SGD seeds the buffer with the first gradient itself.
  const float buf = u.first_step ? g : u.momentum * u.state0[i] + g;
  u.state0[i] = buf;
  u.params[i] -= u.lr * buf;
}

COHORT_HOST_DEVICE inline void AdamAt(const ElementwiseUpdate& u, size_t i) {
  const float g = u.grads[i] + u.weight_decay * u.params[i];
  const float m = u.beta1 * u.state0[i] + (1.0f - u.beta1) * g;
  const float v = u.beta2 * u.state1[i] + (1.0f - u.beta2) * g * g;
  u.state0[i] = m;
  u.state1[i] = v;
  const float denom = sqrtf(v) / u.bc2_sqrt + u.eps;
  u.params[i] -= u.step_size * (m / denom);
}

// Applies `u` to element i (a kernel's thread).
COHORT_HOST_DEVICE inline void ApplyUpdateAt(const ElementwiseUpdate& u,
                                             size_t i) {
  switch (u.rule) {
    case ElementwiseUpdate::Rule::kSgd:
      SgdAt(u, i);
      break;
    case ElementwiseUpdate::Rule::kSgdMomentum:
      SgdMomentumAt(u, i);
      break;
    case ElementwiseUpdate::Rule::kAdam:
      AdamAt(u, i);
      break;
  }
}

// The whole update on host memory, the rule chosen once.
inline void ApplyUpdateOnHost(const ElementwiseUpdate& u) {
  switch (u.rule) {
    case ElementwiseUpdate::Rule::kSgd:
      for (size_t i = 0; i < u.count; ++i) SgdAt(u, i);
      break;
    case ElementwiseUpdate::Rule::kSgdMomentum:
      for (size_t i = 0; i < u.count; ++i) SgdMomentumAt(u, i);
      break;
    case ElementwiseUpdate::Rule::kAdam:
      for (size_t i = 0; i < u.count; ++i) AdamAt(u, i);
      break;
  }
}

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_ELEMENTWISE_H_
