// What attaching costs at full DeepSeek-V3 scale: parsing the manifest of ~92k tensors (the rest of
// WeightStore::Attach is a handful of system calls per segment and touches no weight pages).

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include <benchmark/benchmark.h>

#include "common/shm/layout.h"
#include "common/shm/manifest.h"

namespace hmoe::shm {
namespace {

// The DeepSeek-V3 tensor index (MODEL-SPEC 2.1): 61 layers, 3 dense, 256 routed experts.
std::vector<TensorIndexEntry> DeepSeekV3Index() {
  std::vector<TensorIndexEntry> index;
  auto add = [&](std::string name, DType dtype, std::vector<int64_t> shape) {
    uint64_t n = DTypeSize(dtype);
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    index.push_back({std::move(name), dtype, std::move(shape), n});
  };
  auto fp8 = [&](const std::string& name, int64_t rows, int64_t cols) {
    add(name, DType::kF8E4M3, {rows, cols});
    add(name + "_scale_inv", DType::kF32, {(rows + 127) / 128, (cols + 127) / 128});
  };
  add("model.embed_tokens.weight", DType::kBF16, {129280, 7168});
  for (int l = 0; l < 61; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    add(p + "input_layernorm.weight", DType::kBF16, {7168});
    add(p + "post_attention_layernorm.weight", DType::kBF16, {7168});
    fp8(p + "self_attn.q_a_proj.weight", 1536, 7168);
    add(p + "self_attn.q_a_layernorm.weight", DType::kBF16, {1536});
    fp8(p + "self_attn.q_b_proj.weight", 24576, 1536);
    fp8(p + "self_attn.kv_a_proj_with_mqa.weight", 576, 7168);
    add(p + "self_attn.kv_a_layernorm.weight", DType::kBF16, {512});
    fp8(p + "self_attn.kv_b_proj.weight", 32768, 512);
    fp8(p + "self_attn.o_proj.weight", 7168, 16384);
    if (l < 3) {
      fp8(p + "mlp.gate_proj.weight", 18432, 7168);
      fp8(p + "mlp.up_proj.weight", 18432, 7168);
      fp8(p + "mlp.down_proj.weight", 7168, 18432);
      continue;
    }
    add(p + "mlp.gate.weight", DType::kBF16, {256, 7168});
    add(p + "mlp.gate.e_score_correction_bias", DType::kF32, {256});
    for (int e = 0; e < 256; ++e) {
      const std::string x = absl::StrCat(p, "mlp.experts.", e, ".");
      fp8(x + "gate_proj.weight", 2048, 7168);
      fp8(x + "up_proj.weight", 2048, 7168);
      fp8(x + "down_proj.weight", 7168, 2048);
    }
    fp8(p + "mlp.shared_experts.gate_proj.weight", 2048, 7168);
    fp8(p + "mlp.shared_experts.up_proj.weight", 2048, 7168);
    fp8(p + "mlp.shared_experts.down_proj.weight", 7168, 2048);
  }
  add("model.norm.weight", DType::kBF16, {7168});
  add("lm_head.weight", DType::kBF16, {129280, 7168});
  return index;
}

void BM_ParseDeepSeekV3Manifest(benchmark::State& state) {
  LayoutOptions o;
  o.num_slices = static_cast<uint32_t>(state.range(0));
  o.slice_nodes.assign(o.num_slices, -1);
  absl::StatusOr<Manifest> m = PlanLayout(DeepSeekV3Index(), o);
  if (!m.ok()) {
    state.SkipWithError("plan failed");
    return;
  }
  const std::string bytes = m->Serialize();
  const auto span = std::as_bytes(std::span(bytes.data(), bytes.size()));
  for (auto _ : state) {
    absl::StatusOr<Manifest> parsed = Manifest::Parse(span);
    benchmark::DoNotOptimize(parsed);
    // An attached store keeps its manifest: freeing it is not part of attaching.
    state.PauseTiming();
    parsed = absl::CancelledError();
    state.ResumeTiming();
  }
  state.counters["tensors"] = static_cast<double>(m->tensors.size());
  state.counters["manifest_MB"] = static_cast<double>(bytes.size()) / 1e6;
  state.counters["model_GB"] = static_cast<double>(m->total_tensor_bytes) / 1e9;
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes.size()));
}
BENCHMARK(BM_ParseDeepSeekV3Manifest)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond);

void BM_Checksum64(benchmark::State& state) {
  const std::string bytes(static_cast<size_t>(state.range(0)), 'x');
  const auto span = std::as_bytes(std::span(bytes.data(), bytes.size()));
  for (auto _ : state) benchmark::DoNotOptimize(Checksum64(span));
  state.SetBytesProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_Checksum64)->Arg(16 << 20);

}  // namespace
}  // namespace hmoe::shm

BENCHMARK_MAIN();
