// hmoe-decode-worker: continuous-batching decode (and chunked prefill) with CPU experts and
// attention on the CPU or a GPU, served on a unix socket. See docs/decode_worker.md.
//
//   hmoe-decode-worker (--model DIR | --weightd-instance NAME) --socket PATH
//                      [--device cpu|cuda:N] [--threads N] [--batch-size 6] [--chunk-size 512]
//                      [--dual-batch on|off|auto] [--kv-blocks N | --kv-memory-mb MB]
//                      [--router ADDR] [--worker-id ID] [--drain-seconds S]
//
// Exit codes: 0 after SIGTERM/SIGINT (drained), 1 on a start-up or runtime error, 2 on bad flags.

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "common/base/flags.h"
#include "common/base/logging.h"
#include "common/device/cpu_device.h"
#include "common/device/device.h"
#include "common/kv/kv_handoff.h"
#include "common/model/model_config.h"
#include "common/ops/cpu/cpu_worker_pool.h"
#include "common/rpc/registry_client.h"
#include "common/rpc/worker_setup.h"
#include "common/shm/worker_weights.h"
#include "decode_worker/decode_service.h"
#include "decode_worker/forward_pass_step_engine.h"
#include "decode_worker/scheduler.h"
#include "decode_worker/startup_settings.h"

ABSL_FLAG(std::string, model, "", "checkpoint directory, opened directly (tests, CPU-only use)");
ABSL_FLAG(std::string, weightd_instance, "", "attach to this hmoe-weightd instance's weights");
ABSL_FLAG(std::string, socket, "", "unix socket to serve on (its directory must be 0700)");
ABSL_FLAG(std::string, device, "cpu", "attention device: cpu or cuda:N");
ABSL_FLAG(int, threads, 0, "CPU threads per NUMA node for experts and CPU attention (0: all)");
ABSL_FLAG(bool, pin_threads, true, "pin CPU worker threads to cores");
ABSL_FLAG(int, batch_size, 6, "target running batch size Y");
ABSL_FLAG(int, chunk_size, 512, "prompt tokens per chunked-prefill step");
ABSL_FLAG(int, prefills_per_step, 6,
          "prefill chunks (of different requests) a step may carry, within --chunk-size tokens; "
          "1: one chunk per step");
ABSL_FLAG(std::string, prefill_packing, "auto",
          "whether a prefill chunk beyond a step's first joins it: auto (when the cost model "
          "fitted to this worker's steps says it lowers latency) or always (whenever it fits)");
ABSL_FLAG(std::string, dual_batch, "auto",
          "dual-batch attention/MoE overlap: on, off, or auto (on with a GPU attention device)");
ABSL_FLAG(int, max_waiting, 64, "admitted requests that may wait; RESOURCE_EXHAUSTED beyond");
ABSL_FLAG(int64_t, kv_blocks, 0, "KV cache blocks (exclusive with --kv-memory-mb)");
ABSL_FLAG(int64_t, kv_memory_mb, 0, "KV cache memory in MiB (default 1024 without --kv-blocks)");
ABSL_FLAG(int, kv_block_tokens, 64, "tokens per KV block");
ABSL_FLAG(std::string, router, "", "router registry address; empty: run without a router");
ABSL_FLAG(std::string, worker_id, "", "worker id for the router and logs (default decode-<pid>)");
ABSL_FLAG(int, heartbeat_ms, 1000, "heartbeat period to the router");
ABSL_FLAG(double, drain_seconds, 30, "on SIGTERM, how long in-flight requests may finish");

