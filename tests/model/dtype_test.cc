#include "common/model/dtype.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace hmoe {
namespace {

using ::testing::HasSubstr;

// E4M3FN decoded independently of the implementation: the code's magnitude is an integer
// multiple of 2^-9 (subnormals m * 2^-9, normals (8 + m) * 2^(e - 10)).
double ReferenceE4M3(uint8_t code) {
  const int e = (code >> 3) & 0xf;
  const int m = code & 0x7;
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  if (e == 0) return sign * m / 512.0;
  double v = 8 + m;
  for (int i = 0; i < e - 10; ++i) v *= 2;
  for (int i = 0; i < 10 - e; ++i) v /= 2;
  return sign * v;
}

TEST(Fp8E4M3Test, AllCodesMatchReferenceFormula) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    const float got = Fp8E4M3ToFloat(code);
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
      continue;
    }
    EXPECT_FALSE(std::isnan(got)) << "code " << c;
    EXPECT_EQ(static_cast<double>(got), ReferenceE4M3(code)) << "code " << c;
    EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "code " << c;
  }
}

TEST(Fp8E4M3Test, KnownCodes) {
  EXPECT_EQ(Fp8E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0xfe), -448.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), 0.001953125f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x07), 7.0f / 512.0f);  // largest subnormal
  EXPECT_EQ(Fp8E4M3ToFloat(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(Fp8E4M3ToFloat(0x38), 1.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x40), 2.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0xc0), -2.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x77), 240.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0x78), 256.0f);  // e = 15, m = 0 is finite in E4M3FN
  EXPECT_EQ(Fp8E4M3ToFloat(0x00), 0.0f);
  EXPECT_FALSE(std::signbit(Fp8E4M3ToFloat(0x00)));
  EXPECT_TRUE(std::signbit(Fp8E4M3ToFloat(0x80)));
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(0x7f)));
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(0xff)));
  EXPECT_EQ(Fp8E4M3Table()[0x38], 1.0f);
}

TEST(Fp8E4M3Test, EncodeRoundTripsEveryFiniteCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;
    EXPECT_EQ(FloatToFp8E4M3(Fp8E4M3ToFloat(static_cast<uint8_t>(c))), c) << "code " << c;
  }
}

TEST(Fp8E4M3Test, EncodeTiesGoToEvenMantissa) {
  // Between every pair of adjacent non-negative codes: the midpoint goes to the even code, a
  // value just off the midpoint to the nearer one. Midpoints are exact in float.
  for (int c = 0; c < 0x7e; ++c) {
    const float lo = Fp8E4M3ToFloat(static_cast<uint8_t>(c));
    const float hi = Fp8E4M3ToFloat(static_cast<uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;
    ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(lo) + hi) / 2);
    const int even = (c % 2 == 0) ? c : c + 1;
    EXPECT_EQ(FloatToFp8E4M3(mid), even) << "between " << c << " and " << c + 1;
    EXPECT_EQ(FloatToFp8E4M3(-mid), 0x80 | even);
    EXPECT_EQ(FloatToFp8E4M3(std::nextafter(mid, 0.0f)), c);
    EXPECT_EQ(FloatToFp8E4M3(std::nextafter(mid, 1000.0f)), c + 1);
  }
  EXPECT_EQ(FloatToFp8E4M3(std::ldexp(1.0f, -10)), 0x00);      // half of the smallest subnormal
  EXPECT_EQ(FloatToFp8E4M3(3 * std::ldexp(1.0f, -10)), 0x02);  // 1.5 * 2^-9 -> 2 * 2^-9
  EXPECT_EQ(FloatToFp8E4M3(1e-30f), 0x00);
  EXPECT_EQ(FloatToFp8E4M3(-1e-30f), 0x80);
}

