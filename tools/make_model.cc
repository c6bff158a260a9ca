// hmoe-make-model: writes a synthetic DeepSeek-V3-family checkpoint (random weights, the real
// Hugging Face layout) for tests and demos.
//
//   hmoe-make-model --preset tiny --out /tmp/tiny
//   hmoe-make-model --preset small --out /tmp/small --seed 1 --dtype bf16
//   hmoe-make-model --preset real-shaped --out /data/rs --shard-size-mb 2048
//   hmoe-make-model --preset small --out /tmp/small-gguf --format gguf --quant q4_k_m
//   hmoe-make-model --preset tiny --config-override kimi.json --out /tmp/kimi-like
//
// Flags may be spelled with dashes or underscores (--shard-size-mb == --shard_size_mb).

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"

#include "common/base/flags.h"
#include "common/base/logging.h"
#include "common/base/mapped_file.h"
#include "tools/gguf_model_writer.h"
#include "tools/model_writer.h"

ABSL_FLAG(std::string, preset, "tiny", "tiny | small | real-shaped");
ABSL_FLAG(std::string, out, "", "output directory (created; must be empty unless --force)");
ABSL_FLAG(uint64_t, seed, 0, "weight seed");
ABSL_FLAG(std::string, dtype, "fp8",
          "fp8: FP8 E4M3 linear weights + 128x128 weight_scale_inv (like the real checkpoint); "
          "bf16: BF16 everywhere");
ABSL_FLAG(int64_t, shard_size_mb, 0,
          "shard size in MiB (0: the preset's default: tiny 1, small 64, real-shaped 1024)");
ABSL_FLAG(int64_t, vocab_size, 0, "override the vocabulary size (0: preset)");
ABSL_FLAG(int64_t, num_layers, 0, "override num_hidden_layers (0: preset)");
ABSL_FLAG(int64_t, experts, 0, "override n_routed_experts (0: preset)");
ABSL_FLAG(std::string, config_override, "",
          "a JSON file: an object whose members replace or add config.json fields of the preset "
          "before the weights are generated (shapes follow; null allowed, e.g. "
          "{\"q_lora_rank\": null, \"rope_scaling\": null}); docs/conformance.md");
ABSL_FLAG(bool, force, false, "write into a non-empty directory, replacing checkpoint files");
ABSL_FLAG(int, threads, 0, "generation threads (0: all cores)");
ABSL_FLAG(std::string, tokenizer, "deepseek",
          "deepseek: tokenizer.json (DeepSeek-V3's form); kimi: tiktoken.model + "
          "tokenizer_config.json as Kimi-K2 ships them (needs a vocabulary of at least 512)");
ABSL_FLAG(std::string, format, "safetensors",
          "safetensors: the Hugging Face layout; gguf: OUT/model.gguf (llama.cpp deepseek2)");
ABSL_FLAG(std::string, quant, "q4_k_m",
          "with --format gguf: q4_k_m | q5_k_m | q8_0 | bf16 | f16 | f32 (docs/gguf.md)");
ABSL_FLAG(int64_t, gguf_split_mb, 0,
          "with --format gguf: split into model-0000k-of-0000n.gguf parts of at most this many "
          "MiB of tensors (0: one file)");
ABSL_FLAG(bool, gguf_kv_b, false,
          "with --format gguf: store MLA's kv_b as attn_kv_b (older files) instead of "
          "attn_k_b + attn_v_b");

