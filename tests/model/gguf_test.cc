// The GGUF container and the ggml block types: round trips, error bounds of our quantizers,
// dequantization of hand-built blocks, and damaged files (clear errors, never a crash).
// Bit-exactness against llama.cpp's own package is gguf_oracle_test.py.

#include "common/model/gguf.h"

#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/base/mapped_file.h"
#include "common/model/dtype.h"
#include "common/model/gguf_model.h"
#include "common/model/gguf_quants.h"
#include "common/model/model_config.h"
#include "tests/integration/temp_dir.h"
#include "tests/model/test_util.h"

namespace hmoe {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;

constexpr uint32_t T(GgmlType t) { return static_cast<uint32_t>(t); }

std::vector<float> RandomNormal(size_t n, uint32_t seed, float stddev = 1.0f, float mean = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(mean, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

std::vector<std::byte> Quantize(uint32_t type, const std::vector<float>& x) {
  size_t bytes = 0;
  EXPECT_TRUE(GgmlBytes(type, static_cast<int64_t>(x.size()), &bytes).ok());
  std::vector<std::byte> q(bytes);
  EXPECT_TRUE(QuantizeGgml(type, x.data(), static_cast<int64_t>(x.size()), q.data()).ok());
  return q;
}

std::vector<float> Dequantize(uint32_t type, const std::vector<std::byte>& q, size_t n) {
  std::vector<float> y(n);
  EXPECT_TRUE(DequantizeGgml(type, q.data(), static_cast<int64_t>(n), y.data()).ok());
  return y;
}

float Half(const std::byte* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return F16ToFloat(h);
}

// ------------------------------------------------------------------------------------ quants

TEST(GgmlTypes, SizesAndNames) {
  EXPECT_EQ(GgmlTypeName(T(GgmlType::kQ4_K)), "Q4_K");
  EXPECT_EQ(GgmlTypeName(99), "type 99");
  EXPECT_EQ(GgmlTypeSizeOf(T(GgmlType::kQ6_K))->type_size, 210);
  EXPECT_EQ(GgmlTypeSizeOf(T(GgmlType::kQ8_0))->block_size, 32);
  EXPECT_FALSE(GgmlTypeSizeOf(4).has_value());  // Q4_2: removed from ggml
  size_t bytes = 0;
  EXPECT_THAT(GgmlBytes(T(GgmlType::kQ4_K), 100, &bytes).message(), HasSubstr("Q4_K blocks"));
  EXPECT_TRUE(GgmlBytes(T(GgmlType::kQ4_K), 512, &bytes).ok());
  EXPECT_EQ(bytes, 288u);
}

TEST(GgmlTypes, UnsupportedTypeIsNamed) {
  std::vector<std::byte> q(66);
  std::vector<float> y(256);
  const absl::Status s = DequantizeGgml(T(GgmlType::kIQ2_XXS), q.data(), 256, y.data());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("IQ2_XXS"));
  EXPECT_THAT(QuantizeGgml(T(GgmlType::kQ5_0), y.data(), 32, q.data()).message(),
              HasSubstr("Q5_0"));
}

// Hand-built blocks from the format definition (MODEL-SPEC 5.4).
TEST(GgmlDequantize, HandBuiltQ8_0) {
  BlockQ8_0 b{};
  b.d = FloatToF16(0.5f);
  for (int i = 0; i < 32; ++i) b.qs[i] = static_cast<int8_t>(i - 16);
  float y[32];
  ASSERT_TRUE(DequantizeGgml(T(GgmlType::kQ8_0), &b, 32, y).ok());
  for (int i = 0; i < 32; ++i) EXPECT_EQ(y[i], 0.5f * static_cast<float>(i - 16));
}

TEST(GgmlDequantize, HandBuiltQ4_K) {
  BlockQ4_K b{};
  b.d = FloatToF16(0.25f);
  b.dmin = FloatToF16(0.5f);
  // Sub-block 0: sc 3, m 1; sub-block 5: sc 33 (low 4 bits 1 in scales[9], high 2 bits in
  // scales[1] bits 6-7), m 18 (low 4 bits 2 in scales[9] high nibble, high bits in scales[5]).
  b.scales[0] = 3;
  b.scales[4] = 1;
  b.scales[9] = static_cast<uint8_t>(1 | (2 << 4));
  b.scales[1] = static_cast<uint8_t>(2 << 6);
  b.scales[5] = static_cast<uint8_t>(1 << 6);
  for (int l = 0; l < 32; ++l) {
    b.qs[l] = static_cast<uint8_t>(l % 16);              // sub-block 0 (low nibbles of chunk 0)
    b.qs[64 + l] = static_cast<uint8_t>((l % 16) << 4);  // sub-block 5 (high nibbles of chunk 2)
  }
  float y[256];
  ASSERT_TRUE(DequantizeGgml(T(GgmlType::kQ4_K), &b, 256, y).ok());
  for (int l = 0; l < 32; ++l) {
    EXPECT_EQ(y[l], 0.25f * 3 * static_cast<float>(l % 16) - 0.5f * 1) << l;
    EXPECT_EQ(y[160 + l], 0.25f * 33 * static_cast<float>(l % 16) - 0.5f * 18) << l;
    EXPECT_EQ(y[32 + l], 0.0f);  // sub-block 1: sc 0, m 0
  }
}

TEST(GgmlDequantize, HandBuiltQ6_K) {
  BlockQ6_K b{};
  b.d = FloatToF16(2.0f);
  for (int j = 0; j < 16; ++j) b.scales[j] = static_cast<int8_t>(j - 8);
  // Weight 128 + 64 + 5 (second half, third group): low nibble from ql[64 + 5] >> 4, high bits
  // from qh[32 + 5] bits 4-5.
  b.ql[64 + 5] = 0xA0;
  b.qh[32 + 5] = 0x30;
  float y[256];
  ASSERT_TRUE(DequantizeGgml(T(GgmlType::kQ6_K), &b, 256, y).ok());
  const int i = 128 + 64 + 5;
  EXPECT_EQ(y[i],
            2.0f * static_cast<float>(i / 16 - 8) * static_cast<float>((0xA | (3 << 4)) - 32));
  EXPECT_EQ(y[0], 2.0f * -8 * -32);
}

TEST(GgmlDequantize, HandBuiltQ5_0) {
  BlockQ5_0 b{};
  b.d = FloatToF16(1.0f);
  b.qs[3] = 0x7F;                // lo nibble 15 at j=3, hi nibble 7 at j=19
  const uint32_t qh = 1u << 19;  // fifth bit of weight 19
  std::memcpy(b.qh, &qh, 4);
  float y[32];
  ASSERT_TRUE(DequantizeGgml(T(GgmlType::kQ5_0), &b, 32, y).ok());
  EXPECT_EQ(y[3], 15.0f - 16.0f);
  EXPECT_EQ(y[19], 23.0f - 16.0f);
  EXPECT_EQ(y[0], -16.0f);
}

// Our quantizers keep every weight within their stated bound (gguf_quants.h).
TEST(GgmlQuantize, Q8_0WithinHalfStep) {
  const std::vector<float> x = RandomNormal(32 * 64, 1);
  const std::vector<std::byte> q = Quantize(T(GgmlType::kQ8_0), x);
  const std::vector<float> y = Dequantize(T(GgmlType::kQ8_0), q, x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const float d = Half(q.data() + (i / 32) * sizeof(BlockQ8_0));
    ASSERT_LE(std::fabs(y[i] - x[i]), d / 2 * (1 + 1e-6f)) << i;
  }
}

TEST(GgmlQuantize, Q6_KWithinHalfStep) {
  const std::vector<float> x = RandomNormal(256 * 16, 2, 0.02f);
  const std::vector<std::byte> q = Quantize(T(GgmlType::kQ6_K), x);
  const std::vector<float> y = Dequantize(T(GgmlType::kQ6_K), q, x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const std::byte* b = q.data() + (i / 256) * sizeof(BlockQ6_K);
    const float d = Half(b + 208);
    const int sc = static_cast<int8_t>(b[192 + (i % 256) / 16]);
    ASSERT_LE(std::fabs(y[i] - x[i]), d * static_cast<float>(sc) / 2 * (1 + 1e-5f)) << i;
  }
}

// Q4_K/Q5_K: |err| <= d*sc/2 + dmin/2 per sub-block.
void CheckK4K5(GgmlType type, float mean) {
  const std::vector<float> x = RandomNormal(256 * 16, 3, 0.05f, mean);
  const std::vector<std::byte> q = Quantize(T(type), x);
  const std::vector<float> y = Dequantize(T(type), q, x.size());
  const size_t block = type == GgmlType::kQ4_K ? sizeof(BlockQ4_K) : sizeof(BlockQ5_K);
  for (size_t i = 0; i < x.size(); ++i) {
    const auto* b = reinterpret_cast<const uint8_t*>(q.data() + (i / 256) * block);
    const int j = static_cast<int>((i % 256) / 32);
    const int sc = j < 4 ? (b[4 + j] & 63) : ((b[4 + j + 4] & 15) | ((b[4 + j - 4] >> 6) << 4));
    const float d = Half(q.data() + (i / 256) * block);
    const float dmin = Half(q.data() + (i / 256) * block + 2);
    const float bound = (d * static_cast<float>(sc) / 2 + dmin / 2) * (1 + 1e-5f) + 1e-7f;
    ASSERT_LE(std::fabs(y[i] - x[i]), bound) << GgmlTypeName(T(type)) << " " << i;
  }
}

TEST(GgmlQuantize, Q4_KWithinBound) {
  CheckK4K5(GgmlType::kQ4_K, 0.0f);
  CheckK4K5(GgmlType::kQ4_K, 0.3f);  // all positive: min 0
}

TEST(GgmlQuantize, Q5_KWithinBound) {
  CheckK4K5(GgmlType::kQ5_K, 0.0f);
  CheckK4K5(GgmlType::kQ5_K, -0.3f);
}

TEST(GgmlQuantize, ZerosStayZeros) {
  const std::vector<float> x(256, 0.0f);
  for (GgmlType t : {GgmlType::kQ8_0, GgmlType::kQ4_K, GgmlType::kQ5_K, GgmlType::kQ6_K}) {
    const std::vector<float> y = Dequantize(T(t), Quantize(T(t), x), x.size());
    for (float v : y) ASSERT_EQ(v, 0.0f) << GgmlTypeName(T(t));
  }
}

// --------------------------------------------------------------------------------- container

// A small file with every metadata type, nested arrays and three tensors.
std::string WriteSample(const TempDir& dir, uint32_t alignment = 64) {
  const std::string path = dir.File("sample.gguf");
  GgufWriter w(path, alignment);
  GgufValue u8{.type = GgufValueType::kU8,
               .u = 200,
               .i = 0,
               .f = 0,
               .str = {},
               .array_type = {},
               .array = {}};
  w.AddMetadata("t.u8", u8);
  GgufValue i16{.type = GgufValueType::kI16,
                .u = 0,
                .i = -300,
                .f = 0,
                .str = {},
                .array_type = {},
                .array = {}};
  w.AddMetadata("t.i16", i16);
  w.AddMetadata("t.u32", GgufValue::U32(123456));
  w.AddMetadata("t.i32", GgufValue::I32(-5));
  w.AddMetadata("t.u64", GgufValue::U64(uint64_t{1} << 40));
  w.AddMetadata("t.f32", GgufValue::F32(1.5f));
  GgufValue f64{.type = GgufValueType::kF64,
                .u = 0,
                .i = 0,
                .f = 0.1,
                .str = {},
                .array_type = {},
                .array = {}};
  w.AddMetadata("t.f64", f64);
  w.AddMetadata("t.bool", GgufValue::Bool(true));
  w.AddMetadata("t.str", GgufValue::String("héllo"));
  w.AddMetadata("t.arr", GgufValue::Array(GgufValueType::kString,
                                          {GgufValue::String("a"), GgufValue::String("b c")}));
  w.AddMetadata("t.nested",
                GgufValue::Array(GgufValueType::kArray,
                                 {GgufValue::Array(GgufValueType::kU32, {GgufValue::U32(7)})}));
  EXPECT_TRUE(w.AddTensor("a", {32, 2}, T(GgmlType::kF32)).ok());
  EXPECT_TRUE(w.AddTensor("b", {64}, T(GgmlType::kQ8_0)).ok());
  EXPECT_TRUE(w.AddTensor("c", {3}, T(GgmlType::kF16)).ok());
  EXPECT_TRUE(w.Begin().ok());
  std::vector<float> a(64);
  for (int i = 0; i < 64; ++i) a[i] = static_cast<float>(i);
  EXPECT_TRUE(w.WriteTensorData("a", std::as_bytes(std::span(a))).ok());
  std::vector<std::byte> b(68);
  EXPECT_TRUE(QuantizeGgml(T(GgmlType::kQ8_0), a.data(), 64, b.data()).ok());
  EXPECT_TRUE(w.WriteTensorData("b", b).ok());
  const uint16_t c[3] = {FloatToF16(1.0f), FloatToF16(-2.0f), FloatToF16(0.5f)};
  EXPECT_TRUE(w.WriteTensorData("c", std::as_bytes(std::span(c))).ok());
  EXPECT_TRUE(w.Finish().ok());
  return path;
}

TEST(GgufFile, RoundTripsEveryValueType) {
  TempDir dir("gguf");
  const std::string path = WriteSample(dir);
  absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->version(), 3u);
  EXPECT_EQ((*f)->alignment(), 64u);
  EXPECT_EQ((*f)->data_offset() % 64, 0u);
  EXPECT_EQ((*f)->Find("t.u8")->u, 200u);
  EXPECT_EQ((*f)->Find("t.i16")->AsInt(), -300);
  EXPECT_EQ((*f)->Find("t.u32")->AsInt(), 123456);
  EXPECT_EQ((*f)->Find("t.i32")->AsInt(), -5);
  EXPECT_EQ((*f)->Find("t.u64")->AsInt(), int64_t{1} << 40);
  EXPECT_EQ((*f)->Find("t.f32")->f, 1.5);
  EXPECT_EQ((*f)->Find("t.f64")->f, 0.1);
  EXPECT_EQ((*f)->Find("t.bool")->u, 1u);
  EXPECT_EQ((*f)->Find("t.str")->str, "héllo");
  ASSERT_EQ((*f)->Find("t.arr")->array.size(), 2u);
  EXPECT_EQ((*f)->Find("t.arr")->array[1].str, "b c");
  EXPECT_EQ((*f)->Find("t.nested")->array[0].array[0].u, 7u);
  EXPECT_EQ((*f)->Find("general.alignment")->u, 64u);
  ASSERT_EQ((*f)->tensors().size(), 3u);
  for (const GgufTensorInfo& t : (*f)->tensors()) EXPECT_EQ(t.offset % 64, 0u) << t.name;
  EXPECT_EQ((*f)->tensors()[0].torch_shape(), (std::vector<int64_t>{2, 32}));

  absl::StatusOr<std::unique_ptr<GgufModel>> m = GgufModel::Open(path);
  ASSERT_TRUE(m.ok()) << m.status();
  absl::StatusOr<std::vector<float>> a = (*m)->Dequantize("a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ((*a)[63], 63.0f);
  absl::StatusOr<std::vector<float>> c = (*m)->Dequantize("c");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, (std::vector<float>{1.0f, -2.0f, 0.5f}));
  EXPECT_EQ((*m)->Dequantize("zzz").status().code(), absl::StatusCode::kNotFound);
}

std::string ReadAll(const std::string& path) {
  absl::StatusOr<std::string> s = ReadFileToString(path);
  EXPECT_TRUE(s.ok());
  return *s;
}

absl::Status ParseBytes(const std::string& bytes) {
  return GgufFile::Parse(std::as_bytes(std::span(bytes.data(), bytes.size())), "damaged.gguf")
      .status();
}

TEST(GgufFile, EveryTruncationIsAnError) {
  TempDir dir("gguf");
  const std::string bytes = ReadAll(WriteSample(dir));
  for (size_t n = 0; n < bytes.size(); ++n) {
    const absl::Status s = ParseBytes(bytes.substr(0, n));
    ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << n;
    ASSERT_THAT(s.message(), HasSubstr("damaged.gguf")) << n;
  }
  EXPECT_TRUE(ParseBytes(bytes).ok());
}

TEST(GgufFile, RandomCorruptionNeverCrashes) {
  TempDir dir("gguf");
  const std::string bytes = ReadAll(WriteSample(dir));
  std::mt19937 rng(7);
  for (int trial = 0; trial < 3000; ++trial) {
    std::string b = bytes;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) b[rng() % 600 % b.size()] = static_cast<char>(rng());
    (void)ParseBytes(b);  // any status; must not crash or hang (ASan config checks reads)
  }
}

