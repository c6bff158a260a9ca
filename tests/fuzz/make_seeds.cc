// Writes the generated part of the seed corpora (tests/fuzz/corpus/*/gen_*): inputs that need our
// own serializers (the shm manifest, GenerateRequest protos, the fuzz tokenizer's JSON). Built with
// the fuzz targets; run by hand when a format changes:  build/fuzz/tests/fuzz/hmoe_fuzz_seeds
// tests/fuzz/corpus
#include <cstdio>
#include <string>

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
  if (!ok) std::fprintf(stderr, "failed to write the seeds under %s\n", dir.c_str());
  return ok ? 0 : 1;
}
