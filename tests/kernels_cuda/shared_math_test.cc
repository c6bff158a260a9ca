#include "common/kernels/shared_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include "common/engine/reference/reference_ops.h"
#include "common/model/dtype.h"
#include "common/model/model_config.h"

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

TEST(SharedMathTest, F16DecodeMatchesModelDtypeForAllCodes) {
  for (uint32_t code = 0; code < 65536; ++code) {
    const float want = F16ToFloat(static_cast<uint16_t>(code));
    const float got = F16BitsToFloat(static_cast<uint16_t>(code));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << "code=" << code;
    } else {
      ASSERT_EQ(FloatToBits(got), FloatToBits(want)) << "code=" << code;
    }
  }
}

TEST(SharedMathTest, LoadElementAsFloatReadsEveryTypeAtAnyAlignment) {
  // Each value stored at an odd byte offset.
  alignas(8) unsigned char buf[32] = {};
  const float f = -3.25f;
  std::memcpy(buf + 1 + 4 * 2, &f, 4);
  EXPECT_EQ(LoadElementAsFloat(ElemType::kF32, buf + 1, 2), f);
  const uint16_t b = FloatToBf16(1.5f);
  std::memcpy(buf + 3 + 2 * 3, &b, 2);
  EXPECT_EQ(LoadElementAsFloat(ElemType::kBF16, buf + 3, 3), 1.5f);
  const uint16_t h = FloatToF16(-0.375f);
  std::memcpy(buf + 5 + 2 * 1, &h, 2);
  EXPECT_EQ(LoadElementAsFloat(ElemType::kF16, buf + 5, 1), -0.375f);
  buf[7 + 4] = 0x40;  // FP8 2.0, unscaled
  EXPECT_EQ(LoadElementAsFloat(ElemType::kF8E4M3, buf + 7, 4), 2.0f);
}

TEST(SharedMathTest, WeightElementHonorsRowStrideAndBlockScales) {
  // A 260 x 300 FP8 matrix in a 320-column buffer: element (r, c) = code(r, c) * scale(r/128,
  // c/128).
  const int64_t rows = 260, cols = 300, stride = 320, scale_stride = 3;
  std::vector<uint8_t> codes(rows * stride);
  std::mt19937 rng(7);
  for (auto& code : codes) {
    code = static_cast<uint8_t>(rng() & 0xff);
    if ((code & 0x7f) == 0x7f) code = 0x38;  // no NaN codes
  }
  std::vector<float> scales(3 * scale_stride);
  for (size_t i = 0; i < scales.size(); ++i) scales[i] = 0.25f * static_cast<float>(i + 1);
  for (int64_t r = 0; r < rows; r += 37) {
    for (int64_t c = 0; c < cols; c += 29) {
      const float want =
          Fp8E4M3ToFloat(codes[r * stride + c]) * scales[(r / 128) * scale_stride + c / 128];
      EXPECT_EQ(
          WeightElement(ElemType::kF8E4M3, codes.data(), stride, scales.data(), scale_stride, r, c),
          want)
          << r << "," << c;
    }
  }
  // BF16 and F32: plain strided reads.
  std::vector<uint16_t> bf(4 * 5);
  std::vector<float> f32(4 * 5);
  for (int i = 0; i < 20; ++i) {
    f32[i] = static_cast<float>(i) - 7.5f;
    bf[i] = FloatToBf16(f32[i]);
  }
  EXPECT_EQ(WeightElement(ElemType::kBF16, bf.data(), 5, nullptr, 0, 3, 2), f32[17]);
  EXPECT_EQ(WeightElement(ElemType::kF32, f32.data(), 5, nullptr, 0, 2, 4), f32[14]);
}

