// Element-wise reduction kernels for every Dtype x ReduceOp, and the f16 /
// bf16 conversions they use. Backends call these to combine buffers that
// arrive from peers; they are plain loops with no threads and no I/O.
//
// The arithmetic, exactly:
//  - Integers wrap around (two's complement) on SUM and PROD overflow, as
//    they do on every accelerator backend; nothing is undefined behaviour.
//  - f16 and bf16 are widened to f32 for each operation and rounded back to
//    nearest-even. A whole reduction accumulated in f32 widens the buffers
//    first (WidenToF32) and narrows the result once: the op engine does so
//    for every host backend (op_engine.h).
//  - MIN and MAX of floats use `<`: when one operand is NaN the result is
//    whichever operand the comparison picks, not necessarily NaN.
//  - AVG is not a pairwise operation: combine with SUM (Combine treats kAvg
//    as kSum) and then DivideInPlace by the number of contributions.
//    Integers are divided with C++ integer division, which truncates toward
//    zero (AVG of i32 {1, 2} is 1, of {-1, -2} is -1).
#ifndef COHORT_WORKER_COLLECTIVE_REDUCE_H_
#define COHORT_WORKER_COLLECTIVE_REDUCE_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "worker/collective/dtype.h"

namespace cohort {

float HalfToFloat(Float16 value);
// Rounds to nearest-even; overflow gives infinity, NaN stays NaN.
Float16 FloatToHalf(float value);

float BFloat16ToFloat(BFloat16 value);
// Rounds to nearest-even; NaN stays NaN.
BFloat16 FloatToBFloat16(float value);

// out[i] = a[i] op b[i] for i < count, where all three hold `count`
// elements of `dtype`. `out` may alias `a` or `b` (gloo's reduce functions
// are called that way). kAvg combines as kSum.
void Combine(Dtype dtype, ReduceOp op, void* out, const void* a, const void* b,
             size_t count);

// data[i] /= divisor for i < count. REQUIRES: divisor > 0.
void DivideInPlace(Dtype dtype, void* data, size_t count, int64_t divisor);

// dst[i] = src[i] as f32. REQUIRES: dtype is kF16 or kBF16.
void WidenToF32(Dtype dtype, const void* src, float* dst, size_t count);
// dst[i] = src[i] rounded to `dtype`. REQUIRES: dtype is kF16 or kBF16.
void NarrowFromF32(Dtype dtype, const float* src, void* dst, size_t count);

// Whether ConvertFloats takes these buffers: INVALID_ARGUMENT naming the
// problem unless both dtypes are f32, f16 or bf16 and the counts are equal.
absl::Status CheckFloatConversion(Dtype dst_dtype, size_t dst_count,
                                  Dtype src_dtype, size_t src_count);
// dst[i] = src[i] * scale: widened to f32, scaled, rounded once to
// dst_dtype (nearest even), as the NCCL backend's Convert kernel does.
// REQUIRES: CheckFloatConversion passes; dst and src do not overlap.
void ConvertFloats(Dtype dst_dtype, void* dst, Dtype src_dtype, const void* src,
                   size_t count, float scale);

}  // namespace cohort

#endif  // COHORT_WORKER_COLLECTIVE_REDUCE_H_
