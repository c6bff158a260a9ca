// One DSLP rank as its own process, for the multi-process tests (tests/dslp/dslp_test.cc) and for
// measurements: opens the checkpoint, joins the shared-memory group, prefills the prompt with
// DslpRank on a CPU device and writes a RankOutput (rank_output.h).
//
// Failure injection: --die_at_op=N makes the rank SIGKILL itself when it enters its N-th
// collective (counting from 1) of the first prefill. Survivors of a failed prefill re-form a new
// group when --reform_group is given (with --reform_rank / --reform_world_size) and run the
// prefill again there ("the group serves the next request").

#include <signal.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/comm/shm_collective.h"
#include "common/device/cpu_device.h"
#include "common/dslp/dslp.h"
#include "common/engine/engine.h"
#include "common/engine/kv_cache.h"
#include "common/engine/weights.h"
#include "common/model/checkpoint.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "tests/dslp/rank_output.h"

ABSL_FLAG(std::string, model, "", "checkpoint directory");
ABSL_FLAG(std::string, group, "", "shm group name");
ABSL_FLAG(int, rank, 0, "this rank");
ABSL_FLAG(int, world_size, 1, "ranks in the group");
ABSL_FLAG(std::string, ep_mode, "small_ep", "standard or small_ep");
ABSL_FLAG(int64_t, prompt_len, 64, "prompt length");
ABSL_FLAG(uint32_t, prompt_seed, 1, "prompt seed");
ABSL_FLAG(std::string, out, "", "output file");
ABSL_FLAG(int, threads, 1, "CPU pool threads");
ABSL_FLAG(int, peer_timeout_ms, 3000, "peer heartbeat timeout");
ABSL_FLAG(int64_t, block_size, 16, "KV cache block size");
ABSL_FLAG(int, repeat, 1, "prefills in the group");
ABSL_FLAG(int, die_at_op, 0, "SIGKILL this rank at its N-th collective (0: never)");
ABSL_FLAG(std::string, reform_group, "", "after a failed prefill: join this group and retry");
ABSL_FLAG(int, reform_rank, 0, "rank in the re-formed group");
ABSL_FLAG(int, reform_world_size, 1, "size of the re-formed group");

namespace hmoe {
namespace {

// Forwards to a collective; dies (SIGKILL, no cleanup) on entering the N-th collective.
class DyingCollective final : public Collective {
 public:
  DyingCollective(Collective& inner, int die_at) : inner_(inner), die_at_(die_at) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  std::string description() const override { return inner_.description(); }
  absl::Status AllGatherV(Stream& s, const void* send, void* recv, std::span<const size_t> c,
                          std::span<const size_t> o) override {
    Tick();
    return inner_.AllGatherV(s, send, recv, c, o);
  }
  absl::Status AllToAllV(Stream& s, const void* send, std::span<const size_t> sc,
                         std::span<const size_t> so, void* recv, std::span<const size_t> rc,
                         std::span<const size_t> ro) override {
    Tick();
    return inner_.AllToAllV(s, send, sc, so, recv, rc, ro);
  }
  absl::Status RingSendRecv(Stream& s, const void* send, size_t sb, void* recv,
                            size_t rb) override {
    Tick();
    return inner_.RingSendRecv(s, send, sb, recv, rb);
  }
  absl::Status AllReduceSum(Stream& s, const float* send, float* recv, size_t count) override {
    Tick();
    return inner_.AllReduceSum(s, send, recv, count);
  }
  absl::Status Barrier() override {
    Tick();
    return inner_.Barrier();
  }
  CommCounters counters() const override { return inner_.counters(); }
  void ResetCounters() override { inner_.ResetCounters(); }

