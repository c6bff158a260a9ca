#include "common/model/tensor.h"

#include <cstring>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/model/test_util.h"

namespace hmoe {
namespace {

using ::hmoe::testing::FakeWeightSource;
using ::testing::HasSubstr;

std::string F32Bytes(const std::vector<float>& v) {
  std::string s(v.size() * 4, '\0');
  std::memcpy(s.data(), v.data(), s.size());
  return s;
}

TEST(TensorTest, ScaleInvName) {
  EXPECT_EQ(ScaleInvName("model.layers.0.self_attn.q_a_proj.weight"),
            "model.layers.0.self_attn.q_a_proj.weight_scale_inv");
  EXPECT_EQ(ScaleInvName("model.layers.3.mlp.experts.7.down_proj.weight"),
            "model.layers.3.mlp.experts.7.down_proj.weight_scale_inv");
}

TEST(TensorTest, ScaleInvShapeRoundsUp) {
  EXPECT_EQ(ScaleInvShape({576, 7168}), (std::vector<int64_t>{5, 56}));
  EXPECT_EQ(ScaleInvShape({128, 128}), (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(ScaleInvShape({129, 257}), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(ScaleInvShape({80, 256}), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(ScaleInvShape({300}), (std::vector<int64_t>{1, 3}));
}

TEST(TensorTest, TensorViewShapeHelpers) {
  TensorView t;
  t.shape = {3, 5};
  EXPECT_EQ(t.num_elements(), 15);
  EXPECT_EQ(t.rows(), 3);
  EXPECT_EQ(t.cols(), 5);
  t.shape = {7};
  EXPECT_EQ(t.rows(), 7);
  EXPECT_EQ(t.cols(), 1);
}

TEST(GetWeightTest, Fp8WeightComesWithItsScale) {
  FakeWeightSource src;
  const std::string name = "model.layers.0.self_attn.q_a_proj.weight";
  src.AddZeros(name, DType::kF8E4M3, {200, 300});
  src.AddZeros(ScaleInvName(name), DType::kF32, {2, 3});
  absl::StatusOr<Weight> w = src.GetWeight(name);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->tensor.name, name);
  EXPECT_TRUE(w->has_scale);
  EXPECT_EQ(w->scale_inv.name, ScaleInvName(name));
  EXPECT_EQ(w->scale_inv.shape, (std::vector<int64_t>{2, 3}));
}

TEST(GetWeightTest, Bf16WeightHasNoScale) {
  FakeWeightSource src;
  src.AddZeros("w.weight", DType::kBF16, {4, 4});
  src.AddZeros("w.weight_scale_inv", DType::kF32, {1, 1});  // ignored: not FP8
  absl::StatusOr<Weight> w = src.GetWeight("w.weight");
  ASSERT_TRUE(w.ok());
  EXPECT_FALSE(w->has_scale);
}

TEST(GetWeightTest, Errors) {
  FakeWeightSource src;
  EXPECT_TRUE(absl::IsNotFound(src.GetWeight("absent.weight").status()));
  src.AddZeros("a.weight", DType::kF8E4M3, {4, 4});
  const absl::Status no_scale = src.GetWeight("a.weight").status();
  EXPECT_TRUE(absl::IsFailedPrecondition(no_scale));
  EXPECT_THAT(no_scale.message(), HasSubstr("\"a.weight_scale_inv\""));
  src.AddZeros("a.weight_scale_inv", DType::kF32, {2, 1});
  const absl::Status bad_shape = src.GetWeight("a.weight").status();
  EXPECT_TRUE(absl::IsInvalidArgument(bad_shape));
  EXPECT_THAT(bad_shape.message(), HasSubstr("has shape [2, 1], expected [1, 1]"));
  src.AddZeros("a.weight_scale_inv", DType::kBF16, {1, 1});
  EXPECT_THAT(src.GetWeight("a.weight").status().message(), HasSubstr("expected F32"));
}

TEST(DequantizeTest, PartialBlocksMatchHandComputation) {
  // [129, 257]: blocks rows {0..127, 128}, cols {0..127, 128..255, 256}.
  const int64_t rows = 129, cols = 257;
  std::string codes(rows * cols, '\0');
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) codes[i * cols + j] = static_cast<char>((i * 7 + j) % 0x7f);
  }
  codes[0] = 0x38;                 // 1.0 in block (0, 0)
  codes[127 * cols + 127] = 0x40;  // 2.0 in block (0, 0)
  codes[0 * cols + 128] = 0xc0;    // -2.0 in block (0, 1)
  codes[0 * cols + 256] = 0x7e;    // 448 in block (0, 2), partial column block
  codes[128 * cols + 0] = 0x01;    // 2^-9 in block (1, 0), partial row block
  codes[128 * cols + 256] = 0x38;  // 1.0 in block (1, 2), corner
  const std::vector<float> scales = {0.5f, 3.0f,  0.25f,  //
                                     8.0f, -1.0f, 1.5f};
  FakeWeightSource src;
  src.Add("w.weight", DType::kF8E4M3, {rows, cols}, codes);
  src.Add("w.weight_scale_inv", DType::kF32, {2, 3}, F32Bytes(scales));
  absl::StatusOr<Weight> w = src.GetWeight("w.weight");
  ASSERT_TRUE(w.ok()) << w.status();
  absl::StatusOr<std::vector<float>> out = DequantizeToFloat(*w);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), static_cast<size_t>(rows * cols));
  auto at = [&](int64_t i, int64_t j) { return (*out)[i * cols + j]; };
  EXPECT_EQ(at(0, 0), 1.0f * 0.5f);
  EXPECT_EQ(at(127, 127), 2.0f * 0.5f);
  EXPECT_EQ(at(0, 128), -2.0f * 3.0f);
  EXPECT_EQ(at(0, 256), 448.0f * 0.25f);
  EXPECT_EQ(at(128, 0), 0.001953125f * 8.0f);
  EXPECT_EQ(at(128, 256), 1.0f * 1.5f);
  // Every element: code value times the scale of its block.
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const float want = Fp8E4M3ToFloat(static_cast<uint8_t>(codes[i * cols + j])) *
                         scales[(i >= 128 ? 3 : 0) + (j >= 256   ? 2
                                                      : j >= 128 ? 1
                                                                 : 0)];
      ASSERT_EQ(at(i, j), want) << i << "," << j;
    }
  }
}

