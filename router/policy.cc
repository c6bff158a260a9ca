#include "router/policy.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

#include "common/base/status_macros.h"

namespace hmoe::router {
namespace {

const WorkerView* FindWorker(const std::vector<WorkerView>& workers, const std::string& id) {
  for (const WorkerView& w : workers) {
    if (w.identity.worker_id == id) return &w;
  }
  return nullptr;
}

// Prefill workers not sharing `device`, in input (worker_id) order.
std::vector<std::string> NotSharing(const std::vector<WorkerView>& prefill,
                                    const std::string& device, const PolicyOptions& options) {
  std::vector<std::string> out;
  for (const WorkerView& w : prefill) {
    if (!SharesDevice(w.identity.device, device, options)) out.push_back(w.identity.worker_id);
  }
  return out;
}

std::vector<std::string> AllIds(const std::vector<WorkerView>& workers) {
  std::vector<std::string> out;
  for (const WorkerView& w : workers) out.push_back(w.identity.worker_id);
  return out;
}

bool OnCuda(const WorkerView& w) { return w.identity.device.rfind("cuda", 0) == 0; }

// The prefill workers a DSLP group may use: ranks must share the device kind (shared-memory
// collectives between CPU workers, NCCL between GPU workers), so the larger of the two sets (GPU
// workers on a tie), in input order.
std::vector<std::string> DslpCandidates(const std::vector<WorkerView>& prefill) {
  std::vector<std::string> cuda, cpu;
  for (const WorkerView& w : prefill) (OnCuda(w) ? cuda : cpu).push_back(w.identity.worker_id);
  return cuda.size() >= cpu.size() ? cuda : cpu;
}

}  // namespace

bool SharesDevice(const std::string& a, const std::string& b, const PolicyOptions& options) {
  if (a != b) return false;
  return options.cpu_devices_shared || a.rfind("cpu", 0) != 0;
}

const char* PathName(Path path) {
  switch (path) {
    case Path::kChunked:
      return "CHUNKED";
    case Path::kSlp:
      return "SLP";
    case Path::kDslp:
      return "DSLP";
  }
  return "?";
}

absl::StatusOr<std::string> PickDecodeWorker(const std::vector<WorkerView>& decode_workers,
                                             const std::map<std::string, int64_t>& cached_tokens) {
  auto cached = [&](const WorkerView& w) -> int64_t {
    auto it = cached_tokens.find(w.identity.worker_id);
    return it == cached_tokens.end() ? 0 : it->second;
  };
  auto load = [](const WorkerView& w) { return int64_t{w.load.running} + w.load.waiting; };
  const WorkerView* hit = nullptr;
  for (const WorkerView& w : decode_workers) {
    if (cached(w) <= 0 || load(w) >= w.load.batch_size) continue;
    if (hit == nullptr || cached(w) > cached(*hit) ||
        (cached(w) == cached(*hit) &&
         (load(w) < load(*hit) ||
          (load(w) == load(*hit) && w.identity.worker_id < hit->identity.worker_id)))) {
      hit = &w;
    }
  }
  if (hit != nullptr) return hit->identity.worker_id;
  const WorkerView* best = nullptr;
  for (const WorkerView& w : decode_workers) {
    const int64_t load = int64_t{w.load.running} + w.load.waiting;
    if (best == nullptr || load < int64_t{best->load.running} + best->load.waiting ||
        (load == int64_t{best->load.running} + best->load.waiting &&
         w.identity.worker_id < best->identity.worker_id)) {
      best = &w;
    }
  }
  if (best == nullptr) return absl::UnavailableError("no live decode worker");
  return best->identity.worker_id;
}

absl::StatusOr<RouteDecision> DecideRoute(const PolicyInput& in, const PolicyOptions& options) {
  RouteDecision d;
  HMOE_ASSIGN_OR_RETURN(d.decode_worker_id, PickDecodeWorker(in.decode_workers, in.cached_tokens));
  int64_t suffix = in.prompt_tokens;
  if (auto it = in.cached_tokens.find(d.decode_worker_id); it != in.cached_tokens.end()) {
    d.cached_tokens = std::min(it->second, in.prompt_tokens);
    suffix -= d.cached_tokens;
  }
  const std::string& decode_device =
      FindWorker(in.decode_workers, d.decode_worker_id)->identity.device;
  const std::vector<std::string> not_sharing =
      NotSharing(in.prefill_workers, decode_device, options);

  switch (in.hint) {
    case PathHintKind::kChunked:
      d.path = Path::kChunked;
      return d;
    case PathHintKind::kSlp:
      if (in.prefill_workers.empty()) {
        return absl::FailedPreconditionError("path_hint SLP: no live prefill worker");
      }
      d.path = Path::kSlp;
      // Prefer workers off the decode device, then the others.
      d.prefill_worker_ids = not_sharing;
      for (const WorkerView& w : in.prefill_workers) {
        if (SharesDevice(w.identity.device, decode_device, options)) {
          d.prefill_worker_ids.push_back(w.identity.worker_id);
        }
      }
      return d;
    case PathHintKind::kDslp:
      if (!in.dslp_allowed) {
        return absl::FailedPreconditionError(
            "path_hint DSLP: the prefill workers do not implement DSLP");
      }
      d.prefill_worker_ids = DslpCandidates(in.prefill_workers);
      if (d.prefill_worker_ids.size() < 2) {
        return absl::FailedPreconditionError(absl::StrCat(
            "path_hint DSLP: needs at least 2 live prefill workers on one kind of device, have ",
            d.prefill_worker_ids.size()));
      }
      if (in.prompt_tokens < 2 * static_cast<int64_t>(d.prefill_worker_ids.size())) {
        return absl::FailedPreconditionError(absl::StrCat(
            "path_hint DSLP: a prompt of ", in.prompt_tokens, " tokens cannot be split over ",
            d.prefill_worker_ids.size(), " prefill workers (at least 2 tokens per worker)"));
      }
      d.path = Path::kDslp;
      return d;
    case PathHintKind::kAuto:
      break;
  }

  // What is left to prefill decides: a long prompt whose prefix the decode worker holds is a
  // short chunked prefill there (a prefill worker would recompute all of it).
  if (suffix < options.chunk_threshold_tokens || in.prefill_workers.empty()) {
    d.path = Path::kChunked;
    return d;
  }
  const bool decode_idle =
      !in.decode_active_now && (!in.last_decode_active.has_value() ||
                                in.now - *in.last_decode_active >= options.decode_idle_window);
  if (decode_idle) {
    // DSLP over every prefill worker (of one device kind) when there are two or more and the
    // prompt has at least two tokens per worker (the zig-zag split); else SLP on any of them.
    // DSLP prefills the whole prompt (its ranks cannot start from the decode worker's cached
    // prefix) while SLP prefills only the suffix: with W workers DSLP's share per worker is about
    // (cached + suffix) / W tokens, so a cached prefix of at least (W - 1) x suffix makes SLP the
    // faster choice.
    const std::vector<std::string> group = DslpCandidates(in.prefill_workers);
    const auto w = static_cast<int64_t>(group.size());
    const bool prefix_favours_slp = w >= 2 && d.cached_tokens >= (w - 1) * suffix;
    if (group.size() >= 2 && in.dslp_allowed && !prefix_favours_slp &&
        in.prompt_tokens >= 2 * static_cast<int64_t>(group.size())) {
      d.path = Path::kDslp;
      d.prefill_worker_ids = group;
      return d;
    }
    d.path = Path::kSlp;
    d.prefill_worker_ids = AllIds(in.prefill_workers);
    return d;
  }
  if (not_sharing.empty()) {
    // Every prefill worker shares the decode worker's device: prefilling there would stall the
    // running batch as much as chunked prefill does, so keep it on the decode worker.
    d.path = Path::kChunked;
    return d;
  }
  d.path = Path::kSlp;
  d.prefill_worker_ids = not_sharing;
  return d;
}

}  // namespace hmoe::router