// An array whose elements are all present but too many: refused before allocating them.
TEST(GgufFile, TooManyMetadataValuesAreRefused) {
  std::string b;
  auto put = [&b](auto v) { b.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  put(kGgufMagic);
  put(kGgufVersion);
  put(uint64_t{0});  // tensors
  put(uint64_t{1});  // metadata
  put(uint64_t{1});
  b.append("k");
  put(static_cast<uint32_t>(GgufValueType::kArray));
  put(static_cast<uint32_t>(GgufValueType::kU8));
  const uint64_t n = (uint64_t{1} << 23) + 1;
  put(n);
  b.append(n, '\0');
  EXPECT_THAT(ParseBytes(b).message(), HasSubstr("metadata values in the file"));
}

TEST(GgufFile, BadMagicAndVersion) {
  TempDir dir("gguf");
  std::string bytes = ReadAll(WriteSample(dir));
  std::string bad = bytes;
  bad[0] = 'X';
  EXPECT_THAT(ParseBytes(bad).message(), HasSubstr("not a GGUF file"));
  bad = bytes;
  bad[4] = 2;
  EXPECT_THAT(ParseBytes(bad).message(), HasSubstr("GGUF version 2 is not supported"));
}

TEST(GgufFile, UnknownTensorTypeIsNamed) {
  TempDir dir("gguf");
  std::string bytes = ReadAll(WriteSample(dir));
  // Tensor "c": name (8 + 1), n_dims 1, ne[0] (8), then the type.
  const size_t at =
      bytes.find(std::string("\x01\x00\x00\x00\x00\x00\x00\x00"
                             "c",
                             9));
  ASSERT_NE(at, std::string::npos);
  const size_t type_at = at + 9 + 4 + 8;
  bytes[type_at] = 99;
  const absl::Status s = ParseBytes(bytes);
  EXPECT_THAT(s.message(), HasSubstr("tensor c has unknown ggml type 99"));
}

TEST(GgufFile, UnsupportedTensorTypeNamesTypeAndTensor) {
  TempDir dir("gguf");
  const std::string path = dir.File("iq.gguf");
  GgufWriter w(path);
  ASSERT_TRUE(w.AddTensor("blk.0.ffn_up_exps.weight", {256}, T(GgmlType::kIQ2_XXS)).ok());
  ASSERT_TRUE(w.Begin().ok());
  const std::vector<std::byte> data(66);
  ASSERT_TRUE(w.WriteTensorData("blk.0.ffn_up_exps.weight", data).ok());
  ASSERT_TRUE(w.Finish().ok());
  absl::StatusOr<std::unique_ptr<GgufModel>> m = GgufModel::Open(path);
  ASSERT_TRUE(m.ok()) << m.status();  // the container itself is fine
  const absl::Status s = (*m)->Dequantize("blk.0.ffn_up_exps.weight").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tensor blk.0.ffn_up_exps.weight has type IQ2_XXS"));
}

TEST(GgufFile, DuplicateKeysAndTensorsAreErrors) {
  TempDir dir("gguf");
  {
    GgufWriter w(dir.File("dup.gguf"));
    w.AddMetadata("k", GgufValue::U32(1));
    w.AddMetadata("k", GgufValue::U32(2));
    ASSERT_TRUE(w.Begin().ok());
    ASSERT_TRUE(w.Finish().ok());
  }
  EXPECT_THAT(GgufFile::Open(dir.File("dup.gguf")).status().message(),
              HasSubstr("duplicate metadata key k"));
  {
    GgufWriter w(dir.File("dupt.gguf"));
    ASSERT_TRUE(w.AddTensor("x", {4}, T(GgmlType::kF32)).ok());
    ASSERT_TRUE(w.AddTensor("x", {4}, T(GgmlType::kF32)).ok());
    ASSERT_TRUE(w.Begin().ok());
    const std::vector<std::byte> data(16);
    ASSERT_TRUE(w.WriteTensorData("x", data).ok());
    ASSERT_TRUE(w.WriteTensorData("x", data).ok());
    ASSERT_TRUE(w.Finish().ok());
  }
  EXPECT_THAT(GgufFile::Open(dir.File("dupt.gguf")).status().message(),
              HasSubstr("duplicate tensor x"));
}

// A caller that names the alignment in the metadata too gets one key, not a duplicate.
TEST(GgufFile, AnAlignmentKeyFromTheCallerIsWrittenOnce) {
  TempDir dir("gguf");
  {
    GgufWriter w(dir.File("a.gguf"), 64);
    w.AddMetadata("general.alignment", GgufValue::U32(64));
    ASSERT_TRUE(w.AddTensor("x", {4}, T(GgmlType::kF32)).ok());
    ASSERT_TRUE(w.Begin().ok());
    ASSERT_TRUE(w.WriteTensorData("x", std::vector<std::byte>(16)).ok());
    ASSERT_TRUE(w.Finish().ok());
  }
  absl::StatusOr<std::unique_ptr<GgufFile>> f = GgufFile::Open(dir.File("a.gguf"));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->alignment(), 64u);
}

