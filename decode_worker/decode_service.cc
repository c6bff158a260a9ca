#include "decode_worker/decode_service.h"

#include <optional>
#include <utility>
#include <variant>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/sampling_proto.h"

namespace hmoe::decode {

using rpc::ToGrpcStatus;

namespace {

// How often a handler waiting for events checks whether its client went away.
constexpr absl::Duration kPollInterval = absl::Milliseconds(50);
// After cancelling on a broken stream, how long the handler waits for the scheduler to confirm
// (so the request's KV is free when the call ends).
constexpr absl::Duration kCancelWait = absl::Seconds(2);

// Waits (bounded) for the finish event of a request the handler gave up on.
void AwaitFinish(RequestChannel& channel) {
  const absl::Time deadline = absl::Now() + kCancelWait;
  while (std::optional<RequestEvent> e = channel.Pop(deadline)) {
    if (std::holds_alternative<FinishEvent>(*e)) return;
  }
}

}  // namespace

absl::StatusOr<GenerationRequest> RequestFromProto(const v1::AdmitRequest& p, KvImporter& importer,
                                                   const KvHandoffShape& shape) {
  GenerationRequest r;
  r.id = p.request_id();
  r.prompt.assign(p.prompt_token_ids().begin(), p.prompt_token_ids().end());
  rpc::SamplingFromProto(p.sampling(), &r.sampling);
  r.sampling.max_new_tokens = p.max_new_tokens();
  r.sampling.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
  r.sampling.ignore_eos = p.ignore_eos();
  r.use_prefix_cache = !p.no_prefix_cache();
  r.kv_cacheable = p.kv_cacheable();
  if (p.has_kv_handle()) {
    const v1::KvHandle& h = p.kv_handle();
    KvHandleSpec spec;
    switch (h.location_case()) {
      case v1::KvHandle::kShmName:
        spec.kind = KvHandleSpec::Kind::kShm;
        spec.shm_name = h.shm_name();
        break;
      case v1::KvHandle::kCudaIpcHandle:
        spec.kind = KvHandleSpec::Kind::kCudaIpc;
        spec.cuda_ipc_handle = h.cuda_ipc_handle();
        spec.cuda_device = h.cuda_device();
        break;
      default:
        return absl::InvalidArgumentError(
            "kv_handle: needs a location (shm_name or cuda_ipc_handle)");
    }
    spec.num_tokens = h.num_tokens();
    spec.layout_version = h.layout_version();
    if (!r.prompt.empty() && static_cast<int64_t>(r.prompt.size()) != h.num_tokens()) {
      return absl::InvalidArgumentError(absl::StrCat("prompt_token_ids: ", r.prompt.size(),
                                                     " tokens with a kv_handle of ", h.num_tokens(),
                                                     " tokens"));
    }
    HMOE_ASSIGN_OR_RETURN(r.kv, importer.Open(spec, shape));
    r.kv_num_tokens = h.num_tokens();
    r.first_token = p.first_token_id();
  }
  return r;
}

v1::AdmitResponse EventToProto(const RequestEvent& event) {
  v1::AdmitResponse out;
  if (const auto* t = std::get_if<TokenEvent>(&event)) {
    v1::Token* p = out.mutable_token();
    p->set_token_id(t->token);
    p->set_index(t->index);
    p->set_time_since_admit_us(t->time_since_admit_us);
    p->set_step_us(t->step_us);
  } else if (const auto* k = std::get_if<KvImportedEvent>(&event)) {
    v1::KvImported* p = out.mutable_kv_imported();
    p->set_num_tokens(k->num_tokens);
    p->set_import_us(k->import_us);
  } else {
    const auto& f = std::get<FinishEvent>(event);
    v1::Finished* p = out.mutable_finished();
    p->set_reason(rpc::FinishReasonToProto(f.reason));
    p->set_stop_token_id(f.stop_token);
    p->mutable_usage()->set_prompt_tokens(f.prompt_tokens);
    p->mutable_usage()->set_completion_tokens(f.completion_tokens);
    p->mutable_usage()->set_imported_tokens(f.imported_tokens);
    p->mutable_usage()->set_cached_tokens(f.cached_tokens);
    p->mutable_timing()->set_queue_us(f.queue_us);
    p->mutable_timing()->set_first_token_us(f.first_token_us);
    p->mutable_timing()->set_total_us(f.total_us);
    p->mutable_timing()->set_mean_inter_token_us(f.mean_inter_token_us);
    if (!f.error.ok()) p->set_error_message(std::string(f.error.message()));
  }
  return out;
}

grpc::Status DecodeServiceImpl::Admit(grpc::ServerContext* context, const v1::AdmitRequest* request,
                                      grpc::ServerWriter<v1::AdmitResponse>* writer) {
  absl::StatusOr<GenerationRequest> r =
      RequestFromProto(*request, *importer_, engine_->kv_handoff_shape());
  if (!r.ok()) {
    HMOE_LOG(INFO) << "req=" << request->request_id() << " rejected: " << r.status();
    return ToGrpcStatus(r.status());
  }
  const std::string id = r->id;
  absl::StatusOr<std::shared_ptr<RequestChannel>> channel = scheduler_->Submit(*std::move(r));
  if (!channel.ok()) {
    HMOE_LOG(INFO) << "req=" << id << " rejected: " << channel.status();
    return ToGrpcStatus(channel.status());
  }
  while (true) {
    std::optional<RequestEvent> event = (*channel)->Pop(absl::Now() + kPollInterval);
    if (!event.has_value()) {
      if (context->IsCancelled()) {
        (void)scheduler_->Cancel(id, "client cancelled the call");
        AwaitFinish(**channel);
        return grpc::Status(grpc::StatusCode::CANCELLED, "client cancelled the call");
      }
      continue;
    }
    const v1::AdmitResponse message = EventToProto(*event);
    const bool ok = writer->Write(message);
    if (const auto* f = std::get_if<FinishEvent>(&*event)) {
      if (f->reason == FinishReason::kError) return ToGrpcStatus(f->error);
      return grpc::Status::OK;
    }
    if (!ok) {
      (void)scheduler_->Cancel(id, "stream broken");
      AwaitFinish(**channel);
      return grpc::Status(grpc::StatusCode::CANCELLED, "stream broken");
    }
  }
}

grpc::Status DecodeServiceImpl::Cancel(grpc::ServerContext* /*context*/,
                                       const v1::CancelRequest* request,
                                       v1::CancelResponse* /*response*/) {
  return ToGrpcStatus(scheduler_->Cancel(request->request_id(), "cancelled by Cancel RPC"));
}

grpc::Status DecodeServiceImpl::GetStatus(grpc::ServerContext* /*context*/,
                                          const v1::GetStatusRequest* /*request*/,
                                          v1::WorkerStatus* response) {
  const SchedulerStats s = scheduler_->stats();
  const SchedulerOptions& o = scheduler_->options();
  response->set_worker_id(info_.worker_id);
  response->set_device(info_.device);
  response->set_draining(s.draining);
  response->set_batch_size(o.batch_size);
  response->set_running(s.running);
  response->set_waiting(s.waiting);
  response->set_max_waiting(o.max_waiting);
  response->set_kv_blocks_free(s.kv_blocks_free);
  response->set_kv_blocks_total(s.kv_blocks_total);
  response->set_kv_block_tokens(static_cast<int32_t>(engine_->kv_block_tokens()));
  response->set_steps(s.steps);
  response->set_tokens_generated(s.tokens_generated);
  response->set_prompt_tokens_prefilled(s.prompt_tokens_prefilled);
  response->set_tokens_per_second(s.tokens_per_second);
  response->set_dual_batch(o.dual_batch);
  response->set_chunk_size(static_cast<int32_t>(o.chunk_size));
  response->set_requests_finished(s.requests_finished);
  response->set_requests_cancelled(s.requests_cancelled);
  response->set_requests_failed(s.requests_failed);
  response->set_max_running_seen(s.max_running_seen);
  response->set_dual_batch_steps(s.dual_steps);
  response->set_prefills_per_step(o.prefills_per_step);
  response->set_prefill_packing(PackingPolicyName(o.packing));
  response->set_packed_prefills(s.packed_prefills);
  if (s.step_cost.has_value()) {
    response->set_step_fixed_us(s.step_cost->fixed_us);
    response->set_step_per_token_us(s.step_cost->per_token_us);
  }
  response->set_prefix_cache_max_blocks(s.prefix_cache.max_blocks);
  response->set_prefix_cache_blocks(s.prefix_cache.cached_blocks);
  response->set_prefix_cache_tokens(s.prefix_cache.cached_tokens);
  response->set_prefix_cache_lookups(s.prefix_cache.lookups);
  response->set_prefix_cache_hits(s.prefix_cache.hits);
  response->set_prefix_cache_hit_tokens(s.prefix_cache.hit_tokens);
  response->set_prefix_cache_evicted_blocks(s.prefix_cache.evicted_blocks);
  response->set_prefix_cache_exports(s.prefix_cache.exports);
  response->set_prefix_cache_exported_tokens(s.prefix_cache.exported_tokens);
  return grpc::Status::OK;
}

grpc::Status DecodeServiceImpl::MatchPrefix(grpc::ServerContext* /*context*/,
                                            const v1::MatchPrefixRequest* request,
                                            v1::MatchPrefixResponse* response) {
  const std::span<const int32_t> prompt(request->prompt_token_ids().data(),
                                        static_cast<size_t>(request->prompt_token_ids_size()));
  response->set_cached_tokens(engine_->CachedPrefixTokens(prompt));
  return grpc::Status::OK;
}

namespace {

// ExportPrefixRequest.export_id: [A-Za-z0-9_.:-]{1,128}.
bool ValidExportId(const std::string& id) {
  if (id.empty() || id.size() > 128) return false;
  for (const char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-' || c == '.' || c == ':';
    if (!ok) return false;
  }
  return true;
}

}  // namespace

grpc::Status DecodeServiceImpl::ExportPrefix(grpc::ServerContext* /*context*/,
                                             const v1::ExportPrefixRequest* request,
                                             v1::ExportPrefixResponse* response) {
  if (info_.prefix_exports == nullptr) {
    return ToGrpcStatus(
        absl::FailedPreconditionError("this decode worker exports no prefixes (no prefix cache)"));
  }
  const std::string& id = request->export_id();
  if (!ValidExportId(id)) {
    return ToGrpcStatus(
        absl::InvalidArgumentError("export_id: must be 1 to 128 characters of [A-Za-z0-9_.:-]"));
  }
  const int64_t prompt_tokens = request->prompt_token_ids_size();
  if (request->max_tokens() < 1 || request->max_tokens() >= prompt_tokens) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("max_tokens: ", request->max_tokens(), ", expected 1 to prompt length - 1 (",
                     prompt_tokens - 1, ")")));
  }
  if (info_.prefix_exports->Contains(id)) {
    return ToGrpcStatus(absl::AlreadyExistsError(absl::StrCat("export ", id, " is outstanding")));
  }
  const std::span<const int32_t> prompt(request->prompt_token_ids().data(),
                                        static_cast<size_t>(prompt_tokens));
  const std::string name = absl::StrCat(info_.prefix_export_prefix, next_prefix_export_++);
  std::unique_ptr<KvExport> exported;
  std::optional<KvHandoffSegment> segment;
  absl::StatusOr<int64_t> n = engine_->ExportPrefix(
      prompt, request->max_tokens(), [&](int64_t tokens) -> absl::StatusOr<void*> {
        HMOE_ASSIGN_OR_RETURN(segment,
                              KvHandoffSegment::Create(name, engine_->kv_handoff_shape(), tokens));
        KvHandleSpec spec;
        spec.kind = KvHandleSpec::Kind::kShm;
        spec.shm_name = name;
        spec.num_tokens = tokens;
        spec.layout_version = kKvHandoffLayoutVersion;
        // Owns the name from here on (a failed copy unlinks it); the mapping goes below, so the
        // memory is freed once the prefill worker has read and unlinked it.
        exported = NewShmNameExport(
            std::move(spec), segment->header().header_bytes + segment->header().payload_bytes);
        return static_cast<void*>(segment->payload().data());
      });
  segment.reset();
  if (!n.ok()) return ToGrpcStatus(n.status());
  if (*n == 0 || exported == nullptr) return grpc::Status::OK;
  v1::KvHandle* h = response->mutable_kv_handle();
  h->set_shm_name(exported->handle().shm_name);
  h->set_num_tokens(exported->handle().num_tokens);
  h->set_layout_version(exported->handle().layout_version);
  const std::string description = exported->description();
  if (absl::Status added = info_.prefix_exports->Add(id, std::move(exported)); !added.ok()) {
    return ToGrpcStatus(added);
  }
  HMOE_VLOG(1) << "export=" << id << " prefix of " << *n << " tokens to " << description;
  return grpc::Status::OK;
}

