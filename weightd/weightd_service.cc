#include "weightd/weightd_service.h"

#include <string>

#include "absl/time/time.h"

#include "common/model/dtype.h"

namespace hmoe::weightd {
namespace {

v1::ServingState StateToProto(DaemonState s) {
  switch (s) {
    case DaemonState::kStarting:
      return v1::SERVING_STATE_STARTING;
    case DaemonState::kLoading:
      return v1::SERVING_STATE_LOADING;
    case DaemonState::kReady:
      return v1::SERVING_STATE_READY;
    case DaemonState::kFailed:
      return v1::SERVING_STATE_FAILED;
    case DaemonState::kStopping:
      return v1::SERVING_STATE_STOPPING;
  }
  return v1::SERVING_STATE_UNSPECIFIED;
}

void SegmentToProto(const SegmentReport& s, v1::SegmentStatus* out) {
  out->set_index(s.layout.index);
  out->set_role(shm::SegmentRoleName(s.layout.role));
  out->set_slice(s.layout.slice);
  out->set_numa_node(s.layout.numa_node);
  out->set_location(s.handle.ToString());
  out->set_backing(shm::PageBackingName(s.backing));
  out->set_size_bytes(s.size_bytes);
  out->set_used_bytes(s.layout.used_bytes);
  out->set_backing_reason(s.backing_reason);
}

int64_t UnixMs(absl::Time t) { return t == absl::Time() ? 0 : absl::ToUnixMillis(t); }

}  // namespace

void StatusToProto(const DaemonStatus& s, v1::WeightdStatus* out) {
  out->set_state(StateToProto(s.state));
  out->set_instance(s.instance);
  out->set_model_dir(s.model_dir);
  out->set_model_identity(s.identity.empty() ? "" : s.identity.ToString());
  out->set_generation(s.generation);
  out->set_adopted(s.adopted);
  out->set_adopt_count(s.adopt_count);
  out->set_pid(s.pid);
  out->set_process_start_unix_ms(UnixMs(s.process_start));
  out->set_ready_unix_ms(UnixMs(s.ready_time));
  out->set_startup_seconds(s.startup_seconds);
  out->set_load_seconds(s.load_seconds);
  out->set_total_tensor_bytes(s.total_tensor_bytes);
  out->set_bytes_loaded(s.bytes_loaded);
  out->set_bytes_read_from_checkpoint(s.bytes_read_from_checkpoint);
  out->set_load_rate_bytes_per_second(s.load_rate_bytes_per_second);
  out->set_eta_seconds(s.eta_seconds);
  out->set_num_tensors(s.num_tensors);
  out->set_num_slices(s.num_slices);
  out->set_dense_policy(shm::DensePolicyName(s.dense_policy));
  for (const SegmentReport& seg : s.segments) SegmentToProto(seg, out->add_segments());
  out->set_error(s.error);
}

void ManifestToProto(const shm::Manifest& m, const std::vector<SegmentReport>& segments,
                     bool include_tensors, v1::Manifest* out) {
  out->set_model_identity(m.identity.ToString());
  out->set_generation(m.generation);
  out->set_model_dir(m.model_dir);
  out->set_num_slices(m.num_slices);
  out->set_dense_policy(shm::DensePolicyName(m.dense_policy));
  out->set_total_tensor_bytes(m.total_tensor_bytes);
  out->set_config_json(m.config_json);
  for (const SegmentReport& seg : segments) SegmentToProto(seg, out->add_segments());
  if (!include_tensors) return;
  for (const shm::TensorEntry& t : m.tensors) {
    v1::TensorEntry* e = out->add_tensors();
    e->set_name(t.name);
    e->set_dtype(std::string(DTypeName(t.dtype)));
    for (int64_t d : t.shape) e->add_shape(d);
    e->set_size_bytes(t.size_bytes);
    e->set_placement(shm::PlacementName(t.placement));
    e->set_contiguous(t.contiguous);
    e->set_segment(t.segment);
    e->set_offset(t.offset);
    e->set_scale_tensor(t.scale_name);
    for (const shm::TensorPart& p : t.parts) {
      v1::TensorPart* pp = e->add_parts();
      pp->set_slice(p.slice);
      pp->set_numa_node(p.numa_node);
      pp->set_segment(p.segment);
      pp->set_offset(p.offset);
      pp->set_size_bytes(p.size_bytes);
      for (int64_t d : p.shape) pp->add_shape(d);
      pp->set_split_dim(p.split_dim);
      pp->set_begin(p.begin);
      pp->set_end(p.end);
    }
  }
}

grpc::Status WeightdServiceImpl::GetStatus(grpc::ServerContext* /*context*/,
                                           const v1::GetStatusRequest* /*request*/,
                                           v1::WeightdStatus* response) {
  StatusToProto(daemon_->status(), response);
  return grpc::Status::OK;
}

grpc::Status WeightdServiceImpl::GetManifest(grpc::ServerContext* /*context*/,
                                             const v1::GetManifestRequest* request,
                                             v1::Manifest* response) {
  std::shared_ptr<const shm::Manifest> manifest = daemon_->manifest();
  if (manifest == nullptr) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "weights are not loaded yet");
  }
  ManifestToProto(*manifest, daemon_->status().segments, request->include_tensors(), response);
  return grpc::Status::OK;
}

}  // namespace hmoe::weightd
