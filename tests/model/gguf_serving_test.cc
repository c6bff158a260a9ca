// Serving GGUF models (issue 18): GgufCheckpoint (the tensors under our names in their GGUF
// encoding, experts sliced in place, kv_b_proj dequantized), the CPU device's ops on GGML block
// types (Linear with Q8_K activations against an independent oracle, and with F32 activations
// against dequantize-then-F32; EmbeddingGather, MoeGate), and the resident weights the engine
// binds from a GGUF.

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/device/cpu_device.h"
#include "common/engine/reference/reference_ops.h"
#include "common/engine/weights.h"
#include "common/model/dtype.h"
#include "common/model/gguf_model.h"
#include "common/model/gguf_quants.h"
#include "common/model/gguf_source.h"
#include "common/model/tensor_map.h"
#include "common/ops/cpu/quantized_linear.h"
#include "tests/integration/temp_dir.h"
#include "tools/gguf_model_writer.h"
#include "tools/model_writer.h"

namespace hmoe {
namespace {

using ::hmoe::testing::TempDir;

std::string WriteTinyGguf(const TempDir& dir) {
  absl::StatusOr<ModelPreset> preset = GetPreset("tiny");
  EXPECT_TRUE(preset.ok());
  GgufWriteOptions o;
  o.mix = GgufQuantMix::kQ4_K_M;
  EXPECT_TRUE(WriteGgufModel(*preset, dir.path(), o).ok());
  return dir.path() + "/model.gguf";
}

std::vector<float> Dequantized(const TensorView& t) {
  std::vector<float> out(static_cast<size_t>(t.num_elements()));
  EXPECT_TRUE(ConvertToFloat(t.dtype, t.data, out.size(), out.data()).ok()) << t.name;
  return out;
}

TEST(GgufCheckpointTest, ServesEveryTensorInItsGgufEncodingUnderOurNames) {
  TempDir dir("gguf_serving");
  const std::string path = WriteTinyGguf(dir);
  auto c = GgufCheckpoint::Open(path);
  ASSERT_TRUE(c.ok()) << c.status();
  const GgufCheckpoint& g = **c;
  const ModelConfig& config = g.config();
  auto from_meta = ModelConfigFromGguf(g.model());
  ASSERT_TRUE(from_meta.ok());
  EXPECT_EQ(config.ToJson(), from_meta->ToJson());
  EXPECT_EQ(ModelConfig::FromJson(g.config_json())->ToJson(), config.ToJson());
  EXPECT_TRUE(ValidateTensors(config, g).ok()) << ValidateTensors(config, g);
  EXPECT_EQ(g.TensorNames().size(), ExpectedTensors(config).size());

  // A routed expert: a Q4_K slice of the stacked tensor, read in place, the same values as the
  // GGUF dequantization of that slice.
  const std::string gate = ExpertTensorName(1, 3, kGateProj);
  auto t = g.GetTensor(gate);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->dtype, DType::kQ4_K);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{config.moe_intermediate_size, config.hidden_size}));
  EXPECT_EQ(t->size_bytes, DTypeBytes(DType::kQ4_K, t->num_elements()));
  const GgufTensorInfo* stacked = g.model().FindTensor("blk.1.ffn_gate_exps.weight");
  ASSERT_NE(stacked, nullptr);
  EXPECT_EQ(t->data, stacked->data + 3 * t->size_bytes);
  auto loc = g.Locate(gate);
  ASSERT_TRUE(loc.ok());
  EXPECT_EQ(loc->memory, nullptr);
  EXPECT_EQ(loc->file_offset,
            g.model().file(0).data_offset() + stacked->offset + 3 * t->size_bytes);
  auto want = DequantizeHfTensor(config, g.model(), gate);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(Dequantized(*t), *want);

  // kv_b_proj: F32 in memory, rebuilt from attn_k_b + attn_v_b.
  const std::string kv_b = LayerTensorName(0, layer_tensor::kKvBProj);
  auto kv = g.GetTensor(kv_b);
  ASSERT_TRUE(kv.ok());
  EXPECT_EQ(kv->dtype, DType::kF32);
  EXPECT_NE(g.Locate(kv_b)->memory, nullptr);
  auto kv_want = DequantizeHfTensor(config, g.model(), kv_b);
  ASSERT_TRUE(kv_want.ok());
  EXPECT_EQ(Dequantized(*kv), *kv_want);

  // The embedding keeps its block type; norms are F32.
  EXPECT_TRUE(IsBlockDType(g.GetTensor(std::string(kEmbedTokensName))->dtype));
  EXPECT_EQ(g.GetTensor(std::string(kFinalNormName))->dtype, DType::kF32);
  EXPECT_EQ(g.GetTensor("model.layers.0.mlp.nope").status().code(), absl::StatusCode::kNotFound);
}

