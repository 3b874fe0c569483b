#include "worker/collective/reduce.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace cohort {
namespace {

TEST(HalfTest, ExactValuesRoundTrip) {
  EXPECT_EQ(FloatToHalf(1.0f).bits, 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f).bits, 0xc000);
  EXPECT_EQ(FloatToHalf(65504.0f).bits, 0x7bff);
  EXPECT_EQ(FloatToHalf(0.0f).bits, 0x0000);
  EXPECT_EQ(FloatToHalf(-0.0f).bits, 0x8000);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)).bits, 0x0001);  // Subnormal.
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -14)).bits, 0x0400);  // Min normal.
  // Every finite half converts to f32 and back unchanged.
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    if ((bits & 0x7c00) == 0x7c00) continue;
    Float16 h{static_cast<uint16_t>(bits)};
    ASSERT_EQ(FloatToHalf(HalfToFloat(h)).bits, bits) << bits;
  }
}

TEST(HalfTest, RoundsToNearestEven) {
  // 1 + 2^-11 is halfway between 1 and the next half (1 + 2^-10): even wins.
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)).bits, 0x3c00);
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)).bits, 0x3c02);
  EXPECT_EQ(FloatToHalf(65519.0f).bits, 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f).bits, 0x7c00);  // Overflows to infinity.
  EXPECT_EQ(FloatToHalf(1e10f).bits, 0x7c00);
  // Halfway between the two smallest subnormals: even (zero) wins.
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)).bits, 0x0000);
  EXPECT_EQ(FloatToHalf(3 * std::ldexp(1.0f, -25)).bits, 0x0002);
}

TEST(HalfTest, InfinityAndNan) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(FloatToHalf(inf).bits, 0x7c00);
  EXPECT_EQ(FloatToHalf(-inf).bits, 0xfc00);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
  EXPECT_TRUE(std::isinf(HalfToFloat(Float16{0x7c00})));
}

TEST(BFloat16Test, ConvertsAndRounds) {
  EXPECT_EQ(FloatToBFloat16(1.0f).bits, 0x3f80);
  EXPECT_EQ(BFloat16ToFloat(BFloat16{0x3f80}), 1.0f);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: even (1) wins.
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8)).bits, 0x3f80);
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)).bits, 0x3f82);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::nanf("")))));
}

template <typename T>
std::vector<T> CombineAll(ReduceOp op, std::vector<T> a,
                          const std::vector<T>& b) {
  Combine(DtypeOf<T>(), op, a.data(), a.data(), b.data(), a.size());
  return a;
}

TEST(CombineTest, EveryOpOnIntegers) {
  const std::vector<int32_t> a = {1, -5, 7, 0};
  const std::vector<int32_t> b = {2, 3, -7, 9};
  EXPECT_EQ(CombineAll(ReduceOp::kSum, a, b),
            (std::vector<int32_t>{3, -2, 0, 9}));
  EXPECT_EQ(CombineAll(ReduceOp::kAvg, a, b),
            (std::vector<int32_t>{3, -2, 0, 9}));
  EXPECT_EQ(CombineAll(ReduceOp::kProd, a, b),
            (std::vector<int32_t>{2, -15, -49, 0}));
  EXPECT_EQ(CombineAll(ReduceOp::kMin, a, b),
            (std::vector<int32_t>{1, -5, -7, 0}));
  EXPECT_EQ(CombineAll(ReduceOp::kMax, a, b),
            (std::vector<int32_t>{2, 3, 7, 9}));
}

TEST(CombineTest, IntegersWrapAround) {
  EXPECT_EQ(CombineAll<int8_t>(ReduceOp::kSum, {127}, {1}),
            (std::vector<int8_t>{-128}));
  EXPECT_EQ(CombineAll<uint8_t>(ReduceOp::kSum, {250}, {10}),
            (std::vector<uint8_t>{4}));
  EXPECT_EQ(CombineAll<uint8_t>(ReduceOp::kProd, {16}, {17}),
            (std::vector<uint8_t>{16}));
  EXPECT_EQ(CombineAll<int64_t>(ReduceOp::kSum,
                                {std::numeric_limits<int64_t>::max()}, {1}),
            (std::vector<int64_t>{std::numeric_limits<int64_t>::min()}));
  EXPECT_EQ(CombineAll<int32_t>(ReduceOp::kProd, {65536}, {65536}),
            (std::vector<int32_t>{0}));
}

TEST(CombineTest, FloatsAndDoubles) {
  EXPECT_EQ(CombineAll<float>(ReduceOp::kSum, {1.5f, -2}, {0.25f, 8}),
            (std::vector<float>{1.75f, 6}));
  EXPECT_EQ(CombineAll<double>(ReduceOp::kProd, {1.5, -2}, {4, 0.5}),
            (std::vector<double>{6, -1}));
  EXPECT_EQ(CombineAll<double>(ReduceOp::kMax, {1.5, -2}, {4, -3}),
            (std::vector<double>{4, -2}));
}

