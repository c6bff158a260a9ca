#include "prefill_worker/prefill_service.h"

#include <utility>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/rpc/grpc_status.h"
#include "common/rpc/sampling_proto.h"

namespace hmoe::prefill {

using rpc::ToGrpcStatus;

absl::StatusOr<PrefillJob> JobFromProto(const v1::PrefillRequest& p) {
  PrefillJob job;
  job.id = p.request_id();
  job.prompt.assign(p.prompt_token_ids().begin(), p.prompt_token_ids().end());
  rpc::SamplingFromProto(p.sampling(), &job.sampling);
  if (p.has_dslp()) {
    const v1::DslpGroup& d = p.dslp();
    DslpGroupSpec g;
    g.group_id = d.group_id();
    g.rank = d.rank();
    g.world_size = d.world_size();
    g.shm_group = d.shm_group();
    g.nccl_unique_id = d.nccl_unique_id();
    switch (d.ep_mode()) {
      case v1::EP_MODE_UNSPECIFIED:
        break;
      case v1::EP_MODE_STANDARD:
        g.ep_mode_set = true;
        g.ep_mode = EpMode::kStandard;
        break;
      case v1::EP_MODE_SMALL_EP:
        g.ep_mode_set = true;
        g.ep_mode = EpMode::kSmallEp;
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("dslp.ep_mode: unknown value ", static_cast<int>(d.ep_mode())));
    }
    job.dslp = std::move(g);
  }
  if (p.has_prefix_kv()) {
    const decode::v1::KvHandle& h = p.prefix_kv();
    if (h.location_case() != decode::v1::KvHandle::kShmName) {
      return absl::InvalidArgumentError(
          "prefix_kv: only a shared-memory hand-off (shm_name) is accepted");
    }
    KvHandleSpec spec;
    spec.kind = KvHandleSpec::Kind::kShm;
    spec.shm_name = h.shm_name();
    spec.num_tokens = h.num_tokens();
    spec.layout_version = h.layout_version();
    job.prefix = std::move(spec);
  }
  return job;
}

v1::PrefillResponse OutcomeToProto(const PrefillOutcome& o, const std::string& worker_id) {
  v1::PrefillResponse r;
  r.set_first_token_id(o.first_token);
  if (o.exported) {
    decode::v1::KvHandle* h = r.mutable_kv_handle();
    if (o.handle.kind == KvHandleSpec::Kind::kCudaIpc) {
      h->set_cuda_ipc_handle(o.handle.cuda_ipc_handle);
      h->set_cuda_device(o.handle.cuda_device);
    } else {
      h->set_shm_name(o.handle.shm_name);
    }
    h->set_num_tokens(o.handle.num_tokens);
    h->set_layout_version(o.handle.layout_version);
  }
  r.set_prompt_tokens(static_cast<int32_t>(o.prompt_tokens));
  r.set_prefix_tokens(static_cast<int32_t>(o.prefix_tokens));
  v1::PrefillTiming* t = r.mutable_timing();
  t->set_queue_us(o.queue_us);
  t->set_prefill_us(o.prefill_us);
  t->set_export_us(o.export_us);
  t->set_bytes_streamed(o.bytes_streamed);
  t->set_load_wait_us(o.load_wait_us);
  t->set_peak_device_bytes(o.peak_device_bytes);
  if (o.dslp_rank >= 0) {
    t->set_dslp_local_tokens(o.dslp_local_tokens);
    t->set_dslp_bytes_sent(o.dslp_bytes_sent);
  }
  r.set_worker_id(worker_id);
  return r;
}

grpc::Status PrefillServiceImpl::Prefill(grpc::ServerContext* context,
                                         const v1::PrefillRequest* request,
                                         v1::PrefillResponse* response) {
  absl::StatusOr<PrefillJob> job = JobFromProto(*request);
  if (!job.ok()) {
    HMOE_LOG(INFO) << "req=" << request->request_id() << " rejected: " << job.status();
    return ToGrpcStatus(job.status());
  }
  absl::StatusOr<PrefillOutcome> outcome =
      scheduler_->Prefill(*std::move(job), [context] { return context->IsCancelled(); });
  if (!outcome.ok()) return ToGrpcStatus(outcome.status());
  *response = OutcomeToProto(*outcome, info_.worker_id);
  return grpc::Status::OK;
}

grpc::Status PrefillServiceImpl::Release(grpc::ServerContext* /*context*/,
                                         const v1::ReleaseRequest* request,
                                         v1::ReleaseResponse* /*response*/) {
  return ToGrpcStatus(exports_->Release(request->request_id()));
}

grpc::Status PrefillServiceImpl::Cancel(grpc::ServerContext* /*context*/,
                                        const v1::CancelRequest* request,
                                        v1::CancelResponse* /*response*/) {
  return ToGrpcStatus(scheduler_->Cancel(request->request_id()));
}

grpc::Status PrefillServiceImpl::GetStatus(grpc::ServerContext* /*context*/,
                                           const v1::GetStatusRequest* /*request*/,
                                           v1::PrefillStatus* r) {
  const PrefillSchedulerStats s = scheduler_->stats();
  r->set_worker_id(info_.worker_id);
  r->set_device(info_.device);
  r->set_draining(s.draining);
  r->set_busy(s.busy);
  r->set_waiting(s.waiting);
  r->set_max_waiting(scheduler_->options().max_waiting);
  r->set_exports(static_cast<int32_t>(exports_->count()));
  r->set_export_bytes(exports_->bytes());
  r->set_prefills(s.prefills);
  r->set_prompt_tokens(s.prompt_tokens);
  r->set_exports_expired(exports_->expired());
  const size_t budget = runner_->device().budget_bytes();
  r->set_device_budget_bytes(budget == SIZE_MAX ? 0 : static_cast<int64_t>(budget));
  r->set_ring_slots(runner_->weights().ring_slots());
  r->set_ring_slot_bytes(static_cast<int64_t>(runner_->weights().ring_slot_bytes()));
  r->set_last_peak_device_bytes(s.last_peak_device_bytes);
  r->set_dslp_group_id(s.last_dslp_group);
  r->set_dslp_prefills(s.dslp_prefills);
  return grpc::Status::OK;
}

rpc::WorkerLoadReport PrefillLoadReport(const PrefillScheduler& scheduler,
                                        const SlpRunner& runner) {
  const PrefillSchedulerStats s = scheduler.stats();
  rpc::WorkerLoadReport load;
  load.draining = s.draining;
  load.running = s.busy ? 1 : 0;
  load.waiting = s.waiting;
  load.batch_size = 1;
  load.max_waiting = scheduler.options().max_waiting;  // The router's prefill queue follows it.
  load.kv_blocks_free = runner.kv_blocks_free();
  load.kv_blocks_total = runner.kv_blocks_total();
  return load;
}

}  // namespace hmoe::prefill
