// Element types and reduction operators of the data plane, shared by the
// ProcessGroup API (process_group.h), the reduction kernels (reduce.h) and
// the backends.
#ifndef COHORT_WORKER_COLLECTIVE_DTYPE_H_
#define COHORT_WORKER_COLLECTIVE_DTYPE_H_

#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"

namespace cohort {

// The element type of a buffer. The values are not a wire format: backends
// never send a Dtype, every rank must pass the same one to an op.
enum class Dtype {
  kF32,
  kF64,
  kF16,   // IEEE 754 binary16.
  kBF16,  // bfloat16: the upper 16 bits of an f32.
  kI8,
  kU8,
  kI32,
  kI64,
};

// Reduction operators. Every operator is defined for every Dtype; see
// reduce.h for the exact arithmetic (integer wrap-around, AVG rounding).
enum class ReduceOp {
  kSum,
  kProd,
  kMin,
  kMax,
  kAvg,  // SUM across ranks, then divided by the number of ranks.
};

// An IEEE binary16 value, stored as its bits. Arithmetic goes through f32
// (reduce.h: HalfToFloat, FloatToHalf).
struct Float16 {
  uint16_t bits = 0;
};

// A bfloat16 value, stored as its bits (reduce.h: BFloat16ToFloat,
// FloatToBFloat16).
struct BFloat16 {
  uint16_t bits = 0;
};

// Bytes per element: 1, 2, 4 or 8.
size_t DtypeSize(Dtype dtype);

// "f32", "bf16", ... for error messages.
absl::string_view DtypeName(Dtype dtype);

// "SUM", "AVG", ... for error messages.
absl::string_view ReduceOpName(ReduceOp op);

// The Dtype of a C++ element type: DtypeOf<float>() == Dtype::kF32.
template <typename T>
constexpr Dtype DtypeOf();
template <>
constexpr Dtype DtypeOf<float>() {
  return Dtype::kF32;
}
template <>
constexpr Dtype DtypeOf<double>() {
  return Dtype::kF64;
}
template <>
constexpr Dtype DtypeOf<Float16>() {
  return Dtype::kF16;
}
template <>
constexpr Dtype DtypeOf<BFloat16>() {
  return Dtype::kBF16;
}
template <>
constexpr Dtype DtypeOf<int8_t>() {
  return Dtype::kI8;
}
template <>
constexpr Dtype DtypeOf<uint8_t>() {
  return Dtype::kU8;
}
template <>
constexpr Dtype DtypeOf<int32_t>() {
  return Dtype::kI32;
}
template <>
constexpr Dtype DtypeOf<int64_t>() {
  return Dtype::kI64;
}

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_DTYPE_H_
