#include "router/registry_service.h"

#include "common/rpc/grpc_status.h"

namespace hmoe::router {

namespace rv1 = hmoe::registry::v1;

grpc::Status RegistryService::Register(grpc::ServerContext*, const rv1::RegisterRequest* request,
                                       rv1::RegisterResponse* response) {
  WorkerIdentity id;
  id.worker_id = request->worker_id();
  switch (request->kind()) {
    case rv1::WORKER_KIND_PREFILL:
      id.kind = WorkerKind::kPrefill;
      break;
    case rv1::WORKER_KIND_DECODE:
      id.kind = WorkerKind::kDecode;
      break;
    default:
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "kind: must be PREFILL or DECODE");
  }
  id.endpoint = request->endpoint();
  id.device = request->device();
  id.pid = request->pid();
  id.model = request->model();
  id.start_unix_ms = request->start_unix_ms();
  absl::StatusOr<int64_t> incarnation = registry_->Register(id);
  if (!incarnation.ok()) return rpc::ToGrpcStatus(incarnation.status());
  response->set_heartbeat_interval_ms(
      absl::ToInt64Milliseconds(registry_->options().heartbeat_interval));
  return grpc::Status::OK;
}

grpc::Status RegistryService::Heartbeat(grpc::ServerContext*, const rv1::HeartbeatRequest* request,
                                        rv1::HeartbeatResponse*) {
  WorkerLoad load;
  load.draining = request->load().draining();
  load.running = request->load().running();
  load.waiting = request->load().waiting();
  load.batch_size = request->load().batch_size();
  load.max_waiting = request->load().max_waiting();
  load.kv_blocks_free = request->load().kv_blocks_free();
  load.kv_blocks_total = request->load().kv_blocks_total();
  load.tokens_per_second = request->load().tokens_per_second();
  load.prefix_cache_tokens = request->load().prefix_cache_tokens();
  load.prefix_cache_hit_tokens = request->load().prefix_cache_hit_tokens();
  load.prefix_cache_hits = request->load().prefix_cache_hits();
  load.prefix_cache_evicted_blocks = request->load().prefix_cache_evicted_blocks();
  return rpc::ToGrpcStatus(registry_->Heartbeat(request->worker_id(), load));
}

}  // namespace hmoe::router