 private:
  void Tick() {
    if (die_at_ > 0 && ++ops_ == die_at_) {
      std::fprintf(stderr, "rank %d: dying at collective %d\n", inner_.rank(), ops_);
      std::fflush(stderr);
      ::raise(SIGKILL);
    }
  }
  Collective& inner_;
  const int die_at_;
  int ops_ = 0;
};

struct Rig {
  std::unique_ptr<CpuWorkerPool> pool;
  std::unique_ptr<Device> device;
  std::unique_ptr<Checkpoint> checkpoint;
  std::unique_ptr<ResidentWeights> weights;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<KvCache> cache;
};

absl::StatusOr<Rig> MakeRig(int64_t prompt_len) {
  Rig rig;
  CpuWorkerPoolOptions pool_options;
  pool_options.num_nodes = 1;
  pool_options.threads_per_node = absl::GetFlag(FLAGS_threads);
  pool_options.pin_threads = false;
  HMOE_ASSIGN_OR_RETURN(rig.pool, CpuWorkerPool::Create(pool_options));
  CpuDeviceOptions device_options;
  device_options.pool = rig.pool.get();
  rig.device = NewCpuDevice(device_options);
  HMOE_ASSIGN_OR_RETURN(rig.checkpoint, Checkpoint::Open(absl::GetFlag(FLAGS_model)));
  const ModelConfig& config = rig.checkpoint->config();
  HMOE_ASSIGN_OR_RETURN(rig.weights, ResidentWeights::Create(config, *rig.checkpoint, *rig.device));
  EngineOptions options;
  options.max_step_tokens = prompt_len;
  options.experts = ExpertPlacement::kDevice;
  HMOE_ASSIGN_OR_RETURN(rig.engine,
                        Engine::Create(config, *rig.weights, *rig.device, *rig.pool, options));
  const int64_t bs = absl::GetFlag(FLAGS_block_size);
  HMOE_ASSIGN_OR_RETURN(
      rig.cache, KvCache::Create(*rig.device, KvCacheConfig::ForModel(
                                                  config, (prompt_len + bs - 1) / bs + 1, bs)));
  return rig;
}

// Where the routing observer of the running prefill writes ([layer][position][top_k]).
std::vector<int32_t>* g_routing = nullptr;

void ObserveRouting(int64_t layer, std::span<const int32_t> positions, int64_t top_k,
                    const int32_t* ids) {
  const int64_t n = absl::GetFlag(FLAGS_prompt_len);
  for (size_t i = 0; i < positions.size(); ++i) {
    for (int64_t j = 0; j < top_k; ++j) {
      (*g_routing)[(layer * n + positions[i]) * top_k + j] = ids[i * top_k + j];
    }
  }
}

dslp_test::PrefillRecord RunPrefill(Rig& rig, DslpRank& dslp, const std::vector<int32_t>& prompt) {
  dslp_test::PrefillRecord record;
  const ModelConfig& config = rig.checkpoint->config();
  record.routing.assign(config.num_hidden_layers * prompt.size() * config.num_experts_per_tok, -1);
  g_routing = &record.routing;
  KvSequence seq = rig.cache->NewSequence();
  absl::StatusOr<DslpResult> result = dslp.Prefill(prompt, seq);
  record.status_code = static_cast<int32_t>(result.status().code());
  record.status_message = std::string(result.status().message());
  if (!result.ok()) return record;
  record.logits = result->logits;
  const DslpStats& stats = dslp.last_stats();
  record.layers = stats.layers;
  record.bytes_sent = stats.comm.bytes_sent;
  record.bytes_received = stats.comm.bytes_received;
  record.ring_sent = stats.ring_sent;
  record.dispatch_sent = stats.dispatch_sent;
  record.combine_sent = stats.combine_sent;
  record.meta_sent = stats.meta_sent;
  record.local_tokens = stats.local_tokens;
  record.total_s = stats.total_s;
  if (dslp.rank() == 0) {
    record.kv.resize(rig.cache->ExportBytes(seq.num_tokens()));
    auto stream = rig.device->CreateStream();
    absl::Status s = stream.ok()
                         ? rig.cache->Export(seq, **stream, record.kv.data(), MemorySpace::kHost)
                         : stream.status();
    if (s.ok()) s = (*stream)->Synchronize();
    if (!s.ok()) {
      record.status_code = static_cast<int32_t>(s.code());
      record.status_message = std::string(s.message());
    }
  }
  return record;
}

absl::StatusOr<std::unique_ptr<ShmCollective>> Join(const std::string& group, int rank, int world) {
  ShmCollectiveOptions o;
  o.group_name = group;
  o.rank = rank;
  o.world_size = world;
  o.peer_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_peer_timeout_ms));
  o.join_timeout = absl::Seconds(60);
  return ShmCollective::Create(o);
}

int Main() {
  const int64_t prompt_len = absl::GetFlag(FLAGS_prompt_len);
  absl::StatusOr<Rig> rig = MakeRig(prompt_len);
  if (!rig.ok()) {
    HMOE_LOG(ERROR) << rig.status();
    return 2;
  }
  absl::StatusOr<EpMode> mode = ParseEpMode(absl::GetFlag(FLAGS_ep_mode));
  if (!mode.ok()) {
    HMOE_LOG(ERROR) << mode.status();
    return 2;
  }
  const std::vector<int32_t> prompt = dslp_test::MakePrompt(
      prompt_len, absl::GetFlag(FLAGS_prompt_seed), rig->checkpoint->config().vocab_size);
  dslp_test::RankOutput out;
  out.rank = absl::GetFlag(FLAGS_rank);
  out.world_size = absl::GetFlag(FLAGS_world_size);
  bool failed = false;
  {
    auto comm = Join(absl::GetFlag(FLAGS_group), out.rank, out.world_size);
    if (!comm.ok()) {
      HMOE_LOG(ERROR) << comm.status();
      return 3;
    }
    DyingCollective dying(**comm, absl::GetFlag(FLAGS_die_at_op));
    DslpOptions options;
    options.ep_mode = *mode;
    options.routing_observer = ObserveRouting;
    auto dslp = DslpRank::Create(*rig->engine, dying, options);
    if (!dslp.ok()) {
      HMOE_LOG(ERROR) << dslp.status();
      return 4;
    }
    for (int i = 0; i < absl::GetFlag(FLAGS_repeat) && !failed; ++i) {
      out.prefills.push_back(RunPrefill(*rig, **dslp, prompt));
      failed = out.prefills.back().status_code != 0;
      if (failed) {
        HMOE_LOG(INFO) << "rank " << out.rank
                       << ": prefill failed: " << out.prefills.back().status_message;
      }
    }
  }
  if (failed && !absl::GetFlag(FLAGS_reform_group).empty()) {
    auto comm = Join(absl::GetFlag(FLAGS_reform_group), absl::GetFlag(FLAGS_reform_rank),
                     absl::GetFlag(FLAGS_reform_world_size));
    if (!comm.ok()) {
      HMOE_LOG(ERROR) << comm.status();
      return 5;
    }
    DslpOptions options;
    options.ep_mode = *mode;
    options.routing_observer = ObserveRouting;
    auto dslp = DslpRank::Create(*rig->engine, **comm, options);
    if (!dslp.ok()) return 6;
    out.prefills.push_back(RunPrefill(*rig, **dslp, prompt));
  }
  absl::Status written = dslp_test::WriteRankOutput(absl::GetFlag(FLAGS_out), out);
  if (!written.ok()) {
    HMOE_LOG(ERROR) << written;
    return 7;
  }
  return 0;
}

}  // namespace
}  // namespace hmoe

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return hmoe::Main();
}