std::vector<float> RandomVector(std::mt19937& rng, int64_t n, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

TEST(SharedMathTest, RmsNormHelpersMatchReference) {
  std::mt19937 rng(11);
  for (int64_t dim : {1, 7, 512, 7168}) {
    const std::vector<float> x = RandomVector(rng, dim, 3.0f);
    const std::vector<float> w = RandomVector(rng, dim, 1.0f);
    std::vector<float> want(dim);
    reference::RmsNorm(x, w, 1e-6f, want);
    double sum = 0.0;  // the kernel's per-thread partial sums are doubles too
    for (float v : x) sum += static_cast<double>(v) * v;
    const float inv = RmsNormInvRms(sum, dim, 1e-6f);
    for (int64_t i = 0; i < dim; ++i) {
      EXPECT_NEAR(RmsNormApply(x[i], inv, w[i]), want[i], 1e-6f * (1.0f + std::abs(want[i])))
          << "dim=" << dim << " i=" << i;
    }
  }
}

TEST(SharedMathTest, RopeHelpersMatchReferenceWithYarn) {
  ModelConfig config;
  config.qk_rope_head_dim = 64;
  config.rope_theta = 10000.0;
  config.rope_scaling.enabled = true;
  config.rope_scaling.factor = 40.0;
  config.rope_scaling.mscale = 1.0;
  config.rope_scaling.mscale_all_dim = 1.0;
  const std::vector<float> inv_freq = reference::YarnInvFreq(config);
  const float af = static_cast<float>(reference::YarnAttentionFactor(config)) * 1.25f;
  std::mt19937 rng(3);
  for (int64_t pos : {int64_t{0}, int64_t{1}, int64_t{4095}, int64_t{163839}}) {
    std::vector<float> want = RandomVector(rng, 64, 1.0f);
    std::vector<float> got = want;
    reference::ApplyRopeInterleaved(want, pos, inv_freq, af);
    for (size_t i = 0; i < inv_freq.size(); ++i) {
      double c = 0.0, s = 0.0;
      RopeCosSin(pos, inv_freq[i], af, &c, &s);
      RopeRotatePair(&got[2 * i], &got[2 * i + 1], c, s);
    }
    for (size_t i = 0; i < got.size(); ++i) {
      // Same double math as the reference: equal up to the last float rounding.
      EXPECT_NEAR(got[i], want[i], 1e-6f * (1.0f + std::abs(want[i]))) << pos << " " << i;
    }
  }
}

// Softmax-weighted sum of `values` rows ([n][width]) with the online step over tiles of `tile`
// scores, the way the MLA kernel consumes it.
std::vector<float> OnlineWeightedSum(const std::vector<float>& scores,
                                     const std::vector<float>& values, int64_t width,
                                     int64_t tile) {
  const int64_t n = static_cast<int64_t>(scores.size());
  std::vector<float> acc(width, 0.0f);
  float running_max = NegInfinity();
  float running_sum = 0.0f;
  for (int64_t k0 = 0; k0 < n; k0 += tile) {
    // The kernel always passes a full tile; entries past the end are -infinity.
    std::vector<float> p(tile, NegInfinity());
    for (int64_t j = 0; j < tile && k0 + j < n; ++j) p[j] = scores[k0 + j];
    const float correction = OnlineSoftmaxStep(&running_max, &running_sum, p.data(), tile);
    for (float& a : acc) a *= correction;
    for (int64_t j = 0; j < tile && k0 + j < n; ++j) {
      for (int64_t c = 0; c < width; ++c) acc[c] += p[j] * values[(k0 + j) * width + c];
    }
  }
  for (float& a : acc) a /= running_sum;
  return acc;
}

TEST(SharedMathTest, OnlineSoftmaxStepMatchesReferenceSoftmax) {
  std::mt19937 rng(5);
  const int64_t width = 3;
  for (int64_t n : {1, 5, 16, 17, 100}) {
    for (int64_t tile : {1, 4, 16}) {
      std::vector<float> scores = RandomVector(rng, n, 4.0f);
      // Mask a prefix (a fully masked first tile when n > tile) and some scattered entries,
      // keeping the last entry visible.
      for (int64_t i = 0; i + 1 < n; ++i) {
        if (i < tile || i % 3 == 1) scores[i] = -std::numeric_limits<float>::infinity();
      }
      scores[n / 2] = 30.0f;  // a large maximum in the middle forces a rescale
      const std::vector<float> values = RandomVector(rng, n * width, 1.0f);
      std::vector<float> p = scores;
      reference::Softmax(p);
      const std::vector<float> got = OnlineWeightedSum(scores, values, width, tile);
      for (int64_t c = 0; c < width; ++c) {
        double want = 0.0;
        for (int64_t i = 0; i < n; ++i) want += static_cast<double>(p[i]) * values[i * width + c];
        EXPECT_NEAR(got[c], want, 1e-5 * (1.0 + std::abs(want)))
            << "n=" << n << " tile=" << tile << " c=" << c;
      }
    }
  }
}

// A host mirror of the CUDA MLA path (cuda_device.cc RunMlaAttention + mla_attention.cu): q~ per
// head, rows (query, head) grouped in tiles of up to 16 rows of one sequence, keys walked in tiles
// of 16 with the causal mask k <= pos and OnlineSoftmaxStep, then out = W_UV u. Checked against
// the reference's absorbed and naive forms, including tiles that straddle the causal diagonal.
TEST(SharedMathTest, TiledAbsorbedMlaMirrorMatchesReference) {
  constexpr int64_t kTileRows = 16, kKeyTile = 16;
  MlaDimensions d;
  d.num_heads = 3;
  d.nope_dim = 8;
  d.rope_dim = 4;
  d.v_dim = 6;
  d.kv_lora_rank = 10;
  d.softmax_scale = 0.3f;
  const int64_t start_pos = 21, n = 13, keys = start_pos + n;
  const int64_t nh = d.num_heads, dn = d.nope_dim, dr = d.rope_dim, dv = d.v_dim;
  const int64_t rkv = d.kv_lora_rank, row_floats = rkv + dr;
  std::mt19937 rng(9);
  const std::vector<float> q_nope = RandomVector(rng, n * nh * dn, 1.0f);
  const std::vector<float> q_pe = RandomVector(rng, n * nh * dr, 1.0f);
  const std::vector<float> latent = RandomVector(rng, keys * rkv, 1.0f);
  const std::vector<float> k_pe = RandomVector(rng, keys * dr, 1.0f);
  const std::vector<float> wkv_b = RandomVector(rng, nh * (dn + dv) * rkv, 0.3f);
  std::vector<float> want(n * nh * dv), want_naive(n * nh * dv);
  reference::MlaAttentionAbsorbed(d, n, start_pos, q_nope, q_pe, latent, k_pe, wkv_b, want);
  reference::MlaAttentionNaive(d, n, start_pos, q_nope, q_pe, latent, k_pe, wkv_b, want_naive);

  // qcat[t][h] = [W_UK_h^T q_nope | q_pe]; cache rows [c | k_pe].
  std::vector<float> qcat(n * nh * row_floats);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < nh; ++h) {
      float* qc = &qcat[(t * nh + h) * row_floats];
      for (int64_t r = 0; r < rkv; ++r) {
        double sum = 0.0;
        for (int64_t i = 0; i < dn; ++i) {
          sum += static_cast<double>(wkv_b[(h * (dn + dv) + i) * rkv + r]) *
                 q_nope[(t * nh + h) * dn + i];
        }
        qc[r] = static_cast<float>(sum);
      }
      for (int64_t i = 0; i < dr; ++i) qc[rkv + i] = q_pe[(t * nh + h) * dr + i];
    }
  }
  std::vector<float> cache(keys * row_floats);
  for (int64_t s = 0; s < keys; ++s) {
    std::copy_n(&latent[s * rkv], rkv, &cache[s * row_floats]);
    std::copy_n(&k_pe[s * dr], dr, &cache[s * row_floats + rkv]);
  }

  for (int64_t queries_per_tile : {1, 5, 16}) {
    const int64_t heads_per_tile = std::min(nh, std::max<int64_t>(1, kTileRows / queries_per_tile));
    std::vector<float> u(n * nh * rkv, 0.0f);
    for (int64_t q0 = 0; q0 < n; q0 += queries_per_tile) {
      const int64_t nq = std::min(queries_per_tile, n - q0);
      for (int64_t h0 = 0; h0 < nh; h0 += heads_per_tile) {
        const int64_t nht = std::min(heads_per_tile, nh - h0);
        const int64_t rows = nq * nht;
        const int64_t first_pos = start_pos + q0;
        std::vector<float> acc(rows * rkv, 0.0f), row_max(rows, NegInfinity()), row_sum(rows, 0);
        for (int64_t k0 = 0; k0 < first_pos + nq; k0 += kKeyTile) {
          const int64_t nk = std::min(kKeyTile, first_pos + nq - k0);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t t = q0 + r / nht, h = h0 + r % nht, pos = first_pos + r / nht;
            float p[kKeyTile];
            for (int64_t j = 0; j < kKeyTile; ++j) {
              p[j] = NegInfinity();
              if (j < nk && k0 + j <= pos) {
                float dot = 0.0f;
                for (int64_t c = 0; c < row_floats; ++c) {
                  dot += qcat[(t * nh + h) * row_floats + c] * cache[(k0 + j) * row_floats + c];
                }
                p[j] = dot * d.softmax_scale;
              }
            }
            const float corr = OnlineSoftmaxStep(&row_max[r], &row_sum[r], p, kKeyTile);
            for (int64_t c = 0; c < rkv; ++c) {
              acc[r * rkv + c] *= corr;
              for (int64_t j = 0; j < nk; ++j)
                acc[r * rkv + c] += p[j] * cache[(k0 + j) * row_floats + c];
            }
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t t = q0 + r / nht, h = h0 + r % nht;
          for (int64_t c = 0; c < rkv; ++c)
            u[(t * nh + h) * rkv + c] = acc[r * rkv + c] / row_sum[r];
        }
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t h = 0; h < nh; ++h) {
        for (int64_t v = 0; v < dv; ++v) {
          double o = 0.0;
          for (int64_t c = 0; c < rkv; ++c) {
            o += static_cast<double>(wkv_b[(h * (dn + dv) + dn + v) * rkv + c]) *
                 u[(t * nh + h) * rkv + c];
          }
          const int64_t i = (t * nh + h) * dv + v;
          EXPECT_NEAR(o, want[i], 2e-5 * (1.0 + std::abs(want[i])))
              << "queries/tile " << queries_per_tile << " t=" << t << " h=" << h << " v=" << v;
          EXPECT_NEAR(o, want_naive[i], 2e-5 * (1.0 + std::abs(want_naive[i])));
        }
      }
    }
  }
}