TEST(GgufCheckpointTest, MissingFileIsNotFoundAndGarbageIsInvalidArgument) {
  TempDir dir("gguf_serving");
  EXPECT_EQ(GgufCheckpoint::Open(dir.path() + "/none.gguf").status().code(),
            absl::StatusCode::kNotFound);
  const std::string bad = dir.path() + "/bad.gguf";
  FILE* f = std::fopen(bad.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  std::fputs("not a gguf at all, just text", f);
  std::fclose(f);
  auto c = GgufCheckpoint::Open(bad);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
}

TEST(GgufCheckpointTest, AnUnsupportedTypeIsInvalidArgumentNamingTheTensorAndTheType) {
  TempDir dir("gguf_serving");
  const std::string path = WriteTinyGguf(dir);
  // Q4_0 has the bytes per weight of Q4_K (18 per 32, 144 per 256): retyping one tensor's info
  // keeps the file consistent, but the type is one we do not compute with.
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::string name = "blk.1.ffn_gate_exps.weight";
  const size_t at = bytes.find(name);
  ASSERT_NE(at, std::string::npos);
  const size_t type_at = at + name.size() + 4 + 3 * 8;  // n_dims (u32), ne (3 x u64), type
  uint32_t type = 0;
  std::memcpy(&type, bytes.data() + type_at, 4);
  ASSERT_EQ(type, static_cast<uint32_t>(GgmlType::kQ4_K));
  type = static_cast<uint32_t>(GgmlType::kQ4_0);
  std::memcpy(bytes.data() + type_at, &type, 4);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  auto c = GgufCheckpoint::Open(path);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_NE(std::string(c.status().message()).find(name), std::string::npos) << c.status();
  EXPECT_NE(std::string(c.status().message()).find("Q4_0"), std::string::npos) << c.status();
}

// ---------------------------------------------------------------------------------- device ops

// A random [rows, cols] weight quantized to `dtype` (Q5_0 has no quantizer of ours: random
// blocks with a small finite scale), and its dequantized values.
struct QuantWeight {
  std::vector<std::byte> bytes;
  std::vector<float> values;
};
QuantWeight MakeWeight(DType dtype, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  QuantWeight w;
  w.bytes.resize(DTypeBytes(dtype, rows * cols));
  const uint32_t ggml = static_cast<uint32_t>(GgmlTypeIdOf(dtype));
  if (dtype == DType::kQ5_0) {
    for (std::byte& b : w.bytes) b = static_cast<std::byte>(rng());
    for (size_t i = 0; i < w.bytes.size(); i += sizeof(BlockQ5_0)) {
      const uint16_t d = FloatToF16(0.01f * static_cast<float>(1 + rng() % 8));
      std::memcpy(&w.bytes[i], &d, 2);
    }
  } else {
    std::vector<float> src(static_cast<size_t>(rows * cols));
    for (float& v : src) v = normal(rng);
    EXPECT_TRUE(QuantizeGgml(ggml, src.data(), rows * cols, w.bytes.data()).ok());
  }
  w.values.resize(static_cast<size_t>(rows * cols));
  EXPECT_TRUE(DequantizeGgml(ggml, w.bytes.data(), rows * cols, w.values.data()).ok());
  return w;
}

LinearWeight View(DType dtype, const void* data, int64_t rows, int64_t cols) {
  LinearWeight lw;
  lw.dtype = dtype;
  lw.data = data;
  lw.rows = rows;
  lw.cols = cols;
  lw.row_stride = cols;
  return lw;
}

// The offset parts b of a block type's dequantized weights (w = a - b: Q4_K/Q5_K dmin*m, Q6_K
// 32*d*sc, Q5_0 16*d; Q8_0 none), as |b| per weight: the blocks dequantized with every quant bit
// cleared give -b. Byte ranges of the quant fields (MODEL-SPEC 5.4).
std::vector<float> OffsetMagnitudes(DType dtype, const std::vector<std::byte>& bytes, int64_t n) {
  struct Range {
    int64_t begin, end;
  };
  std::vector<Range> quants;
  int64_t block_bytes = 0;
  switch (dtype) {
    case DType::kQ8_0:
      block_bytes = 34, quants = {{2, 34}};
      break;
    case DType::kQ5_0:
      block_bytes = 22, quants = {{2, 22}};
      break;
    case DType::kQ4_K:
      block_bytes = 144, quants = {{16, 144}};
      break;
    case DType::kQ5_K:
      block_bytes = 176, quants = {{16, 176}};
      break;
    case DType::kQ6_K:
      block_bytes = 210, quants = {{0, 192}};
      break;
    default:
      ADD_FAILURE() << "no block type";
      return {};
  }
  std::vector<std::byte> cleared = bytes;
  for (size_t b = 0; b < cleared.size(); b += static_cast<size_t>(block_bytes)) {
    for (const Range& r : quants) {
      std::fill(cleared.begin() + b + r.begin, cleared.begin() + b + r.end, std::byte{0});
    }
  }
  std::vector<float> out(static_cast<size_t>(n));
  EXPECT_TRUE(
      DequantizeGgml(static_cast<uint32_t>(GgmlTypeIdOf(dtype)), cleared.data(), n, out.data())
          .ok());
  for (float& v : out) v = std::fabs(v);
  return out;
}

// Whether the kernel's product y of a weight row and a Q8_K-rounded activation is the exact
// product of the dequantized weights and the dequantized activation x8 (reference::RoundToQ8K,
// which shares no code with the kernels) within the kernels' bound. quant_gemv.h: the integer
// parts are exact, F32 rounds the block scale product d_w * d_x, the conversions and the block
// sums: (cols/32 + 8) * u * S with u = 2^-24 and S = sum (|a| + |b|) * |x8| over the row (a, b:
// the quant and offset parts of each weight, w = a - b, |a| + |b| <= |w| + 2|b|); the oracle's
// own F32 dequantization (d*sc, *q, -m: at most 3 roundings of |a| + |b| per weight, as in
// tests/kernels/quant_gemv_test.cc) adds 4 * u * S: tolerance (cols/32 + 12) * u * S.
void ExpectQ8KProduct(const std::vector<float>& w_values, const std::vector<float>& offsets,
                      int64_t rows, int64_t cols, const std::vector<float>& x, int64_t n,
                      const std::vector<float>& y, const std::string& what) {
  for (int64_t t = 0; t < n; ++t) {
    const std::vector<double> x8 =
        reference::RoundToQ8K(std::span<const float>(x.data() + t * cols, cols));
    for (int64_t r = 0; r < rows; ++r) {
      double exact = 0, s = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const double wv = w_values[r * cols + c];
        exact += wv * x8[c];
        s += (std::fabs(wv) + 2.0 * offsets[r * cols + c]) * std::fabs(x8[c]);
      }
      const double tolerance = (cols / 32.0 + 12.0) * std::ldexp(1.0, -24) * s;
      ASSERT_NEAR(y[t * rows + r], exact, tolerance) << what << " token " << t << " row " << r;
    }
  }
}

