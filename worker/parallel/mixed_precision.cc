#include "worker/parallel/mixed_precision.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "worker/collective/reduce.h"

namespace cohort {
namespace {

constexpr absl::string_view kNames[] = {"f32", "bf16", "fp16"};

float Round(Precision precision, float value) {
  switch (precision) {
    case Precision::kBF16:
      return BFloat16ToFloat(FloatToBFloat16(value));
    case Precision::kF16:
      return HalfToFloat(FloatToHalf(value));
    case Precision::kF32:
      break;
  }
  return value;
}

}  // namespace

absl::StatusOr<Precision> ParsePrecision(absl::string_view name) {
  for (size_t i = 0; i < std::size(kNames); ++i) {
    if (name == kNames[i]) return static_cast<Precision>(i);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown precision '", name, "'; expected f32, bf16 or fp16"));
}

absl::string_view PrecisionName(Precision precision) {
  return kNames[static_cast<int>(precision)];
}

double UnitRoundoff(Precision precision) {
  switch (precision) {
    case Precision::kBF16:
      return std::ldexp(1.0, -8);
    case Precision::kF16:
      return std::ldexp(1.0, -11);
    case Precision::kF32:
      break;
  }
  return std::ldexp(1.0, -24);
}

double SubnormalSpacing(Precision precision) {
  // Half the smallest subnormal: 2^-24 / 2 for fp16, 2^-149 / 2 for f32
  // and bf16 (whose exponent range is f32's, and whose smallest subnormal
  // is 2^-133: half of it is the bound).
  switch (precision) {
    case Precision::kF16:
      return std::ldexp(1.0, -25);
    case Precision::kBF16:
      return std::ldexp(1.0, -134);
    case Precision::kF32:
      break;
  }
  return std::ldexp(1.0, -150);
}

void RoundInPlace(Precision precision, absl::Span<float> values) {
  if (precision == Precision::kF32) return;
  for (float& v : values) v = Round(precision, v);
}

void RoundCopy(Precision precision, absl::Span<const float> src,
               absl::Span<float> dst) {
  if (dst.size() != src.size()) {
    std::fprintf(stderr, "RoundCopy: %zu source values into %zu\n", src.size(),
                 dst.size());
    std::abort();
  }
  for (size_t i = 0; i < src.size(); ++i) dst[i] = Round(precision, src[i]);
}

}  // namespace cohort
