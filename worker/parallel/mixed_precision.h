// Mixed precision on f32 storage: the compute dtype's rounding applied to
// f32 values, so that the same host code (Eigen products with f32
// accumulation, as tensor cores accumulate bf16 and fp16 products in f32)
// trains in bf16 or fp16 while the master weights and the optimizer's
// state stay f32, as torch.autocast with f32 parameters does.
//
//   Precision p = ParsePrecision("bf16").value();
//   RoundCopy(p, master, compute);     // the weights forward/backward use
//   ... backward writes grads ...
//   RoundInPlace(p, grads);            // bf16/fp16 gradients
//
// Rounding is to nearest even, exactly as a cast to the 16-bit type and
// back (reduce.h): fp16 overflows to +-inf beyond 65504 (which fp16's loss
// scaling detects, loss_scaler.h) and keeps subnormals; bf16 has f32's
// range.
#ifndef COHORT_WORKER_PARALLEL_MIXED_PRECISION_H_
#define COHORT_WORKER_PARALLEL_MIXED_PRECISION_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace cohort {

enum class Precision { kF32, kBF16, kF16 };

// "f32", "bf16", "fp16" (INVALID_ARGUMENT naming the choices otherwise).
absl::StatusOr<Precision> ParsePrecision(absl::string_view name);
absl::string_view PrecisionName(Precision precision);

// The unit roundoff u of the precision's rounding: |round(x) - x| <=
// u * |x| + tiny(precision) for every finite x that does not overflow.
// 2^-24 (f32), 2^-8 (bf16: 8 significant bits), 2^-11 (fp16: 11).
double UnitRoundoff(Precision precision);
// The absolute part of that bound: half the smallest subnormal, where the
// relative bound stops holding (2^-25 for fp16).
double SubnormalSpacing(Precision precision);

// values[i] = round(values[i]). f32: nothing to do.
void RoundInPlace(Precision precision, absl::Span<float> values);
// dst[i] = round(src[i]). REQUIRES: dst.size() == src.size().
void RoundCopy(Precision precision, absl::Span<const float> src,
               absl::Span<float> dst);

}  // namespace cohort

#endif  // COHORT_WORKER_PARALLEL_MIXED_PRECISION_H_