class QuantizedOpsTest : public ::testing::TestWithParam<DType> {};

TEST_P(QuantizedOpsTest, LinearGatherAndGateMatchTheirOracles) {
  const DType dtype = GetParam();
  const int64_t rows = 40, cols = 512, n = 11;  // n > 8: the prefill-sized batches too
  const QuantWeight w = MakeWeight(dtype, rows, cols, 7);
  CpuDeviceOptions f32_options;
  f32_options.quant_activations = cpu::QuantActivations::kF32;
  std::unique_ptr<Device> f32_dev = NewCpuDevice(f32_options);
  CpuDeviceOptions q8k_options;
  q8k_options.quant_activations = cpu::QuantActivations::kQ8K;
  std::unique_ptr<Device> q8k_dev = NewCpuDevice(q8k_options);
  std::unique_ptr<Device>& dev = f32_dev;
  auto stream = dev->CreateStream();
  ASSERT_TRUE(stream.ok());
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n * cols));
  for (float& v : x) v = normal(rng);

  // Linear with F32 activations: within the F32 rounding of a dot product of the dequantized row
  // (bound: cols * eps times sum |w x|, a loose form of the summation error bound).
  std::vector<float> y(static_cast<size_t>(n * rows), NAN);
  ASSERT_TRUE(dev->Linear(**stream, View(dtype, w.bytes.data(), rows, cols), x.data(), cols, n,
                          y.data(), rows)
                  .ok());
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t r = 0; r < rows; ++r) {
      double exact = 0, magnitude = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const double p = static_cast<double>(w.values[r * cols + c]) * x[t * cols + c];
        exact += p;
        magnitude += std::fabs(p);
      }
      ASSERT_NEAR(y[t * rows + r], exact, cols * 1.2e-7 * magnitude + 1e-30)
          << DTypeName(dtype) << " token " << t << " row " << r;
    }
  }

  // Linear with Q8_K activations (the default for block types; F16 has no kernel and keeps the
  // F32 path): every batch size through MatVec (n <= 8) and GemmRows, and a second product of
  // the same input bytes (reused blocks), then of changed bytes at the same address (not reused).
  if (IsBlockDType(dtype)) {
    const std::vector<float> offsets = OffsetMagnitudes(dtype, w.bytes, rows * cols);
    const LinearWeight lw = View(dtype, w.bytes.data(), rows, cols);
    for (int64_t tokens : {int64_t{1}, int64_t{3}, n}) {
      std::vector<float> yq(static_cast<size_t>(tokens * rows), NAN);
      ASSERT_TRUE(q8k_dev->Linear(**stream, lw, x.data(), cols, tokens, yq.data(), rows).ok());
      ExpectQ8KProduct(w.values, offsets, rows, cols, x, tokens, yq,
                       std::string(DTypeName(dtype)) + " q8k n=" + std::to_string(tokens));
      std::vector<float> again(yq.size(), NAN);
      ASSERT_TRUE(q8k_dev->Linear(**stream, lw, x.data(), cols, tokens, again.data(), rows).ok());
      EXPECT_EQ(again, yq) << "the same input twice";
    }
    std::vector<float> x2 = x;
    std::vector<float> y1(static_cast<size_t>(rows), NAN), y2(y1.size(), NAN);
    ASSERT_TRUE(q8k_dev->Linear(**stream, lw, x2.data(), cols, 1, y1.data(), rows).ok());
    x2[cols - 1] += 3.0f;  // the last block's scale and quants change
    ASSERT_TRUE(q8k_dev->Linear(**stream, lw, x2.data(), cols, 1, y2.data(), rows).ok());
    ExpectQ8KProduct(w.values, offsets, rows, cols, x2, 1, y2,
                     std::string(DTypeName(dtype)) + " q8k, input changed in place");
    EXPECT_NE(y1, y2);
  }

  // EmbeddingGather: the dequantized rows exactly.
  const std::vector<int32_t> ids = {5, 0, 39, 5};
  std::vector<float> rows_out(ids.size() * cols);
  ASSERT_TRUE(dev->EmbeddingGather(**stream, View(dtype, w.bytes.data(), rows, cols), ids.data(),
                                   static_cast<int64_t>(ids.size()), rows_out.data())
                  .ok());
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(std::memcmp(rows_out.data() + i * cols, w.values.data() + ids[i] * cols,
                          cols * sizeof(float)),
              0)
        << "id " << ids[i];
  }

  // MoeGate with a quantized router: the same selection and weights as an F32 router holding the
  // dequantized values (the same F32 dot products).
  MoeGateParams p;
  p.num_experts = rows;
  p.top_k = 4;
  p.n_group = 4;
  p.topk_group = 2;
  p.routed_scaling_factor = 2.5;
  std::vector<int32_t> ids_q(n * p.top_k), ids_f(n * p.top_k);
  std::vector<float> wq(n * p.top_k), wf(n * p.top_k);
  ASSERT_TRUE(dev->MoeGate(**stream, x.data(), cols, n, View(dtype, w.bytes.data(), rows, cols),
                           VectorWeight{}, p, ids_q.data(), wq.data())
                  .ok());
  ASSERT_TRUE(dev->MoeGate(**stream, x.data(), cols, n,
                           View(DType::kF32, w.values.data(), rows, cols), VectorWeight{}, p,
                           ids_f.data(), wf.data())
                  .ok());
  EXPECT_EQ(ids_q, ids_f);
  EXPECT_EQ(wq, wf);
}

