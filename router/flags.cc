#include "router/flags.h"

#include <unistd.h>

#include <random>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/base/unix_socket.h"
#include "common/model/gguf_model.h"
#include "common/model/gguf_source.h"
#include "common/model/model_config.h"
#include "common/process/daemon.h"
#include "common/process/socket_path.h"
#include "router/validation.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "public gRPC address (host:port; port 0 picks one)");
ABSL_FLAG(std::string, registry_socket, "",
          "unix socket for the worker registry (its directory is created 0700); empty: serve the "
          "registry on --listen too");
ABSL_FLAG(
    std::string, model, "",
    "checkpoint directory (config.json limits and the tokenizer) or GGUF file (its metadata)");
ABSL_FLAG(int, vocab_size, 0, "vocabulary size without --model");
ABSL_FLAG(int, context_length, 0, "context length without --model (0: unchecked)");
ABSL_FLAG(int, chunk_threshold, 2048, "prompts with fewer tokens take chunked prefill");
ABSL_FLAG(int, decode_idle_window_s, 300, "DSLP only when decode was idle this long");
ABSL_FLAG(int, max_inflight, 256,
          "requests in flight; RESOURCE_EXHAUSTED beyond (or beyond the room the live decode "
          "workers advertise, when less)");
ABSL_FLAG(int, max_prefill_queue, 64,
          "long prompts waiting for a prefill worker; RESOURCE_EXHAUSTED beyond");
ABSL_FLAG(bool, cpu_devices_shared, true,
          "workers on \"cpu\" devices compete for one device (off: CPU prefill workers count as "
          "not sharing the decode worker's device, so SLP runs next to decode)");
ABSL_FLAG(std::string, prefix_cache_imports, "exact",
          "which KV handed over by prefill workers may join the decode worker's prefix cache: "
          "exact (only where it is bit-identical to the decode worker's own prefill: SLP on CPU "
          "prefill workers next to a CPU decode worker; reuse then gives exactly the tokens of "
          "recomputing) or all (also DSLP and GPU prefills: more reuse, that path's rounding)");
ABSL_FLAG(std::string, dslp_ep_mode, "default",
          "DSLP expert parallelism: default, standard, small_ep");
ABSL_FLAG(int, max_request_bytes, 4 << 20, "largest accepted request message");
ABSL_FLAG(int, heartbeat_interval_ms, 0,
          "heartbeat period the router asks workers for; 0: a third of --heartbeat_timeout_ms "
          "(at most 1000); the timeout must be at least twice the period");
ABSL_FLAG(int, heartbeat_timeout_ms, 3000, "a worker silent this long is dead");
ABSL_FLAG(int, cancel_poll_ms, 20,
          "how often the router checks whether gRPC clients cancelled (HTTP clients that leave "
          "are acted on at once)");
ABSL_FLAG(int, retry_wait_ms, 5000, "how long a retried request waits for a live decode worker");
ABSL_FLAG(int, max_dispatch_attempts, 3,
          "dispatches of a request that has streamed no token yet (the first plus retries after a "
          "worker failed); 1: no retries");
ABSL_FLAG(int, dslp_failure_grace_ms, 2000,
          "when a DSLP rank reports a broken group, how long the other ranks may take to report");
ABSL_FLAG(double, drain_seconds, 30, "on SIGTERM, how long in-flight requests may finish");
ABSL_FLAG(std::string, port_file, "", "write the bound public port here (tests)");

