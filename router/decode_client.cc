#include "router/decode_client.h"

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include <grpcpp/grpcpp.h>

#include "common/rpc/grpc_status.h"
#include "proto/decode.grpc.pb.h"
#include "router/worker_channel.h"

namespace hmoe::router {
namespace {

namespace dv1 = hmoe::decode::v1;

class GrpcDecodeStream : public DecodeStream {
 public:
  GrpcDecodeStream(dv1::DecodeService::Stub* stub, const dv1::AdmitRequest& request,
                   absl::Time deadline) {
    if (deadline != absl::InfiniteFuture()) context_.set_deadline(absl::ToChronoTime(deadline));
    reader_ = stub->Admit(&context_, request);
  }
  bool Read(dv1::AdmitResponse* response) override { return reader_->Read(response); }
  absl::Status Finish() override { return rpc::FromGrpcStatus(reader_->Finish()); }
  void Cancel() override { context_.TryCancel(); }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<dv1::AdmitResponse>> reader_;
};

class GrpcDecodeClient : public DecodeClient {
 public:
  explicit GrpcDecodeClient(const std::string& endpoint)
      : stub_(dv1::DecodeService::NewStub(grpc::CreateCustomChannel(
            endpoint, grpc::InsecureChannelCredentials(), WorkerChannelArguments()))) {}
  std::unique_ptr<DecodeStream> Admit(const dv1::AdmitRequest& request,
                                      absl::Time deadline) override {
    return std::make_unique<GrpcDecodeStream>(stub_.get(), request, deadline);
  }
  absl::StatusOr<int64_t> MatchPrefix(const std::vector<int32_t>& prompt,
                                      absl::Time deadline) override {
    grpc::ClientContext context;
    if (deadline != absl::InfiniteFuture()) context.set_deadline(absl::ToChronoTime(deadline));
    dv1::MatchPrefixRequest request;
    request.mutable_prompt_token_ids()->Assign(prompt.begin(), prompt.end());
    dv1::MatchPrefixResponse response;
    const grpc::Status status = stub_->MatchPrefix(&context, request, &response);
    if (!status.ok()) return rpc::FromGrpcStatus(status);
    return response.cached_tokens();
  }
  absl::StatusOr<dv1::KvHandle> ExportPrefix(const std::string& export_id,
                                             const std::vector<int32_t>& prompt, int64_t max_tokens,
                                             absl::Time deadline) override {
    grpc::ClientContext context;
    if (deadline != absl::InfiniteFuture()) context.set_deadline(absl::ToChronoTime(deadline));
    dv1::ExportPrefixRequest request;
    request.set_export_id(export_id);
    request.mutable_prompt_token_ids()->Assign(prompt.begin(), prompt.end());
    request.set_max_tokens(max_tokens);
    dv1::ExportPrefixResponse response;
    const grpc::Status status = stub_->ExportPrefix(&context, request, &response);
    if (!status.ok()) return rpc::FromGrpcStatus(status);
    return response.kv_handle();
  }
  absl::Status ReleasePrefixExport(const std::string& export_id, absl::Time deadline) override {
    grpc::ClientContext context;
    if (deadline != absl::InfiniteFuture()) context.set_deadline(absl::ToChronoTime(deadline));
    dv1::ReleasePrefixExportRequest request;
    request.set_export_id(export_id);
    dv1::ReleasePrefixExportResponse response;
    return rpc::FromGrpcStatus(stub_->ReleasePrefixExport(&context, request, &response));
  }

 private:
  std::unique_ptr<dv1::DecodeService::Stub> stub_;
};

class GrpcDecodeClientFactory : public DecodeClientFactory {
 public:
  std::shared_ptr<DecodeClient> ForEndpoint(const std::string& endpoint,
                                            int64_t incarnation) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    Entry& e = clients_[endpoint];
    // A new incarnation (a restarted worker) gets a new channel: the old one may be backing off
    // after failed connects to the dead process.
    if (e.client == nullptr || e.incarnation != incarnation) {
      e.client = std::make_shared<GrpcDecodeClient>(endpoint);
      e.incarnation = incarnation;
    }
    return e.client;
  }

 private:
  struct Entry {
    int64_t incarnation = 0;
    // shared_ptr: a client stays usable by in-flight requests while the map holds it too.
    std::shared_ptr<DecodeClient> client;
  };
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> clients_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<DecodeClientFactory> NewGrpcDecodeClientFactory() {
  return std::make_unique<GrpcDecodeClientFactory>();
}

}  // namespace hmoe::router
