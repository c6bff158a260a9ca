#include "common/kernels/shared_math.h"

#include <cmath>
#include <cstdint>

#include <gtest/gtest.h>

#include "common/model/dtype.h"

namespace hmoe::kernels {
namespace {

TEST(SharedMathTest, Fp8BitDecodeMatchesTableForAll256Codes) {
  for (int code = 0; code < 256; ++code) {
    const float want = Fp8E4M3ToFloat(static_cast<uint8_t>(code));
    const float got = Fp8E4M3ToFloatBits(static_cast<uint8_t>(code));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code=" << code;
    } else {
      EXPECT_EQ(FloatToBits(got), FloatToBits(want)) << "code=" << code;  // also +0 vs -0
    }
  }
}

TEST(SharedMathTest, Bf16RoundingMatchesModelDtype) {
  const float cases[] = {0.0f,     -0.0f,  1.0f,          1.00390625f, 1.005859375f, -3.14159f,
                         65504.0f, 1e-40f, std::nanf(""), INFINITY,    -INFINITY,    3.3895314e38f};
  for (float f : cases) {
    EXPECT_EQ(FloatToBf16Bits(f), FloatToBf16(f)) << f;
    if (!std::isnan(f)) {
      EXPECT_EQ(FloatToBits(Bf16BitsToFloat(FloatToBf16Bits(f))),
                FloatToBits(Bf16ToFloat(FloatToBf16(f))));
    }
  }
}

TEST(SharedMathTest, DequantFp8ElementUsesItsBlockScale) {
  // 2 x 3 blocks of scales; element (130, 260) lies in block (1, 2).
  const float scales[6] = {1, 2, 3, 4, 5, 6};
  const uint8_t two = 0x40;  // 2.0
  EXPECT_EQ(DequantFp8Element(two, scales, 3, 0, 0), 2.0f);
  EXPECT_EQ(DequantFp8Element(two, scales, 3, 127, 255), 4.0f);
  EXPECT_EQ(DequantFp8Element(two, scales, 3, 130, 260), 12.0f);
}

TEST(SharedMathTest, SiluMul) {
  EXPECT_FLOAT_EQ(SiluMul(0.0f, 5.0f), 0.0f);
  EXPECT_NEAR(SiluMul(1.0f, 2.0f), 2.0f / (1.0f + std::exp(-1.0f)), 1e-6);
  EXPECT_NEAR(SiluMul(-20.0f, 1.0f), -20.0f / (1.0f + std::exp(20.0f)), 1e-12);
}

}  // namespace
}  // namespace hmoe::kernels
