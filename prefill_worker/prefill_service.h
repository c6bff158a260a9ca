#pragma once

// gRPC handlers of hmoe.prefill.v1.PrefillService (proto/prefill.proto). They only translate
// between protos and the PrefillScheduler / ExportTable (docs/style.md §1): Prefill waits for its
// prompt's turn and outcome (a broken call cancels it), Release frees a KV export, Cancel and
// GetStatus report. Thread-safe.

#include <string>

#include <grpcpp/grpcpp.h>

#include "common/rpc/registry_client.h"
#include "prefill_worker/kv_exports.h"
#include "prefill_worker/prefill_scheduler.h"
#include "prefill_worker/slp_runner.h"
#include "proto/prefill.grpc.pb.h"

namespace hmoe::prefill {

struct PrefillServiceInfo {
  std::string worker_id;
  std::string device;
};

// The scheduler's job for `proto` (no validation beyond the DSLP EP mode: the scheduler
// validates): a request with a DslpGroup becomes a DSLP rank's job (dslp_group.h).
// InvalidArgument for an unknown dslp.ep_mode.
absl::StatusOr<PrefillJob> JobFromProto(const v1::PrefillRequest& proto);
// The response for a finished prefill (a DSLP rank > 0: no kv_handle, first_token_id -1).
v1::PrefillResponse OutcomeToProto(const PrefillOutcome& outcome, const std::string& worker_id);

class PrefillServiceImpl final : public v1::PrefillService::Service {
 public:
  // Everything must outlive the service.
  PrefillServiceImpl(PrefillScheduler* scheduler, ExportTable* exports, const SlpRunner* runner,
                     PrefillServiceInfo info)
      : scheduler_(scheduler), exports_(exports), runner_(runner), info_(std::move(info)) {}

  grpc::Status Prefill(grpc::ServerContext* context, const v1::PrefillRequest* request,
                       v1::PrefillResponse* response) override;
  grpc::Status Release(grpc::ServerContext* context, const v1::ReleaseRequest* request,
                       v1::ReleaseResponse* response) override;
  grpc::Status Cancel(grpc::ServerContext* context, const v1::CancelRequest* request,
                      v1::CancelResponse* response) override;
  grpc::Status GetStatus(grpc::ServerContext* context, const v1::GetStatusRequest* request,
                         v1::PrefillStatus* response) override;

 private:
  PrefillScheduler* scheduler_;
  ExportTable* exports_;
  const SlpRunner* runner_;
  PrefillServiceInfo info_;
};

// The load the worker's heartbeats report to the router: running 1 while it prefills, waiting its
// queue, batch size 1, the KV pool's blocks.
rpc::WorkerLoadReport PrefillLoadReport(const PrefillScheduler& scheduler, const SlpRunner& runner);

}  // namespace hmoe::prefill
