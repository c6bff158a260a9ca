#pragma once

// The routing policy of paper §3.3.2, as a pure function of the request, the live workers, what
// their prefix caches hold and the time since a decode request was last active (so it is
// deterministic and tested with a fake clock):
//   - decode worker: the one holding the longest cached prefix of the prompt while it has a free
//     batch slot, else the least loaded (PickDecodeWorker);
//   - the prompt's uncached suffix (prompt minus the chosen worker's cached prefix; the whole
//     prompt without a hit) decides the path:
//   - suffix < chunk threshold          -> CHUNKED: chunked prefill on the decode worker;
//   - longer, decode idle for the window -> DSLP over all live prefill workers (of one device
//                                           kind: the larger set, GPUs on a tie; SLP when fewer
//                                           than two, or fewer than 2 prompt tokens per worker);
//   - longer, decode recently active     -> SLP on the prefill workers that do not share the decode
//                                           worker's device (equal device strings share; CPU
//                                           devices share unless cpu_devices_shared is off);
//   - no usable prefill worker           -> CHUNKED.
// A path hint overrides the policy when feasible; otherwise FailedPrecondition says why. Every
// path needs a live decode worker (decode always runs there): Unavailable without one.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "router/worker_registry.h"

namespace hmoe::router {

enum class Path { kChunked, kSlp, kDslp };
enum class PathHintKind { kAuto, kChunked, kSlp, kDslp };

const char* PathName(Path path);

struct PolicyOptions {
  // Prompts with fewer tokens take the chunked path.
  int64_t chunk_threshold_tokens = 2048;
  // DSLP only when no decode request was active within this window.
  absl::Duration decode_idle_window = absl::Minutes(5);
  // Whether workers on "cpu" devices share one device (they compete for the same cores). Off for
  // nodes whose CPU workers are pinned to disjoint cores or NUMA nodes (and in tests, to exercise
  // SLP next to a running decode on a CPU-only machine).
  bool cpu_devices_shared = true;
};

struct PolicyInput {
  int64_t prompt_tokens = 0;
  // Leading prompt tokens each decode worker's prefix cache holds (by worker_id; absent: none).
  std::map<std::string, int64_t> cached_tokens;
  PathHintKind hint = PathHintKind::kAuto;
  // Live decode and prefill workers (WorkerRegistry::Live), sorted by worker_id.
  std::vector<WorkerView> decode_workers;
  std::vector<WorkerView> prefill_workers;
  // A decode request is running now.
  bool decode_active_now = false;
  // When the last decode request finished (nullopt: never).
  std::optional<absl::Time> last_decode_active;
  absl::Time now;
  // False when the prefill workers refused DSLP (UNIMPLEMENTED): the idle case takes SLP and a
  // DSLP hint is FailedPrecondition.
  bool dslp_allowed = true;
};

struct RouteDecision {
  Path path = Path::kChunked;
  // The decode worker that streams the tokens.
  std::string decode_worker_id;
  // CHUNKED: empty. SLP: candidates in preference order (FCFS takes the first free one). DSLP: all
  // of them run the prefill together, rank i on prefill_worker_ids[i].
  std::vector<std::string> prefill_worker_ids;
  // Leading prompt tokens the chosen decode worker's prefix cache holds (PolicyInput
  // cached_tokens): chunked prefill starts after them, and SLP asks that worker for their KV
  // (ExportPrefix) so the prefill worker computes only the rest.
  int64_t cached_tokens = 0;
};

// The decode worker for a new request: the one whose prefix cache holds the most of the prompt
// (per `cached_tokens`; ties: fewer running + waiting, then lowest worker_id) when that is > 0 and
// the worker has a free batch slot (running + waiting < batch_size); otherwise the live one with
// the fewest running + waiting requests (ties: lowest worker_id). So a shared system prompt does
// not pile every request onto one worker while another idles. Unavailable when there is none.
absl::StatusOr<std::string> PickDecodeWorker(
    const std::vector<WorkerView>& decode_workers,
    const std::map<std::string, int64_t>& cached_tokens = {});

absl::StatusOr<RouteDecision> DecideRoute(const PolicyInput& input, const PolicyOptions& options);

// Whether workers on `a` and `b` ("cpu", "cuda:N") compete for one device.
bool SharesDevice(const std::string& a, const std::string& b, const PolicyOptions& options);

}  // namespace hmoe::router