TEST(GgufFile, MissingFileIsNotFound) {
  EXPECT_EQ(GgufModel::Open("/nonexistent/model.gguf").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(GgufSplit, Names) {
  const std::optional<GgufSplitName> s =
      ParseGgufSplitName("/m/DeepSeek-R1-Q4_K_M-00002-of-00009.gguf");
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->prefix, "/m/DeepSeek-R1-Q4_K_M");
  EXPECT_EQ(s->part, 2);
  EXPECT_EQ(s->count, 9);
  EXPECT_EQ(GgufSplitPath(s->prefix, 3, 9), "/m/DeepSeek-R1-Q4_K_M-00003-of-00009.gguf");
  EXPECT_FALSE(ParseGgufSplitName("/m/model.gguf").has_value());
  EXPECT_FALSE(ParseGgufSplitName("/m/x-00004-of-00003.gguf").has_value());
}

// Writes a split model of `count` parts with one F32 tensor each.
void WriteParts(const TempDir& dir, int count, int claimed_count, int64_t claimed_tensors) {
  for (int k = 0; k < count; ++k) {
    GgufWriter w(GgufSplitPath(dir.File("m"), k + 1, count));
    w.AddMetadata("split.no", GgufValue::U16(static_cast<uint16_t>(k)));
    w.AddMetadata("split.count", GgufValue::U16(static_cast<uint16_t>(claimed_count)));
    w.AddMetadata("split.tensors.count", GgufValue::I32(static_cast<int32_t>(claimed_tensors)));
    const std::string name = "t" + std::to_string(k);
    ASSERT_TRUE(w.AddTensor(name, {4}, T(GgmlType::kF32)).ok());
    ASSERT_TRUE(w.Begin().ok());
    const std::vector<std::byte> data(16);
    ASSERT_TRUE(w.WriteTensorData(name, data).ok());
    ASSERT_TRUE(w.Finish().ok());
  }
}

TEST(GgufSplit, OpensAllPartsFromAnyPart) {
  TempDir dir("gguf");
  WriteParts(dir, 3, 3, 3);
  absl::StatusOr<std::unique_ptr<GgufModel>> m =
      GgufModel::Open(GgufSplitPath(dir.File("m"), 2, 3));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->num_files(), 3);
  ASSERT_NE((*m)->FindTensor("t2"), nullptr);
  EXPECT_EQ((*m)->FindTensor("t2")->file_index, 2);
}

