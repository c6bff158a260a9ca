#include "common/rpc/registry_client.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include <grpcpp/grpcpp.h>

#include "common/base/logging.h"
#include "proto/worker_registry.grpc.pb.h"

namespace hmoe::rpc {

namespace reg = ::hmoe::registry::v1;

struct RegistryClient::Rpc {
  std::unique_ptr<reg::WorkerRegistry::Stub> stub;
};

RegistryClient::RegistryClient(RegistryClientOptions options,
                               std::function<WorkerLoadReport()> load)
    : options_(std::move(options)), load_(std::move(load)), rpc_(std::make_unique<Rpc>()) {
  grpc::ChannelArguments args;
  // Keep gRPC's own reconnect backoff in line with ours, so a router that comes back is found
  // within about max_backoff.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
              static_cast<int>(absl::ToInt64Milliseconds(options_.initial_backoff)));
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS,
              static_cast<int>(absl::ToInt64Milliseconds(options_.initial_backoff)));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
              static_cast<int>(absl::ToInt64Milliseconds(options_.max_backoff)));
  rpc_->stub = reg::WorkerRegistry::NewStub(
      grpc::CreateCustomChannel(options_.router_target, grpc::InsecureChannelCredentials(), args));
  thread_ = std::jthread([this] { Loop(); });
}

RegistryClient::~RegistryClient() { Stop(); }

void RegistryClient::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

bool RegistryClient::registered() const {
  absl::MutexLock lock(&mu_);
  return registered_;
}
int64_t RegistryClient::register_attempts() const {
  absl::MutexLock lock(&mu_);
  return register_attempts_;
}
int64_t RegistryClient::registrations() const {
  absl::MutexLock lock(&mu_);
  return registrations_;
}
int64_t RegistryClient::heartbeats_sent() const {
  absl::MutexLock lock(&mu_);
  return heartbeats_;
}

bool RegistryClient::SleepFor(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithTimeout(absl::Condition(this, &RegistryClient::Stopping), d);
  return !stop_;
}

void RegistryClient::Loop() {
  absl::Duration backoff = options_.initial_backoff;
  absl::Duration interval = options_.heartbeat_interval;
  bool registered = false;
  bool logged_down = false;
  auto deadline = [this] {
    return std::chrono::system_clock::now() +
           std::chrono::milliseconds(absl::ToInt64Milliseconds(options_.rpc_timeout));
  };
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
    }
    grpc::Status status;
    if (!registered) {
      reg::RegisterRequest req;
      req.set_worker_id(options_.worker_id);
      req.set_kind(options_.kind == WorkerKind::kPrefill ? reg::WORKER_KIND_PREFILL
                                                         : reg::WORKER_KIND_DECODE);
      req.set_endpoint(options_.endpoint);
      req.set_device(options_.device);
      req.set_pid(options_.pid);
      req.set_model(options_.model);
      req.set_start_unix_ms(options_.start_unix_ms);
      reg::RegisterResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(deadline());
      status = rpc_->stub->Register(&ctx, req, &resp);
      {
        absl::MutexLock lock(&mu_);
        ++register_attempts_;
        if (status.ok()) {
          ++registrations_;
          registered_ = true;
        }
      }
      if (status.ok()) {
        registered = true;
        interval = resp.heartbeat_interval_ms() > 0
                       ? absl::Milliseconds(resp.heartbeat_interval_ms())
                       : options_.heartbeat_interval;
        backoff = options_.initial_backoff;
        logged_down = false;
        HMOE_LOG(INFO) << "registered with router " << options_.router_target << " as "
                       << options_.worker_id;
        continue;
      }
    } else {
      const WorkerLoadReport load = load_();
      reg::HeartbeatRequest req;
      req.set_worker_id(options_.worker_id);
      reg::WorkerLoad* l = req.mutable_load();
      l->set_draining(load.draining);
      l->set_running(load.running);
      l->set_waiting(load.waiting);
      l->set_batch_size(load.batch_size);
      l->set_max_waiting(load.max_waiting);
      l->set_kv_blocks_free(load.kv_blocks_free);
      l->set_kv_blocks_total(load.kv_blocks_total);
      l->set_tokens_per_second(load.tokens_per_second);
      l->set_prefix_cache_tokens(load.prefix_cache_tokens);
      l->set_prefix_cache_hit_tokens(load.prefix_cache_hit_tokens);
      l->set_prefix_cache_hits(load.prefix_cache_hits);
      l->set_prefix_cache_evicted_blocks(load.prefix_cache_evicted_blocks);
      reg::HeartbeatResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(deadline());
      status = rpc_->stub->Heartbeat(&ctx, req, &resp);
      if (status.ok()) {
        absl::MutexLock lock(&mu_);
        ++heartbeats_;
      } else {
        // NOT_FOUND: the router forgot us (restarted); anything else: it is unreachable. Either
        // way register again once it answers.
        registered = false;
        absl::MutexLock lock(&mu_);
        registered_ = false;
      }
      if (status.ok()) {
        if (!SleepFor(interval)) return;
        continue;
      }
      if (status.error_code() == grpc::StatusCode::NOT_FOUND) continue;  // register at once
    }
    if (!logged_down) {
      HMOE_LOG(WARNING) << "router " << options_.router_target << " unavailable ("
                        << status.error_message() << "); retrying with backoff";
      logged_down = true;
    }
    if (!SleepFor(backoff)) return;
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

}  // namespace hmoe::rpc