namespace hmoe::decode {
namespace {

constexpr char kServiceName[] = "hmoe.decode.v1.DecodeService";
constexpr int kExitError = 1;
constexpr int kExitBadFlags = 2;

int Run() {
  const absl::Time start = absl::Now();
  // --- flags
  absl::StatusOr<rpc::WorkerSourceFlags> source =
      rpc::CheckWorkerSourceFlags(absl::GetFlag(FLAGS_model), absl::GetFlag(FLAGS_weightd_instance),
                                  absl::GetFlag(FLAGS_socket), absl::GetFlag(FLAGS_device));
  if (!source.ok()) {
    HMOE_LOG(ERROR) << source.status().message();
    return kExitBadFlags;
  }
  const std::string& socket_path = source->socket_path;
  const DeviceSpec device_spec = source->device;
  absl::StatusOr<bool> dual = ResolveDualBatch(absl::GetFlag(FLAGS_dual_batch), device_spec.kind);
  if (!dual.ok()) {
    HMOE_LOG(ERROR) << dual.status().message();
    return kExitBadFlags;
  }
  SchedulerOptions sched_options;
  sched_options.batch_size = absl::GetFlag(FLAGS_batch_size);
  sched_options.chunk_size = absl::GetFlag(FLAGS_chunk_size);
  sched_options.prefills_per_step = absl::GetFlag(FLAGS_prefills_per_step);
  absl::StatusOr<PackingPolicy> packing = ParsePackingPolicy(absl::GetFlag(FLAGS_prefill_packing));
  if (!packing.ok()) {
    HMOE_LOG(ERROR) << "--prefill-packing: " << packing.status().message();
    return kExitBadFlags;
  }
  sched_options.packing = *packing;
  sched_options.max_waiting = absl::GetFlag(FLAGS_max_waiting);
  sched_options.dual_batch = *dual;
  const int threads = absl::GetFlag(FLAGS_threads);
  const int block_tokens = absl::GetFlag(FLAGS_kv_block_tokens);
  const double drain_seconds = absl::GetFlag(FLAGS_drain_seconds);
  const int heartbeat_ms = absl::GetFlag(FLAGS_heartbeat_ms);
  if (sched_options.batch_size < 1 || sched_options.chunk_size < 1 ||
      sched_options.prefills_per_step < 1 || sched_options.max_waiting < 0 || threads < 0 ||
      block_tokens < 1 || drain_seconds < 0 || heartbeat_ms < 1) {
    HMOE_LOG(ERROR) << "--batch-size, --chunk-size, --prefills-per-step, --kv-block-tokens and "
                       "--heartbeat-ms must be >= 1; --max-waiting, --threads and "
                       "--drain-seconds >= 0";
    return kExitBadFlags;
  }
  int64_t kv_memory_mb = absl::GetFlag(FLAGS_kv_memory_mb);
  const int64_t kv_blocks_flag = absl::GetFlag(FLAGS_kv_blocks);
  if (kv_blocks_flag == 0 && kv_memory_mb == 0) kv_memory_mb = 1024;
  if (absl::Status s = PrepareSocketPath(socket_path); !s.ok()) {
    HMOE_LOG(ERROR) << s.message();
    return absl::IsInvalidArgument(s) ? kExitBadFlags : kExitError;
  }
  std::string worker_id = absl::GetFlag(FLAGS_worker_id);
  if (worker_id.empty()) worker_id = absl::StrCat("decode-", ::getpid());

  // --- signals: taken by one thread with sigtimedwait; every other thread has them blocked.
  rpc::StopSignalWatcher signals;

  // --- weights, device, engine
  absl::StatusOr<shm::WeightSourceHolder> weights =
      shm::OpenWeights(source->model_dir, source->instance);
  if (!weights.ok()) {
    HMOE_LOG(ERROR) << "open weights: " << weights.status().message();
    return kExitError;
  }
  CpuWorkerPoolOptions pool_options;
  pool_options.threads_per_node = threads;
  pool_options.pin_threads = absl::GetFlag(FLAGS_pin_threads);
  absl::StatusOr<std::unique_ptr<CpuWorkerPool>> pool = CpuWorkerPool::Create(pool_options);
  if (!pool.ok()) {
    HMOE_LOG(ERROR) << "cpu worker pool: " << pool.status().message();
    return kExitError;
  }
  CpuDeviceOptions cpu_options;
  cpu_options.pool = pool->get();
  absl::StatusOr<std::unique_ptr<Device>> new_device =
      rpc::NewWorkerDevice(device_spec, cpu_options, /*cuda_budget_bytes=*/0);
  if (!new_device.ok()) {
    HMOE_LOG(ERROR) << new_device.status().message();
    return kExitError;
  }
  std::unique_ptr<Device> device = *std::move(new_device);
  absl::StatusOr<int64_t> kv_blocks =
      ResolveKvBlocks(kv_blocks_flag, kv_memory_mb, KvBlockBytes(weights->config, block_tokens));
  if (!kv_blocks.ok()) {
    HMOE_LOG(ERROR) << kv_blocks.status().message();
    return kExitBadFlags;
  }
  ForwardPassStepEngineOptions engine_options;
  engine_options.max_step_tokens = sched_options.chunk_size + sched_options.batch_size;
  engine_options.max_step_sequences = sched_options.batch_size;
  engine_options.kv_blocks = *kv_blocks;
  engine_options.kv_block_tokens = block_tokens;
  absl::StatusOr<std::unique_ptr<ForwardPassStepEngine>> engine = ForwardPassStepEngine::Create(
      weights->config, weights->source(), *device, **pool, engine_options);
  if (!engine.ok()) {
    HMOE_LOG(ERROR) << "engine: " << engine.status().message();
    return kExitError;
  }
  absl::StatusOr<std::unique_ptr<Scheduler>> scheduler = Scheduler::Create(**engine, sched_options);
  if (!scheduler.ok()) {
    HMOE_LOG(ERROR) << "scheduler: " << scheduler.status().message();
    return absl::IsInvalidArgument(scheduler.status()) ? kExitBadFlags : kExitError;
  }
  // Shared-memory hand-offs, and CUDA IPC ones (into the attention GPU's pool, or through host
  // memory when attention runs on the CPU).
  KvImportTarget import_target;
  if (device_spec.kind == DeviceKind::kCuda) import_target.cuda_device = device_spec.ordinal;
  std::unique_ptr<KvImporter> importer = NewKvImporter(import_target);
  if (signals.StopRequested()) {
    HMOE_LOG(INFO) << "stopped while starting";
    return 0;
  }

  // --- gRPC
  DecodeServiceImpl service(scheduler->get(), engine->get(), importer.get(),
                            DecodeServiceInfo{worker_id, (*engine)->device_name()});
  absl::StatusOr<std::unique_ptr<grpc::Server>> serving =
      rpc::ServeOnUnixSocket(socket_path, &service, kServiceName);
  if (!serving.ok()) {
    HMOE_LOG(ERROR) << serving.status().message();
    return kExitError;
  }
  grpc::Server* server = serving->get();
  HMOE_LOG(INFO) << "SERVING on unix:" << socket_path << " as " << worker_id << ": "
                 << weights->description << ", device " << (*engine)->device_name() << ", "
                 << (*pool)->num_threads() << " cpu threads, batch " << sched_options.batch_size
                 << ", chunk " << sched_options.chunk_size << " ("
                 << sched_options.prefills_per_step << " prefill(s) per step, packing "
                 << PackingPolicyName(sched_options.packing) << "), dual batch "
                 << (sched_options.dual_batch ? "on" : "off") << ", kv " << *kv_blocks
                 << " blocks of " << block_tokens << " tokens, ready in "
                 << absl::ToDoubleSeconds(absl::Now() - start) << " s";

  std::unique_ptr<rpc::RegistryClient> registry;
  const std::string router = absl::GetFlag(FLAGS_router);
  if (!router.empty()) {
    rpc::RegistryClientOptions ro;
    ro.kind = rpc::WorkerKind::kDecode;
    ro.router_target = router;
    ro.worker_id = worker_id;
    ro.endpoint = "unix:" + socket_path;
    ro.device = (*engine)->device_name();
    ro.model = weights->description;
    ro.pid = ::getpid();
    ro.start_unix_ms = absl::ToUnixMillis(start);
    ro.heartbeat_interval = absl::Milliseconds(heartbeat_ms);
    Scheduler* sched = scheduler->get();
    registry = std::make_unique<rpc::RegistryClient>(ro, [sched] {
      const SchedulerStats s = sched->stats();
      rpc::WorkerLoadReport r;
      r.draining = s.draining;
      r.running = s.running;
      r.waiting = s.waiting;
      r.batch_size = sched->options().batch_size;
      r.max_waiting = sched->options().max_waiting;
      r.kv_blocks_free = s.kv_blocks_free;
      r.kv_blocks_total = s.kv_blocks_total;
      r.tokens_per_second = s.tokens_per_second;
      return r;
    });
  } else {
    HMOE_LOG(INFO) << "no --router: not registering with a router";
  }

  // --- drain on SIGTERM
  signals.WaitForStop();
  rpc::SetServing(*server, kServiceName, false);
  (*scheduler)->StopAccepting();
  const bool drained = (*scheduler)->WaitIdle(absl::Now() + absl::Seconds(drain_seconds));
  if (!drained) {
    HMOE_LOG(WARNING) << "drain time of " << drain_seconds
                      << " s exceeded; cancelling in-flight requests";
  }
  (*scheduler)->Shutdown();  // Cancels what is left; handlers then send their last message.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  if (registry != nullptr) registry->Stop();
  ::unlink(socket_path.c_str());
  const SchedulerStats stats = (*scheduler)->stats();
  HMOE_LOG(INFO) << "stopped: " << stats.requests_finished << " requests ("
                 << stats.requests_cancelled << " cancelled, " << stats.requests_failed
                 << " failed), " << stats.tokens_generated << " tokens in " << stats.steps
                 << " steps";
  return 0;
}

}  // namespace
}  // namespace hmoe::decode

int main(int argc, char** argv) {
  std::vector<std::string> storage;
  std::vector<char*> args = hmoe::NormalizeFlagNames(argc, argv, storage);
  hmoe::SetUsage(
      "hmoe-decode-worker (--model DIR | --weightd-instance NAME) --socket PATH [--device "
      "cpu|cuda:N] [--threads N] [--batch-size 6] [--chunk-size 512] [--prefills-per-step 6] "
      "[--prefill-packing auto|always] [--dual-batch on|off|auto] "
      "[--kv-blocks N | --kv-memory-mb MB] [--router ADDR] [--worker-id ID] [--drain-seconds S]");
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  if (positional.size() > 1) {
    HMOE_LOG(ERROR) << "unexpected argument \"" << positional[1] << "\"";
    return 2;
  }
  return hmoe::decode::Run();
}