TEST(CombineTest, HalfTypesGoThroughFloat) {
  std::vector<Float16> a = {FloatToHalf(1.5f), FloatToHalf(-3.0f)};
  std::vector<Float16> b = {FloatToHalf(2.0f), FloatToHalf(0.5f)};
  Combine(Dtype::kF16, ReduceOp::kProd, a.data(), a.data(), b.data(), 2);
  EXPECT_EQ(HalfToFloat(a[0]), 3.0f);
  EXPECT_EQ(HalfToFloat(a[1]), -1.5f);
  std::vector<BFloat16> c = {FloatToBFloat16(1.5f), FloatToBFloat16(-3.0f)};
  std::vector<BFloat16> d = {FloatToBFloat16(2.0f), FloatToBFloat16(0.5f)};
  Combine(Dtype::kBF16, ReduceOp::kMin, c.data(), c.data(), d.data(), 2);
  EXPECT_EQ(BFloat16ToFloat(c[0]), 1.5f);
  EXPECT_EQ(BFloat16ToFloat(c[1]), -3.0f);
}

TEST(CombineTest, OutputMayAliasEitherInput) {
  std::vector<int64_t> a = {1, 2};
  std::vector<int64_t> b = {10, 20};
  Combine(Dtype::kI64, ReduceOp::kSum, b.data(), a.data(), b.data(), 2);
  EXPECT_EQ(b, (std::vector<int64_t>{11, 22}));
}

TEST(DivideTest, IntegersTruncateTowardZero) {
  std::vector<int32_t> v = {3, -3, 7, -8};
  DivideInPlace(Dtype::kI32, v.data(), v.size(), 2);
  EXPECT_EQ(v, (std::vector<int32_t>{1, -1, 3, -4}));
  std::vector<uint8_t> u = {255};
  DivideInPlace(Dtype::kU8, u.data(), u.size(), 256);  // Past u8's range.
  EXPECT_EQ(u, (std::vector<uint8_t>{0}));
}

TEST(DivideTest, Floats) {
  std::vector<double> d = {3, -1};
  DivideInPlace(Dtype::kF64, d.data(), d.size(), 4);
  EXPECT_EQ(d, (std::vector<double>{0.75, -0.25}));
  std::vector<Float16> h = {FloatToHalf(3.0f)};
  DivideInPlace(Dtype::kF16, h.data(), h.size(), 2);
  EXPECT_EQ(HalfToFloat(h[0]), 1.5f);
}

TEST(WidenTest, RoundTripsThroughF32) {
  std::vector<BFloat16> b = {FloatToBFloat16(0.5f), FloatToBFloat16(-7.0f)};
  std::vector<float> f(2);
  WidenToF32(Dtype::kBF16, b.data(), f.data(), 2);
  EXPECT_EQ(f, (std::vector<float>{0.5f, -7.0f}));
  f[0] = 1.25f;
  NarrowFromF32(Dtype::kBF16, f.data(), b.data(), 2);
  EXPECT_EQ(BFloat16ToFloat(b[0]), 1.25f);
}

TEST(ConvertFloats, ScalesAndRoundsOnceBetweenFloatTypes) {
  // More than one 1024-element block, so the blocking is exercised.
  constexpr size_t kN = 2500;
  std::vector<float> f32(kN);
  for (size_t i = 0; i < kN; ++i) f32[i] = 1.0f + 0.001f * i;
  std::vector<Float16> half(kN);
  ConvertFloats(Dtype::kF16, half.data(), Dtype::kF32, f32.data(), kN, 0.5f);
  std::vector<float> back(kN);
  ConvertFloats(Dtype::kF32, back.data(), Dtype::kF16, half.data(), kN, 4.0f);
  for (size_t i = 0; i < kN; ++i) {
    ASSERT_EQ(half[i].bits, FloatToHalf(f32[i] * 0.5f).bits) << i;
    ASSERT_EQ(back[i], HalfToFloat(half[i]) * 4.0f) << i;
  }
  std::vector<BFloat16> bf(kN);
  ConvertFloats(Dtype::kBF16, bf.data(), Dtype::kF16, half.data(), kN, 1.0f);
  for (size_t i = 0; i < kN; ++i) {
    ASSERT_EQ(bf[i].bits, FloatToBFloat16(HalfToFloat(half[i])).bits) << i;
  }
}

TEST(ConvertFloats, RefusesOtherTypesAndMismatchedCounts) {
  EXPECT_TRUE(CheckFloatConversion(Dtype::kBF16, 3, Dtype::kF32, 3).ok());
  absl::Status ints = CheckFloatConversion(Dtype::kF16, 3, Dtype::kI32, 3);
  EXPECT_EQ(ints.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(ints.message().find("i32"), absl::string_view::npos);
  EXPECT_EQ(CheckFloatConversion(Dtype::kF16, 2, Dtype::kF32, 3).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cohort
