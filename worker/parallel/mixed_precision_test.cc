#include "worker/parallel/mixed_precision.h"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace cohort {
namespace {

float Rounded(Precision p, float v) {
  RoundInPlace(p, absl::MakeSpan(&v, 1));
  return v;
}

TEST(MixedPrecisionTest, ParsesTheThreeNamesAndRejectsOthers) {
  for (absl::string_view name : {"f32", "bf16", "fp16"}) {
    absl::StatusOr<Precision> p = ParsePrecision(name);
    ASSERT_TRUE(p.ok()) << name;
    EXPECT_EQ(PrecisionName(*p), name);
  }
  absl::StatusOr<Precision> bad = ParsePrecision("fp8");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("f32, bf16 or fp16"),
            absl::string_view::npos);
}

TEST(MixedPrecisionTest, RoundsToNearestEvenAtTheSignificandsEnd) {
  // bf16 keeps 8 significant bits: 1 + 2^-8 is halfway between 1 and
  // 1 + 2^-7 and goes to the even one, 1; 1 + 3 * 2^-9 is above half.
  EXPECT_EQ(Rounded(Precision::kBF16, 1.0f + std::ldexp(1.0f, -8)), 1.0f);
  EXPECT_EQ(Rounded(Precision::kBF16, 1.0f + 3 * std::ldexp(1.0f, -9)),
            1.0f + std::ldexp(1.0f, -7));
  // fp16 keeps 11.
  EXPECT_EQ(Rounded(Precision::kF16, 1.0f + std::ldexp(1.0f, -11)), 1.0f);
  EXPECT_EQ(Rounded(Precision::kF16, 1.0f + 3 * std::ldexp(1.0f, -12)),
            1.0f + std::ldexp(1.0f, -10));
  // f32 is left alone.
  const float odd = 1.0f + std::ldexp(1.0f, -23);
  EXPECT_EQ(Rounded(Precision::kF32, odd), odd);
}

TEST(MixedPrecisionTest, Fp16OverflowsToInfinityAndKeepsSubnormals) {
  EXPECT_EQ(Rounded(Precision::kF16, 65504.0f), 65504.0f);
  // 65520 is halfway to 2^16, which fp16 cannot hold: the even neighbour
  // is the overflow.
  EXPECT_TRUE(std::isinf(Rounded(Precision::kF16, 65520.0f)));
  EXPECT_TRUE(std::isinf(Rounded(Precision::kF16, -1e6f)));
  EXPECT_EQ(Rounded(Precision::kF16, std::ldexp(1.0f, -24)),
            std::ldexp(1.0f, -24));
  EXPECT_EQ(Rounded(Precision::kF16, std::ldexp(1.0f, -26)), 0.0f);
  // bf16 has f32's range.
  EXPECT_TRUE(std::isfinite(Rounded(Precision::kBF16, 1e38f)));
  EXPECT_TRUE(std::isnan(
      Rounded(Precision::kBF16, std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::isnan(
      Rounded(Precision::kF16, std::numeric_limits<float>::quiet_NaN())));
}

// The bound the trainer's tests rely on: |round(x) - x| <= u|x| + s, over
// values across fp16's whole range, subnormals included.
TEST(MixedPrecisionTest, RoundingErrorIsWithinUnitRoundoffPlusSubnormalSpacing) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> exponent(-30.0, 15.9);
  for (Precision p : {Precision::kBF16, Precision::kF16, Precision::kF32}) {
    std::vector<float> x(20000);
    for (float& v : x) {
      v = static_cast<float>(std::exp2(exponent(rng)) *
                             ((rng() & 1) != 0 ? 1 : -1));
    }
    std::vector<float> r(x.size());
    RoundCopy(p, x, absl::MakeSpan(r));
    double worst = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const double error = std::abs(static_cast<double>(r[i]) - x[i]);
      const double bound =
          UnitRoundoff(p) * std::abs(x[i]) + SubnormalSpacing(p);
      ASSERT_LE(error, bound) << PrecisionName(p) << " x=" << x[i];
      worst = std::max(worst, error / (bound));
    }
    // The bound is attained to within a factor of 2 somewhere: it is the
    // precision's, not a looser one.
    if (p != Precision::kF32) {
      EXPECT_GT(worst, 0.5) << PrecisionName(p);
    }
  }
}

}  // namespace
}  // namespace cohort
