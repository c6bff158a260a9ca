// Writes the generated part of the seed corpora (tests/fuzz/corpus/*/gen_*): inputs that need our
// own serializers (the shm manifest, GenerateRequest protos, the fuzz tokenizer's JSON, GGUF files
// written by GgufWriter; the deepseek2 one from corpus/model_config/small.json). Built with
// the fuzz targets; run by hand when a format changes:  build/fuzz/tests/fuzz/hmoe_fuzz_seeds
// tests/fuzz/corpus
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"

#include "common/model/gguf.h"
#include "common/model/gguf_model.h"
#include "common/model/model_config.h"
#include "common/shm/manifest.h"
#include "proto/hmoe_v1.pb.h"
#include "tests/fuzz/fuzz_tokenizer.h"

namespace {

bool Write(const std::string& path, const std::string& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return false;
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  return std::fclose(f) == 0 && ok;
}

struct SeedTensor {
  std::string name;
  std::vector<int64_t> ne;
  hmoe::GgmlType type;
};

// A GGUF file with `metadata` and `tensors`, whose data are deterministic pseudo-random bytes.
bool WriteGguf(const std::string& path, uint32_t alignment,
               const std::vector<std::pair<std::string, hmoe::GgufValue>>& metadata,
               const std::vector<SeedTensor>& tensors) {
  hmoe::GgufWriter w(path, alignment);
  for (const auto& [key, value] : metadata) w.AddMetadata(key, value);
  std::vector<size_t> sizes;
  for (const SeedTensor& t : tensors) {
    int64_t n = 1;
    for (const int64_t d : t.ne) n *= d;
    size_t bytes = 0;
    const auto type = static_cast<uint32_t>(t.type);
    if (!w.AddTensor(t.name, t.ne, type).ok() || !hmoe::GgmlBytes(type, n, &bytes).ok()) {
      return false;
    }
    sizes.push_back(bytes);
  }
  if (!w.Begin().ok()) return false;
  uint32_t x = 0x9e3779b9;
  for (size_t i = 0; i < tensors.size(); ++i) {
    std::vector<std::byte> data(sizes[i]);
    for (std::byte& b : data) {
      x = x * 1664525 + 1013904223;
      b = static_cast<std::byte>(x >> 24);
    }
    if (!w.WriteTensorData(tensors[i].name, data).ok()) return false;
  }
  return w.Finish().ok();
}

bool WriteGgufSeeds(const std::string& dir) {
  using hmoe::GgmlType;
  using hmoe::GgufValue;
  using hmoe::GgufValueType;
  bool ok = true;
  // Every dequantizable type, metadata of several types (arrays too), alignment 64 (the writer
  // adds general.alignment).
  ok &= WriteGguf(
      dir + "/gguf/gen_types", 64,
      {{"general.architecture", GgufValue::String("llama")},
       {"test.flag", GgufValue::Bool(true)},
       {"test.f32", GgufValue::F32(0.5f)},
       {"test.i32", GgufValue::I32(-7)},
       {"test.u64", GgufValue::U64(1)},
       {"test.strings", GgufValue::Array(GgufValueType::kString,
                                         {GgufValue::String("a"), GgufValue::String("bc")})},
       {"test.nested",
        GgufValue::Array(
            GgufValueType::kArray,
            {GgufValue::Array(GgufValueType::kU16, {GgufValue::U16(1), GgufValue::U16(2)})})}},
      {{"f32", {8}, GgmlType::kF32},
       {"f16", {16, 2}, GgmlType::kF16},
       {"bf16", {16}, GgmlType::kBF16},
       {"q8_0", {32}, GgmlType::kQ8_0},
       {"q5_0", {32}, GgmlType::kQ5_0},
       {"q4_k", {256}, GgmlType::kQ4_K},
       {"q5_k", {256}, GgmlType::kQ5_K},
       {"q6_k", {256, 1}, GgmlType::kQ6_K}});

  // A deepseek2 file: the metadata of a small config (with the fuzz tokenizer), and a few small
  // tensors (not the config's shapes: the seed stays small, ValidateGgufTensors reports them).
  std::ifstream in(dir + "/model_config/small.json");
  std::stringstream json;
  json << in.rdbuf();
  auto config = hmoe::ModelConfig::FromJson(json.str());
  if (!config.ok()) {
    std::fprintf(stderr, "small.json: %s\n", config.status().ToString().c_str());
    return false;
  }
  config->vocab_size = 512;
  config->num_hidden_layers = 2;
  auto metadata = hmoe::GgufMetadataForConfig(*config, /*split_kv_b=*/true, /*file_type=*/7);
  auto tok = hmoe::GgufTokenizerMetadata(hmoe::fuzz::FuzzTokenizerJson(),
                                         hmoe::fuzz::FuzzTokenizerConfigJson(), config->vocab_size);
  if (!tok.ok()) {
    std::fprintf(stderr, "tokenizer metadata: %s\n", tok.status().ToString().c_str());
    return false;
  }
  metadata.insert(metadata.end(), tok->begin(), tok->end());
  ok &= WriteGguf(dir + "/gguf/gen_deepseek2", hmoe::kGgufDefaultAlignment, metadata,
                  {{"output_norm.weight", {64}, GgmlType::kF32},
                   {"blk.0.attn_k_b.weight", {64, 4, 2}, GgmlType::kQ8_0},
                   {"blk.0.attn_v_b.weight", {128, 2, 2}, GgmlType::kQ8_0},
                   {"blk.1.exp_probs_b.bias", {32}, GgmlType::kF32},
                   {"blk.1.ffn_gate_exps.weight", {256, 2, 2}, GgmlType::kQ4_K}});
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  bool ok = true;

  // shm manifest: one dense tensor, one sliced in two parts, one empty manifest.
  hmoe::shm::Manifest m;
  m.identity = {0x1234, 0x5678};
  m.generation = 3;
  m.model_dir = "/models/small";
  m.config_json = R"({"vocab_size": 4096})";
  m.num_slices = 2;
  m.total_tensor_bytes = 96;
  m.segments = {
      {.index = 0, .role = hmoe::shm::SegmentRole::kDense, .used_bytes = 32},
      {.index = 1, .role = hmoe::shm::SegmentRole::kExpertSlice, .slice = 0, .used_bytes = 32},
      {.index = 2, .role = hmoe::shm::SegmentRole::kExpertSlice, .slice = 1, .used_bytes = 32}};
  hmoe::shm::TensorEntry dense{
      .name = "a.weight", .dtype = hmoe::DType::kF32, .shape = {2, 4}, .size_bytes = 32};
  hmoe::shm::TensorEntry sliced{.name = "b.weight",
                                .dtype = hmoe::DType::kF32,
                                .shape = {4, 4},
                                .size_bytes = 64,
                                .placement = hmoe::shm::Placement::kSliced,
                                .contiguous = false};
  sliced.parts = {{.slice = 0,
                   .segment = 1,
                   .offset = 0,
                   .size_bytes = 32,
                   .shape = {2, 4},
                   .split_dim = 0,
                   .begin = 0,
                   .end = 2},
                  {.slice = 1,
                   .segment = 2,
                   .offset = 0,
                   .size_bytes = 32,
                   .shape = {2, 4},
                   .split_dim = 0,
                   .begin = 2,
                   .end = 4}};
  m.tensors = {dense, sliced};
  ok &= Write(dir + "/shm_manifest/gen_two_tensors", m.Serialize());
  ok &= Write(dir + "/shm_manifest/gen_empty", hmoe::shm::Manifest().Serialize());

  // GenerateRequest protos.
  hmoe::v1::GenerateRequest r;
  r.set_request_id("req-1");
  r.mutable_prompt_token_ids()->add_ids(1);
  r.mutable_prompt_token_ids()->add_ids(200);
  r.set_max_new_tokens(8);
  r.mutable_sampling()->set_temperature(0.7f);
  r.mutable_sampling()->set_top_p(0.9f);
  r.add_stop_token_ids(5);
  ok &= Write(dir + "/request_validator/gen_token_ids", r.SerializeAsString());
  r.Clear();
  r.set_prompt_text("Hello, world! 12345 <｜User｜>");
  r.set_max_new_tokens(16);
  r.add_stop_strings("\n\n");
  r.set_detokenize(true);
  ok &= Write(dir + "/request_validator/gen_text", r.SerializeAsString());

  // The fuzz tokenizer, as tokenizer.json + separator + tokenizer_config.json.
  ok &= Write(dir + "/tokenizer_json/gen_fuzz_tokenizer",
              hmoe::fuzz::FuzzTokenizerJson() + "\n---\n" + hmoe::fuzz::FuzzTokenizerConfigJson());
  // A small tiktoken.model (the 256 bytes, a few merges) + separator + a Kimi-style config.
  std::string tiktoken_model;
  const char* const kTokens[] = {"He", "ll", "llo", "Hello", " W", "or", "ld", "你好"};
  for (int b = 0; b < 256; ++b) {
    tiktoken_model +=
        absl::Base64Escape(std::string(1, static_cast<char>(b))) + " " + std::to_string(b) + "\n";
  }
  for (size_t i = 0; i < std::size(kTokens); ++i) {
    tiktoken_model += absl::Base64Escape(kTokens[i]) + " " + std::to_string(256 + i) + "\n";
  }
  ok &= Write(dir + "/tiktoken/gen_kimi_style",
              tiktoken_model +
                  "\n---\n{\"added_tokens_decoder\": {\"264\": {\"content\": \"[BOS]\"}, "
                  "\"266\": {\"content\": \"<|im_end|>\"}}, \"bos_token\": \"[BOS]\", "
                  "\"eos_token\": \"<|im_end|>\"}\n");
  ok &= WriteGgufSeeds(dir);
  if (!ok) std::fprintf(stderr, "failed to write the seeds under %s\n", dir.c_str());
  return ok ? 0 : 1;
}
