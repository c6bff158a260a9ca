#pragma once

// A generation request as the scheduler sees it, and the channel its events travel back on.

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "common/engine/sampler.h"
#include "common/kv_handoff/kv_handoff.h"

namespace hmoe::decode {

struct GenerationRequest {
  // Unique among in-flight requests; logged as req=<id>.
  std::string id;
  // Prompt tokens. With `kv`, optional: when given (kv_num_tokens entries) they only feed the
  // repetition penalty.
  std::vector<int32_t> prompt;
  // An opened, validated KV hand-off holding kv_num_tokens prompt tokens' cache (exclusive with
  // prefilling the prompt here), plus the first token the prefill worker sampled.
  std::unique_ptr<KvImportSource> kv;
  int64_t kv_num_tokens = 0;
  int32_t first_token = -1;
  // Sampling, max_new_tokens, stop ids, ignore_eos.
  SamplingParams sampling;
  // Reuse the prefix cache for the prompt and offer the request's KV to it when it finishes
  // (docs/decode_worker.md "Prefix cache"); false: prefill the whole prompt, offer nothing.
  bool use_prefix_cache = true;
  // With `kv`: the imported KV may join the prefix cache (AdmitRequest.kv_cacheable).
  bool kv_cacheable = false;

  // Whether the request starts from a KV hand-off (also after the scheduler released `kv`).
  bool has_kv() const { return kv != nullptr || kv_num_tokens > 0; }
  // Prompt tokens whose KV the request starts from (prefilled here or imported).
  int64_t prompt_tokens() const {
    return has_kv() ? kv_num_tokens : static_cast<int64_t>(prompt.size());
  }
};

struct TokenEvent {
  int32_t token = 0;
  int32_t index = 0;  // among generated tokens
  int64_t time_since_admit_us = 0;
  int64_t step_us = 0;
};

struct KvImportedEvent {
  int64_t num_tokens = 0;
  int64_t import_us = 0;
};

struct FinishEvent {
  FinishReason reason = FinishReason::kLength;  // not kNone
  int32_t stop_token = -1;                      // kEos / kStop
  absl::Status error;  // kError (also the cause of kCancelled, as a Cancelled status)
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  int32_t imported_tokens = 0;
  int32_t cached_tokens = 0;  // prompt tokens reused from the prefix cache
  int64_t queue_us = 0;
  int64_t first_token_us = 0;
  int64_t total_us = 0;
  int64_t mean_inter_token_us = 0;
};

using RequestEvent = std::variant<TokenEvent, KvImportedEvent, FinishEvent>;

// The events of one request, from the scheduler's engine thread to the gRPC handler streaming
// them. Shared (shared_ptr) by both: the handler may give up first (broken stream) while the
// scheduler still holds the request until the next step boundary, or the scheduler may finish
// first while the handler is still writing. Thread-safe. A FinishEvent is always the last event.
class RequestChannel {
 public:
  void Push(RequestEvent event) ABSL_LOCKS_EXCLUDED(mu_);
  // The next event, or nullopt at `deadline`.
  std::optional<RequestEvent> Pop(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // Every event pushed so far (tests).
  std::vector<RequestEvent> Drain() ABSL_LOCKS_EXCLUDED(mu_);
  bool finished() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  bool HasEvents() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !events_.empty(); }

  mutable absl::Mutex mu_;
  std::deque<RequestEvent> events_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace hmoe::decode