TEST(DequantizeTest, UnalignedScaleData) {
  // Scale bytes at an odd address must still be read correctly.
  std::string storage(1 + 4, '\0');
  const float s = 4.0f;
  std::memcpy(storage.data() + 1, &s, 4);
  const std::string code(1, static_cast<char>(0x38));
  Weight w;
  w.tensor = {
      "x.weight", DType::kF8E4M3, {1, 1}, reinterpret_cast<const std::byte*>(code.data()), 1};
  w.has_scale = true;
  w.scale_inv = {"x.weight_scale_inv",
                 DType::kF32,
                 {1, 1},
                 reinterpret_cast<const std::byte*>(storage.data() + 1),
                 4};
  absl::StatusOr<std::vector<float>> out = DequantizeToFloat(w);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ((*out)[0], 4.0f);
}

TEST(DequantizeTest, WrongScaleShapeNamesTensor) {
  FakeWeightSource src;
  src.AddZeros("w.weight", DType::kF8E4M3, {576, 7168});
  Weight w;
  w.tensor = *src.GetTensor("w.weight");
  w.has_scale = true;
  src.AddZeros("w.weight_scale_inv", DType::kF32, {4, 56});  // should be [5, 56]
  w.scale_inv = *src.GetTensor("w.weight_scale_inv");
  const absl::Status s = DequantizeToFloat(w).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(), HasSubstr("\"w.weight_scale_inv\""));
  EXPECT_THAT(s.message(), HasSubstr("expected [5, 56]"));
  EXPECT_THAT(s.message(), HasSubstr("\"w.weight\""));
}

TEST(DequantizeTest, WrongDataSizeIsRejected) {
  const std::string bytes(10, '\0');
  Weight w;
  w.tensor = {"w.weight",
              DType::kBF16,
              {2, 3},
              reinterpret_cast<const std::byte*>(bytes.data()),
              bytes.size()};
  const absl::Status s = DequantizeToFloat(w).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(), HasSubstr("needs 12"));
}

TEST(DequantizeTest, FloatTypesConvertDirectly) {
  FakeWeightSource src;
  const uint16_t bf16[] = {0x3f80, 0xc000, 0x4040};  // 1, -2, 3
  src.Add("b.weight", DType::kBF16, {3}, std::string(reinterpret_cast<const char*>(bf16), 6));
  const uint16_t f16[] = {0x3c00, 0x0001};  // 1, 2^-24
  src.Add("h.weight", DType::kF16, {1, 2}, std::string(reinterpret_cast<const char*>(f16), 4));
  src.Add("f.weight", DType::kF32, {2, 1}, F32Bytes({0.25f, -8.0f}));
  EXPECT_EQ(*DequantizeToFloat(*src.GetWeight("b.weight")), (std::vector<float>{1, -2, 3}));
  EXPECT_EQ(*DequantizeToFloat(*src.GetWeight("h.weight")),
            (std::vector<float>{1, std::ldexp(1.0f, -24)}));
  EXPECT_EQ(*DequantizeToFloat(*src.GetWeight("f.weight")), (std::vector<float>{0.25f, -8.0f}));
  src.AddZeros("i.weight", DType::kI32, {2});
  EXPECT_THAT(DequantizeToFloat(*src.GetWeight("i.weight")).status().message(),
              HasSubstr("\"i.weight\""));
}

}  // namespace
}  // namespace hmoe
