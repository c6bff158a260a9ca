// hmoe-make-model: writes a synthetic DeepSeek-V3-family checkpoint (random weights, the real
// Hugging Face layout) for tests and demos.
//
//   hmoe-make-model --preset tiny --out /tmp/tiny
//   hmoe-make-model --preset small --out /tmp/small --seed 1 --dtype bf16
//   hmoe-make-model --preset real-shaped --out /data/rs --shard-size-mb 2048
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
ABSL_FLAG(bool, force, false, "write into a non-empty directory, replacing checkpoint files");
ABSL_FLAG(int, threads, 0, "generation threads (0: all cores)");

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
  hmoe::WriteOptions options;
  options.seed = absl::GetFlag(FLAGS_seed);
  options.fp8 = dtype == "fp8";
  if (absl::GetFlag(FLAGS_shard_size_mb) < 0) {
    std::fprintf(stderr, "hmoe-make-model: --shard-size-mb must be >= 0\n");
    return 2;
  }
  options.shard_size_bytes = absl::GetFlag(FLAGS_shard_size_mb) << 20;
  options.force = absl::GetFlag(FLAGS_force);
  const int threads = absl::GetFlag(FLAGS_threads);
  options.num_threads =
      threads > 0 ? threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));

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