struct GateCase {
  int64_t experts, top_k, n_group, topk_group;
  bool norm, bias, ties;
  double scale;
};

TEST(SharedMathTest, MoeGateSelectMatchesReferenceExactly) {
  const GateCase cases[] = {
      {8, 2, 1, 1, true, false, false, 1.0},    {16, 4, 4, 2, true, true, false, 2.5},
      {64, 6, 8, 3, false, true, true, 1.0},    {256, 8, 8, 4, true, true, false, 2.5},
      {256, 8, 8, 4, true, true, true, 2.5},    {12, 3, 12, 3, true, true, true, 1.0},
      {384, 8, 1, 1, true, true, false, 2.827},
  };
  std::mt19937 rng(13);
  for (const GateCase& gc : cases) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> logits = RandomVector(rng, gc.experts, 2.0f);
      std::vector<float> bias;
      if (gc.bias) bias = RandomVector(rng, gc.experts, 0.1f);
      if (gc.ties) {
        // Few distinct values: ties in expert scores and in group scores.
        for (float& l : logits) l = std::round(l);
        for (float& b : bias) b = 0.0f;
      }
      MoeGateParams p;
      p.num_experts = gc.experts;
      p.top_k = gc.top_k;
      p.n_group = gc.n_group;
      p.topk_group = gc.topk_group;
      p.norm_topk_prob = gc.norm;
      p.routed_scaling_factor = gc.scale;
      const reference::MoeGateResult want = reference::MoeGate(logits, bias, p);

      std::vector<double> scratch((MoeGateScratchBytes(gc.experts, gc.n_group) + 7) / 8);
      std::vector<int32_t> ids(gc.top_k);
      std::vector<float> weights(gc.top_k);
      MoeGateSelect(logits.data(), gc.bias ? bias.data() : nullptr, p, scratch.data(), ids.data(),
                    weights.data());
      ASSERT_EQ(ids, want.experts) << "E=" << gc.experts << " trial " << trial;
      ASSERT_EQ(weights, want.weights) << "E=" << gc.experts << " trial " << trial;
    }
  }
}
}  // namespace
}  // namespace hmoe::kernels