grpc::Status DecodeServiceImpl::ReleasePrefixExport(grpc::ServerContext* /*context*/,
                                                    const v1::ReleasePrefixExportRequest* request,
                                                    v1::ReleasePrefixExportResponse* /*response*/) {
  if (info_.prefix_exports == nullptr) {
    return ToGrpcStatus(absl::NotFoundError(
        absl::StrCat("export ", request->export_id(), ": this worker exports no prefixes")));
  }
  return ToGrpcStatus(info_.prefix_exports->Release(request->export_id()));
}

rpc::WorkerLoadReport SchedulerLoadReport(const Scheduler& scheduler) {
  const SchedulerStats s = scheduler.stats();
  rpc::WorkerLoadReport r;
  r.draining = s.draining;
  r.running = s.running;
  r.waiting = s.waiting;
  r.batch_size = scheduler.options().batch_size;
  r.max_waiting = scheduler.options().max_waiting;
  r.kv_blocks_free = s.kv_blocks_free;
  r.kv_blocks_total = s.kv_blocks_total;
  r.tokens_per_second = s.tokens_per_second;
  r.prefix_cache_tokens = s.prefix_cache.cached_tokens;
  r.prefix_cache_hit_tokens = s.prefix_cache.hit_tokens;
  r.prefix_cache_hits = s.prefix_cache.hits;
  r.prefix_cache_evicted_blocks = s.prefix_cache.evicted_blocks;
  return r;
}

}  // namespace hmoe::decode