TEST(Fp8E4M3Test, EncodeSaturatesAndMapsNaN) {
  EXPECT_EQ(FloatToFp8E4M3(448.0f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(464.0f), 0x7e);  // halfway to the (absent) next step
  EXPECT_EQ(FloatToFp8E4M3(1e9f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(-1e9f), 0xfe);
  EXPECT_EQ(FloatToFp8E4M3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(FloatToFp8E4M3(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(FloatToFp8E4M3(436.0f), 0x7e);  // nearer 448 than 416
  EXPECT_EQ(FloatToFp8E4M3(432.0f), 0x7e);  // tie 416/448 -> even mantissa (448 = m 6)
  EXPECT_EQ(FloatToFp8E4M3(420.0f), 0x7d);
}

// BF16 reference: the nearest of the two BF16 neighbours, ties to the even one, in double.
uint16_t ReferenceBf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t down = static_cast<uint16_t>(u >> 16);
  if ((u & 0xffff) == 0) return down;
  const uint16_t up = static_cast<uint16_t>(down + 1);
  const double x = f;
  const double d_down = std::fabs(x - static_cast<double>(Bf16ToFloat(down)));
  // The upper neighbour may be infinity: then compare with the value it would have.
  const double up_value = (up & 0x7f80) == 0x7f80 ? std::ldexp(std::copysign(1.0, x), 128)
                                                  : static_cast<double>(Bf16ToFloat(up));
  const double d_up = std::fabs(up_value - x);
  if (d_down < d_up) return down;
  if (d_up < d_down) return up;
  return (down & 1) ? up : down;
}

TEST(Bf16Test, DecodeIsExactShift) {
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(Bf16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(Bf16ToFloat(0x0001), std::ldexp(1.0f, -133));  // smallest subnormal
  EXPECT_TRUE(std::isinf(Bf16ToFloat(0x7f80)));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(0x7fc0)));
}

TEST(Bf16Test, EncodeRoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie -> even (down)
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(FloatToBf16(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f)), 0x3f81);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds to inf
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
}

TEST(Bf16Test, EncodeMatchesReferenceOnSampledFloats) {
  for (uint64_t u = 0; u <= 0xffffffffu; u += 9973) {
    const float f = std::bit_cast<float>(static_cast<uint32_t>(u));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBf16(f), ReferenceBf16(f)) << std::hex << "bits 0x" << u;
  }
}

TEST(Bf16Test, NaNStaysNaN) {
  // Quiet, signalling (payload only in the low half, which truncation would turn into inf) and
  // negative NaNs.
  for (uint32_t bits : {0x7fc00000u, 0x7f800001u, 0x7fbfffffu, 0xff800001u, 0xffc12345u}) {
    const uint16_t b = FloatToBf16(std::bit_cast<float>(bits));
    EXPECT_TRUE(std::isnan(Bf16ToFloat(b))) << std::hex << bits << " -> " << b;
    EXPECT_EQ(b & 0x8000, (bits >> 16) & 0x8000);
  }
}

// IEEE half decoded independently: integer mantissa times a power of two.
double ReferenceF16(uint16_t h) {
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 0x1f) {
    return m == 0 ? sign * std::numeric_limits<double>::infinity()
                  : std::numeric_limits<double>::quiet_NaN();
  }
  if (e == 0) return sign * std::ldexp(static_cast<double>(m), -24);
  return sign * std::ldexp(static_cast<double>(1024 + m), e - 25);
}

TEST(F16Test, DecodeAllCodes) {
  for (int c = 0; c < 65536; ++c) {
    const auto h = static_cast<uint16_t>(c);
    const float got = F16ToFloat(h);
    const double want = ReferenceF16(h);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << c;
      EXPECT_EQ(std::signbit(got), (c & 0x8000) != 0) << c;
    }
  }
  EXPECT_EQ(F16ToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(F16ToFloat(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(F16ToFloat(0x0400), std::ldexp(1.0f, -14));
  EXPECT_EQ(F16ToFloat(0x3c00), 1.0f);
  EXPECT_EQ(F16ToFloat(0x7bff), 65504.0f);
}

TEST(F16Test, EncodeRoundTripsEveryNonNaNCode) {
  for (int c = 0; c < 65536; ++c) {
    const auto h = static_cast<uint16_t>(c);
    if (std::isnan(ReferenceF16(h))) {
      EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(F16ToFloat(h))))) << c;
      continue;
    }
    EXPECT_EQ(FloatToF16(F16ToFloat(h)), h) << c;
  }
}

TEST(F16Test, EncodeRoundsToNearestEven) {
  EXPECT_EQ(FloatToF16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(65520.0f), 0x7c00);  // tie with the next step (65536) -> inf
  EXPECT_EQ(FloatToF16(1e10f), 0x7c00);
  EXPECT_EQ(FloatToF16(-1e10f), 0xfc00);
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -25)), 0x0000);      // half the smallest subnormal
  EXPECT_EQ(FloatToF16(3 * std::ldexp(1.0f, -25)), 0x0002);  // 1.5 -> 2 subnormal steps
  EXPECT_EQ(FloatToF16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(FloatToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie -> even
  EXPECT_EQ(FloatToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie -> even
  // Largest subnormal-to-normal boundary: 1023.5 * 2^-24 ties to 1024 * 2^-24 = 2^-14.
  EXPECT_EQ(FloatToF16(1023.5f * std::ldexp(1.0f, -24)), 0x0400);
  EXPECT_EQ(FloatToF16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToF16(std::numeric_limits<float>::quiet_NaN()) & 0x7c00, 0x7c00);
  EXPECT_NE(FloatToF16(std::numeric_limits<float>::quiet_NaN()) & 0x03ff, 0);
}

TEST(DTypeTest, NamesSizesAndParsing) {
  const std::pair<DType, size_t> types[] = {
      {DType::kF8E4M3, 1}, {DType::kBF16, 2}, {DType::kF16, 2},  {DType::kF32, 4},
      {DType::kF64, 8},    {DType::kI8, 1},   {DType::kU8, 1},   {DType::kI16, 2},
      {DType::kI32, 4},    {DType::kI64, 8},  {DType::kBool, 1}, {DType::kF8E5M2, 1}};
  for (const auto& [t, size] : types) {
    EXPECT_EQ(DTypeSize(t), size) << DTypeName(t);
    absl::StatusOr<DType> parsed = ParseDType(DTypeName(t));
    ASSERT_TRUE(parsed.ok()) << DTypeName(t);
    EXPECT_EQ(*parsed, t);
  }
  EXPECT_EQ(DTypeName(DType::kF8E4M3), "F8_E4M3");
  EXPECT_EQ(DTypeName(DType::kBF16), "BF16");
  const absl::StatusOr<DType> bad = ParseDType("Q4_K");
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status()));
  EXPECT_THAT(bad.status().message(), HasSubstr("\"Q4_K\""));
  EXPECT_FALSE(ParseDType("bf16").ok());  // case-sensitive, as the format
}

