#include "router/prefill_client.h"

#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include <grpcpp/grpcpp.h>

#include "common/rpc/grpc_status.h"
#include "proto/prefill.grpc.pb.h"
#include "router/worker_channel.h"

namespace hmoe::router {
namespace {

namespace pv1 = hmoe::prefill::v1;

// The callback API, so a DSLP group's calls run concurrently without a thread per rank.
class GrpcPrefillCall : public PrefillCall {
 public:
  GrpcPrefillCall(pv1::PrefillService::Stub* stub, const pv1::PrefillRequest& request,
                  absl::Time deadline)
      : request_(request) {
    if (deadline != absl::InfiniteFuture()) context_.set_deadline(absl::ToChronoTime(deadline));
    stub->async()->Prefill(&context_, &request_, &response_, [this](grpc::Status s) {
      status_ = std::move(s);
      done_.Notify();  // Publishes status_ and response_.
    });
  }
  // gRPC uses context_, request_ and response_ until the callback has run. A Notification (not a
  // Mutex) because the waiter may destroy it as soon as it observes the notification.
  ~GrpcPrefillCall() override {
    context_.TryCancel();
    done_.WaitForNotification();
  }

  absl::StatusOr<pv1::PrefillResponse> Wait() override {
    done_.WaitForNotification();
    if (!status_.ok()) return rpc::FromGrpcStatus(status_);
    return response_;
  }
  void Cancel() override { context_.TryCancel(); }

 private:
  grpc::ClientContext context_;
  const pv1::PrefillRequest request_;
  pv1::PrefillResponse response_;
  // Written by the callback before done_ is notified; read only after.
  grpc::Status status_;
  absl::Notification done_;
};

class GrpcPrefillClient : public PrefillClient {
 public:
  explicit GrpcPrefillClient(const std::string& endpoint)
      : stub_(pv1::PrefillService::NewStub(grpc::CreateCustomChannel(
            endpoint, grpc::InsecureChannelCredentials(), WorkerChannelArguments()))) {}

  std::unique_ptr<PrefillCall> Prefill(const pv1::PrefillRequest& request,
                                       absl::Time deadline) override {
    return std::make_unique<GrpcPrefillCall>(stub_.get(), request, deadline);
  }

  absl::Status Release(const std::string& request_id, absl::Time deadline) override {
    grpc::ClientContext context;
    if (deadline != absl::InfiniteFuture()) context.set_deadline(absl::ToChronoTime(deadline));
    pv1::ReleaseRequest request;
    request.set_request_id(request_id);
    pv1::ReleaseResponse response;
    return rpc::FromGrpcStatus(stub_->Release(&context, request, &response));
  }

 private:
  std::unique_ptr<pv1::PrefillService::Stub> stub_;
};

class GrpcPrefillClientFactory : public PrefillClientFactory {
 public:
  std::shared_ptr<PrefillClient> ForEndpoint(const std::string& endpoint,
                                             int64_t incarnation) override
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    Entry& e = clients_[endpoint];
    // A new incarnation (a restarted worker) gets a new channel: the old one may be backing off
    // after failed connects to the dead process.
    if (e.client == nullptr || e.incarnation != incarnation) {
      e.client = std::make_shared<GrpcPrefillClient>(endpoint);
      e.incarnation = incarnation;
    }
    return e.client;
  }

 private:
  struct Entry {
    int64_t incarnation = 0;
    // shared_ptr: a client stays usable by in-flight requests while the map holds it too.
    std::shared_ptr<PrefillClient> client;
  };
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> clients_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<PrefillClientFactory> NewGrpcPrefillClientFactory() {
  return std::make_unique<GrpcPrefillClientFactory>();
}

}  // namespace hmoe::router
