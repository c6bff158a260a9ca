#pragma once

// gRPC handlers of hmoe.decode.v1.DecodeService (proto/decode.proto). They only translate between
// protos and the Scheduler: Admit converts the request (opening a KV hand-off when given), submits
// it and streams the scheduler's events; a broken stream cancels the request. Thread-safe.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include <grpcpp/grpcpp.h>

#include "common/kv_handoff/export_table.h"
#include "common/kv_handoff/kv_handoff.h"
#include "common/rpc/registry_client.h"
#include "decode_worker/request.h"
#include "decode_worker/scheduler.h"
#include "decode_worker/step_engine.h"
#include "proto/decode.grpc.pb.h"

namespace hmoe::decode {

// The scheduler's request for `proto`. With a kv_handle, opens it through `importer` and
// validates it against `shape` (errors as KvImporter::Open). InvalidArgument naming the field for
// malformed requests (the scheduler checks the rest).
absl::StatusOr<GenerationRequest> RequestFromProto(const v1::AdmitRequest& proto,
                                                   KvImporter& importer,
                                                   const KvHandoffShape& shape);
// The stream message of one scheduler event.
v1::AdmitResponse EventToProto(const RequestEvent& event);

struct DecodeServiceInfo {
  std::string worker_id;
  std::string device;
  // ExportPrefix: shared-memory names are this prefix plus a counter (KvExportNamePrefix("kvp",
  // worker_id)); the table owns the exports (nullptr: ExportPrefix is FAILED_PRECONDITION).
  std::string prefix_export_prefix;
  ExportTable* prefix_exports = nullptr;
};

class DecodeServiceImpl final : public v1::DecodeService::Service {
 public:
  // `scheduler`, `engine` and `importer` must outlive the service.
  DecodeServiceImpl(Scheduler* scheduler, const StepEngine* engine, KvImporter* importer,
                    DecodeServiceInfo info)
      : scheduler_(scheduler), engine_(engine), importer_(importer), info_(std::move(info)) {}

  grpc::Status Admit(grpc::ServerContext* context, const v1::AdmitRequest* request,
                     grpc::ServerWriter<v1::AdmitResponse>* writer) override;
  grpc::Status Cancel(grpc::ServerContext* context, const v1::CancelRequest* request,
                      v1::CancelResponse* response) override;
  grpc::Status GetStatus(grpc::ServerContext* context, const v1::GetStatusRequest* request,
                         v1::WorkerStatus* response) override;
  grpc::Status MatchPrefix(grpc::ServerContext* context, const v1::MatchPrefixRequest* request,
                           v1::MatchPrefixResponse* response) override;
  grpc::Status ExportPrefix(grpc::ServerContext* context, const v1::ExportPrefixRequest* request,
                            v1::ExportPrefixResponse* response) override;
  grpc::Status ReleasePrefixExport(grpc::ServerContext* context,
                                   const v1::ReleasePrefixExportRequest* request,
                                   v1::ReleasePrefixExportResponse* response) override;

 private:
  Scheduler* scheduler_;
  const StepEngine* engine_;
  KvImporter* importer_;
  DecodeServiceInfo info_;
  std::atomic<int64_t> next_prefix_export_{0};
};

// The load the worker's heartbeats report to the router.
rpc::WorkerLoadReport SchedulerLoadReport(const Scheduler& scheduler);

}  // namespace hmoe::decode