TEST(ConvertToFloatTest, AllFloatTypesFromUnalignedSource) {
  // One byte of offset makes every multi-byte element unaligned.
  std::vector<uint8_t> buf(1 + 8 * 3);
  auto check = [&](DType t, const std::vector<float>& want) {
    std::vector<float> got(want.size());
    ASSERT_TRUE(ConvertToFloat(t, buf.data() + 1, want.size(), got.data()).ok());
    EXPECT_EQ(got, want) << DTypeName(t);
  };
  const uint8_t fp8[] = {0x38, 0xc0, 0x7e};
  std::memcpy(buf.data() + 1, fp8, 3);
  check(DType::kF8E4M3, {1.0f, -2.0f, 448.0f});
  const uint16_t bf16[] = {0x3f80, 0xc040, 0x0000};
  std::memcpy(buf.data() + 1, bf16, 6);
  check(DType::kBF16, {1.0f, -3.0f, 0.0f});
  const uint16_t f16[] = {0x3c00, 0xc200, 0x0001};
  std::memcpy(buf.data() + 1, f16, 6);
  check(DType::kF16, {1.0f, -3.0f, std::ldexp(1.0f, -24)});
  const float f32[] = {1.5f, -0.25f, 1e30f};
  std::memcpy(buf.data() + 1, f32, 12);
  check(DType::kF32, {1.5f, -0.25f, 1e30f});
  const double f64[] = {1.5, -0.25, 3.0};
  std::memcpy(buf.data() + 1, f64, 24);
  check(DType::kF64, {1.5f, -0.25f, 3.0f});
}

TEST(ConvertToFloatTest, RejectsIntegerTypes) {
  float out = 0;
  const int32_t v = 1;
  const absl::Status s = ConvertToFloat(DType::kI32, &v, 1, &out);
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(), HasSubstr("I32"));
}

TEST(BlockDTypeTest, SizesAndGgmlIdsOfTheGgufBlockTypes) {
  EXPECT_TRUE(IsBlockDType(DType::kQ4_K));
  EXPECT_FALSE(IsBlockDType(DType::kBF16));
  EXPECT_EQ(DTypeSize(DType::kQ4_K), 0u);  // no per-element size
  EXPECT_EQ(DTypeBlockElements(DType::kQ4_K), 256);
  EXPECT_EQ(DTypeBytes(DType::kQ4_K, 512), 288u);
  EXPECT_EQ(DTypeBytes(DType::kQ6_K, 256), 210u);
  EXPECT_EQ(DTypeBytes(DType::kQ8_0, 64), 68u);
  EXPECT_EQ(DTypeBytes(DType::kQ5_0, 32), 22u);
  EXPECT_EQ(DTypeBytes(DType::kQ5_K, 256), 176u);
  EXPECT_EQ(DTypeBytes(DType::kBF16, 3), 6u);
  uint64_t bytes = 0;
  EXPECT_TRUE(TensorBytes(DType::kQ4_K, std::vector<int64_t>{3, 512}, &bytes));
  EXPECT_EQ(bytes, 3u * 288u);
  EXPECT_FALSE(TensorBytes(DType::kQ4_K, std::vector<int64_t>{3, 300}, &bytes));  // not whole
  EXPECT_TRUE(TensorBytes(DType::kF32, std::vector<int64_t>{2, 3}, &bytes));
  EXPECT_EQ(bytes, 24u);
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16, DType::kQ8_0, DType::kQ5_0, DType::kQ4_K,
                  DType::kQ5_K, DType::kQ6_K}) {
    auto back = DTypeOfGgmlTypeId(static_cast<uint32_t>(GgmlTypeIdOf(t)));
    ASSERT_TRUE(back.ok()) << DTypeName(t);
    EXPECT_EQ(*back, t);
  }
  EXPECT_EQ(GgmlTypeIdOf(DType::kF8E4M3), -1);
  const auto q4_0 = DTypeOfGgmlTypeId(2);
  EXPECT_TRUE(absl::IsInvalidArgument(q4_0.status()));
  EXPECT_THAT(q4_0.status().message(), HasSubstr("Q4_0"));
  EXPECT_EQ(DTypeName(DType::kQ6_K), "Q6_K");
  EXPECT_FALSE(ParseDType("Q4_K").ok());  // never a safetensors dtype
}

}  // namespace
}  // namespace hmoe