INSTANTIATE_TEST_SUITE_P(Types, QuantizedOpsTest,
                         ::testing::Values(DType::kQ4_K, DType::kQ5_K, DType::kQ6_K, DType::kQ8_0,
                                           DType::kQ5_0, DType::kF16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

TEST(QuantizedOpsTest, RowsThatAreNotWholeBlocksAreInvalidArgument) {
  std::unique_ptr<Device> dev = NewCpuDevice();
  auto stream = dev->CreateStream();
  ASSERT_TRUE(stream.ok());
  std::vector<std::byte> bytes(4096);
  std::vector<float> x(300), y(2);
  LinearWeight w = View(DType::kQ4_K, bytes.data(), 2, 300);  // 300 is not 256-aligned
  const absl::Status s = dev->Linear(**stream, w, x.data(), 300, 1, y.data(), 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("Q4_K"), std::string::npos) << s;
}

TEST(GgufResidentWeightsTest, TheEngineBindsAGgufInPlaceWithItsBlockTypes) {
  TempDir dir("gguf_serving");
  auto c = GgufCheckpoint::Open(WriteTinyGguf(dir));
  ASSERT_TRUE(c.ok()) << c.status();
  std::unique_ptr<Device> dev = NewCpuDevice();
  auto w = ResidentWeights::Create((*c)->config(), **c, *dev);
  ASSERT_TRUE(w.ok()) << w.status();
  const ModelConfig& config = (*c)->config();
  const int64_t moe_layer = config.first_k_dense_replace;
  const HostMoeWeights* moe = (*w)->host_moe(moe_layer);
  ASSERT_NE(moe, nullptr);
  EXPECT_TRUE(moe->parts.routed.empty()) << "not FP8: the grouped expert path";
  ASSERT_EQ(static_cast<int64_t>(moe->routed.size()), config.n_routed_experts);
  EXPECT_EQ(moe->routed[2].gate.dtype, DType::kQ4_K);
  auto view = (*c)->GetTensor(ExpertTensorName(moe_layer, 2, kGateProj));
  EXPECT_EQ(moe->routed[2].gate.data, view->data) << "read in place";
  EXPECT_TRUE(IsBlockDType((*w)->host_embedding().dtype));
}

}  // namespace
}  // namespace hmoe