TEST(GgufSplit, MissingPartIsNotFound) {
  TempDir dir("gguf");
  WriteParts(dir, 3, 3, 3);
  std::filesystem::remove(GgufSplitPath(dir.File("m"), 3, 3));
  const absl::Status s = GgufModel::Open(GgufSplitPath(dir.File("m"), 1, 3)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("split GGUF part 3 of 3 is missing"));
}

TEST(GgufSplit, InconsistentSplitKeys) {
  TempDir dir("gguf");
  WriteParts(dir, 2, 2, 5);
  EXPECT_THAT(GgufModel::Open(GgufSplitPath(dir.File("m"), 1, 2)).status().message(),
              HasSubstr("split.tensors.count is 5 but the 2 parts hold 2 tensors"));
  TempDir dir2("gguf");
  WriteParts(dir2, 2, 3, 2);
  EXPECT_THAT(GgufModel::Open(GgufSplitPath(dir2.File("m"), 1, 2)).status().message(),
              HasSubstr("split.count 3"));
}

// ------------------------------------------------------------------ converters' deepseek2 keys

// Metadata as llama.cpp's converter writes it for an MLA (attn_k_b/attn_v_b) file of a hub
// config (MODEL-SPEC 5.2), plus the tensors the config reader looks at.
std::string WriteConverterStyle(const TempDir& dir, const ModelConfig& c, std::string_view pre) {
  const std::string path = dir.File(std::string(pre) + ".gguf");
  GgufWriter w(path);
  auto u32 = [&](const char* k, int64_t v) {
    w.AddMetadata(std::string("deepseek2.") + k, GgufValue::U32(static_cast<uint32_t>(v)));
  };
  auto f32 = [&](const char* k, double v) {
    w.AddMetadata(std::string("deepseek2.") + k, GgufValue::F32(static_cast<float>(v)));
  };
  w.AddMetadata("general.architecture", GgufValue::String("deepseek2"));
  u32("block_count", c.num_hidden_layers);
  u32("context_length", c.max_position_embeddings);
  u32("embedding_length", c.hidden_size);
  u32("feed_forward_length", c.intermediate_size);
  u32("attention.head_count", c.num_attention_heads);
  u32("attention.head_count_kv", 1);
  f32("rope.freq_base", c.rope_theta);
  f32("attention.layer_norm_rms_epsilon", c.rms_norm_eps);
  u32("expert_used_count", c.num_experts_per_tok);
  u32("expert_group_count", c.n_group);
  u32("expert_group_used_count", c.topk_group);
  u32("leading_dense_block_count", c.first_k_dense_replace);
  u32("vocab_size", c.vocab_size);
  u32("attention.q_lora_rank", *c.q_lora_rank);
  u32("attention.kv_lora_rank", c.kv_lora_rank);
  u32("attention.key_length", c.kv_lora_rank + c.qk_rope_head_dim);
  u32("attention.value_length", c.kv_lora_rank);
  u32("attention.key_length_mla", c.qk_head_dim());
  u32("attention.value_length_mla", c.v_head_dim);
  u32("expert_feed_forward_length", c.moe_intermediate_size);
  u32("expert_count", c.n_routed_experts);
  u32("expert_shared_count", c.n_shared_experts);
  f32("expert_weights_scale", c.routed_scaling_factor);
  w.AddMetadata("deepseek2.expert_weights_norm", GgufValue::Bool(true));
  u32("expert_gating_func", 2);
  u32("rope.dimension_count", c.qk_rope_head_dim);
  w.AddMetadata("deepseek2.rope.scaling.type", GgufValue::String("yarn"));
  f32("rope.scaling.factor", c.rope_scaling.factor);
  u32("rope.scaling.original_context_length", c.rope_scaling.original_max_position_embeddings);
  f32("rope.scaling.yarn_log_multiplier", 0.1 * c.rope_scaling.mscale_all_dim);
  if (c.rope_scaling.beta_fast != 32.0) {  // the default need not be written
    f32("rope.scaling.yarn_beta_fast", c.rope_scaling.beta_fast);
    f32("rope.scaling.yarn_beta_slow", c.rope_scaling.beta_slow);
  }
  w.AddMetadata("tokenizer.ggml.pre", GgufValue::String(std::string(pre)));
  w.AddMetadata("tokenizer.ggml.bos_token_id",
                GgufValue::U32(static_cast<uint32_t>(c.bos_token_id)));
  w.AddMetadata("tokenizer.ggml.eos_token_id",
                GgufValue::U32(static_cast<uint32_t>(c.eos_token_ids.front())));
  std::vector<std::string> names = {
      "output.weight", "blk." + std::to_string(c.first_k_dense_replace) + ".exp_probs_b.bias"};
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    names.push_back("blk." + std::to_string(l) + ".attn_norm.weight");
  }
  for (const std::string& n : names) EXPECT_TRUE(w.AddTensor(n, {32}, T(GgmlType::kF32)).ok());
  EXPECT_TRUE(w.Begin().ok());
  const std::vector<std::byte> zeros(128);
  for (const std::string& n : names) EXPECT_TRUE(w.WriteTensorData(n, zeros).ok());
  EXPECT_TRUE(w.Finish().ok());
  return path;
}

TEST(GgufConfig, ConverterKeysGiveTheHubConfig) {
  for (const auto& [json, pre] : {std::pair{testing::kDeepSeekV3ConfigJson, "deepseek-v3"},
                                  std::pair{testing::kKimiK2ConfigJson, "kimi-k2"}}) {
    absl::StatusOr<ModelConfig> hub = ModelConfig::FromJson(json);
    ASSERT_TRUE(hub.ok()) << hub.status();
    TempDir dir("gguf_config");
    absl::StatusOr<std::unique_ptr<GgufModel>> m =
        GgufModel::Open(WriteConverterStyle(dir, *hub, pre));
    ASSERT_TRUE(m.ok()) << m.status();
    absl::StatusOr<ModelConfig> got = ModelConfigFromGguf(**m);
    ASSERT_TRUE(got.ok()) << got.status();
    ModelConfig want = *hub;
    want.quantization = QuantizationConfig();  // per-tensor types in GGUF
    want.num_nextn_predict_layers = 0;         // the converter drops the MTP layer
    EXPECT_EQ(*got, want) << pre;
  }
}

}  // namespace
}  // namespace hmoe