namespace hmoe::router {

using process::FlagError;

absl::Status ReadFlags(RouterFlags& f) {
  f.listen = absl::GetFlag(FLAGS_listen);
  HMOE_RETURN_IF_ERROR(FlagError(ValidateListenAddress(f.listen)));
  // A unix --listen path a running router accepts on is refused (gRPC would unlink it and bind).
  if (absl::StartsWith(f.listen, "unix:")) {
    absl::Status claimed = ClaimUnixSocketPath(f.listen.substr(5), "--listen");
    if (absl::IsInvalidArgument(claimed)) return FlagError(claimed);
    HMOE_RETURN_IF_ERROR(claimed);
  }
  RouterOptions& options = f.options;
  std::unique_ptr<Tokenizer>& tokenizer = f.tokenizer;
  const std::string model_dir = absl::GetFlag(FLAGS_model);
  f.model_dir = model_dir;
  options.limits.vocab_size = absl::GetFlag(FLAGS_vocab_size);
  options.limits.context_length = absl::GetFlag(FLAGS_context_length);
  std::unique_ptr<GgufModel> gguf;  // --model FILE.gguf: config and tokenizer from its metadata
  if (IsGgufPath(model_dir)) {
    HMOE_ASSIGN_OR_RETURN(gguf, GgufModel::Open(model_dir));
  }
  if (!model_dir.empty()) {
    HMOE_ASSIGN_OR_RETURN(const ModelConfig config,
                          gguf != nullptr ? ModelConfigFromGguf(*gguf)
                                          : ModelConfig::FromFile(model_dir + "/config.json"));
    options.limits.vocab_size = static_cast<int32_t>(config.vocab_size);
    options.limits.context_length = static_cast<int32_t>(config.max_position_embeddings);
    options.bos_token_id = static_cast<int32_t>(config.bos_token_id);
    if (!config.eos_token_ids.empty()) {
      options.eos_token_id = static_cast<int32_t>(config.eos_token_ids[0]);
    }
    for (const auto id : config.eos_token_ids) {
      options.eos_token_ids.push_back(static_cast<int32_t>(id));
    }
    absl::StatusOr<std::unique_ptr<Tokenizer>> t =
        gguf != nullptr ? TokenizerFromGguf(*gguf) : Tokenizer::Load(model_dir);
    if (t.ok()) {
      tokenizer = *std::move(t);
    } else if (absl::IsNotFound(t.status())) {
      HMOE_LOG(WARNING) << "no tokenizer in " << model_dir << ": token-id prompts only";
    } else {
      return t.status();
    }
    options.model_name = model_dir;
  }
  if (options.limits.vocab_size <= 0)
    return absl::InvalidArgumentError("give --model DIR or --vocab_size");
  options.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  options.limits.max_request_bytes = options.max_request_bytes;
  options.policy.chunk_threshold_tokens = absl::GetFlag(FLAGS_chunk_threshold);
  options.policy.decode_idle_window = absl::Seconds(absl::GetFlag(FLAGS_decode_idle_window_s));
  options.max_inflight = absl::GetFlag(FLAGS_max_inflight);
  options.max_prefill_queue = absl::GetFlag(FLAGS_max_prefill_queue);
  options.policy.cpu_devices_shared = absl::GetFlag(FLAGS_cpu_devices_shared);
  const std::string imports = absl::GetFlag(FLAGS_prefix_cache_imports);
  if (imports != "exact" && imports != "all") {
    return FlagError(absl::StrCat("--prefix-cache-imports \"", imports, "\" must be exact or all"));
  }
  options.prefix_cache_all_imports = imports == "all";
  // DSLP group names: unique to this instance and unpredictable, so neither another router nor
  // another user can hold the shared-memory name of a group before its ranks create it.
  options.dslp_group_prefix =
      absl::StrCat("hmoe-dslp-", getpid(), "-", absl::Hex(std::random_device()(), absl::kZeroPad8));
  if (const std::string ep = absl::GetFlag(FLAGS_dslp_ep_mode); ep == "standard") {
    options.dslp_ep_mode = 1;
  } else if (ep == "small_ep") {
    options.dslp_ep_mode = 2;
  } else if (ep != "default") {
    return FlagError(absl::StrCat("--dslp_ep_mode: default, standard or small_ep, got ", ep));
  }
  if (options.max_inflight < 1 || options.max_prefill_queue < 0 || options.max_request_bytes < 1) {
    return FlagError(
        "--max_inflight and --max_request_bytes must be >= 1, --max_prefill_queue >= 0");
  }
  options.retry_wait = absl::Milliseconds(absl::GetFlag(FLAGS_retry_wait_ms));
  if (absl::GetFlag(FLAGS_cancel_poll_ms) < 1) return FlagError("--cancel_poll_ms must be >= 1");
  options.cancel_poll = absl::Milliseconds(absl::GetFlag(FLAGS_cancel_poll_ms));
  options.max_dispatch_attempts = absl::GetFlag(FLAGS_max_dispatch_attempts);
  options.dslp_failure_grace = absl::Milliseconds(absl::GetFlag(FLAGS_dslp_failure_grace_ms));
  if (options.max_dispatch_attempts < 1 || options.dslp_failure_grace < absl::ZeroDuration()) {
    return FlagError("--max_dispatch_attempts must be >= 1, --dslp_failure_grace_ms >= 0");
  }
  f.heartbeat_timeout_ms = absl::GetFlag(FLAGS_heartbeat_timeout_ms);
  const absl::StatusOr<int> heartbeat_interval_ms = ResolveHeartbeatIntervalMs(
      f.heartbeat_timeout_ms, absl::GetFlag(FLAGS_heartbeat_interval_ms));
  HMOE_RETURN_IF_ERROR(FlagError(heartbeat_interval_ms.status()));
  f.heartbeat_interval_ms = *heartbeat_interval_ms;
  f.port_file = absl::GetFlag(FLAGS_port_file);
  f.drain_seconds = absl::GetFlag(FLAGS_drain_seconds);
  f.registry_socket = absl::GetFlag(FLAGS_registry_socket);
  if (f.registry_socket.empty()) return absl::OkStatus();
  return process::PrepareSocketPath("--registry_socket", f.registry_socket);
}

}  // namespace hmoe::router