int main(int argc, char** argv) {
  hmoe::SetUsage(
      "writes a synthetic DeepSeek-V3-family checkpoint: hmoe-make-model --preset tiny --out DIR");
  std::vector<std::string> storage;
  std::vector<char*> args = hmoe::NormalizeFlagNames(argc, argv, storage);
  absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  hmoe::logging::SetVerbosity(std::max(hmoe::logging::Verbosity(), 1));  // per-shard progress

  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) {
    std::fprintf(stderr, "hmoe-make-model: --out is required\n");
    return 2;
  }
  const std::string dtype = absl::GetFlag(FLAGS_dtype);
  if (dtype != "fp8" && dtype != "bf16") {
    std::fprintf(stderr, "hmoe-make-model: --dtype must be fp8 or bf16, got %s\n", dtype.c_str());
    return 2;
  }
  absl::StatusOr<hmoe::ModelPreset> preset = hmoe::GetPreset(absl::GetFlag(FLAGS_preset));
  if (!preset.ok()) {
    std::fprintf(stderr, "hmoe-make-model: %s\n", preset.status().ToString().c_str());
    return 2;
  }
  hmoe::PresetOverrides overrides;
  overrides.vocab_size = absl::GetFlag(FLAGS_vocab_size);
  overrides.num_layers = absl::GetFlag(FLAGS_num_layers);
  overrides.experts = absl::GetFlag(FLAGS_experts);
  if (absl::Status s = hmoe::ApplyOverrides(overrides, &*preset); !s.ok()) {
    std::fprintf(stderr, "hmoe-make-model: %s\n", s.ToString().c_str());
    return 2;
  }
  if (const std::string path = absl::GetFlag(FLAGS_config_override); !path.empty()) {
    absl::StatusOr<std::string> text = hmoe::ReadFileToString(path);
    if (!text.ok()) {
      std::fprintf(stderr, "hmoe-make-model: --config-override: %s\n",
                   text.status().ToString().c_str());
      return 2;
    }
    if (absl::Status s = hmoe::ApplyConfigOverride(*text, &*preset); !s.ok()) {
      std::fprintf(stderr, "hmoe-make-model: %s: %s\n", path.c_str(), s.ToString().c_str());
      return 2;
    }
  }
  const int threads = absl::GetFlag(FLAGS_threads);
  const int num_threads =
      threads > 0 ? threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const std::string format = absl::GetFlag(FLAGS_format);
  if (format == "gguf" && absl::GetFlag(FLAGS_tokenizer) != "deepseek") {
    std::fprintf(stderr, "hmoe-make-model: --tokenizer kimi is for --format safetensors\n");
    return 2;
  }
  if (format == "gguf") {
    absl::StatusOr<hmoe::GgufQuantMix> mix = hmoe::ParseGgufQuantMix(absl::GetFlag(FLAGS_quant));
    if (!mix.ok()) {
      std::fprintf(stderr, "hmoe-make-model: %s\n", mix.status().ToString().c_str());
      return 2;
    }
    if (absl::GetFlag(FLAGS_gguf_split_mb) < 0) {
      std::fprintf(stderr, "hmoe-make-model: --gguf-split-mb must be >= 0\n");
      return 2;
    }
    hmoe::GgufWriteOptions gguf;
    gguf.seed = absl::GetFlag(FLAGS_seed);
    gguf.mix = *mix;
    gguf.split_kv_b = !absl::GetFlag(FLAGS_gguf_kv_b);
    gguf.split_max_bytes = absl::GetFlag(FLAGS_gguf_split_mb) << 20;
    gguf.force = absl::GetFlag(FLAGS_force);
    gguf.num_threads = num_threads;
    if (absl::Status s = hmoe::WriteGgufModel(*preset, out, gguf); !s.ok()) {
      std::fprintf(stderr, "hmoe-make-model: %s\n", s.ToString().c_str());
      return 1;
    }
    HMOE_LOG(INFO) << "wrote preset " << preset->name << " as GGUF (" << absl::GetFlag(FLAGS_quant)
                   << ", seed " << gguf.seed << ") to " << out;
    return 0;
  }
  if (format != "safetensors") {
    std::fprintf(stderr, "hmoe-make-model: --format must be safetensors or gguf, got %s\n",
                 format.c_str());
    return 2;
  }
  hmoe::WriteOptions options;
  const std::string tokenizer_style = absl::GetFlag(FLAGS_tokenizer);
  if (tokenizer_style != "deepseek" && tokenizer_style != "kimi") {
    std::fprintf(stderr, "hmoe-make-model: --tokenizer must be deepseek or kimi, got %s\n",
                 tokenizer_style.c_str());
    return 2;
  }
  options.tokenizer_style =
      tokenizer_style == "kimi" ? hmoe::TokenizerStyle::kKimi : hmoe::TokenizerStyle::kDeepSeek;
  options.seed = absl::GetFlag(FLAGS_seed);
  options.fp8 = dtype == "fp8";
  if (absl::GetFlag(FLAGS_shard_size_mb) < 0) {
    std::fprintf(stderr, "hmoe-make-model: --shard-size-mb must be >= 0\n");
    return 2;
  }
  options.shard_size_bytes = absl::GetFlag(FLAGS_shard_size_mb) << 20;
  options.force = absl::GetFlag(FLAGS_force);
  options.num_threads = num_threads;

  const auto start = std::chrono::steady_clock::now();
  if (absl::Status s = hmoe::WriteModel(*preset, out, options); !s.ok()) {
    std::fprintf(stderr, "hmoe-make-model: %s\n", s.ToString().c_str());
    return 1;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  HMOE_LOG(INFO) << "wrote preset " << preset->name << " (" << dtype << ", seed " << options.seed
                 << ") to " << out << " in " << seconds << " s";
  return 0;
}
