#include "router/router.h"

#include <algorithm>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/model/tokenizer.h"
#include "common/rpc/sampling_proto.h"
#include "router/api_convert.h"

namespace hmoe::router {
namespace {

namespace v1 = hmoe::v1;
namespace dv1 = hmoe::decode::v1;
namespace pv1 = hmoe::prefill::v1;

PathHintKind HintKind(v1::PathHint hint) {
  switch (hint) {
    case v1::PATH_HINT_CHUNKED:
      return PathHintKind::kChunked;
    case v1::PATH_HINT_SLP:
      return PathHintKind::kSlp;
    case v1::PATH_HINT_DSLP:
      return PathHintKind::kDslp;
    default:
      return PathHintKind::kAuto;
  }
}

v1::Path ToProto(Path path) {
  switch (path) {
    case Path::kChunked:
      return v1::PATH_CHUNKED;
    case Path::kSlp:
      return v1::PATH_SLP;
    case Path::kDslp:
      return v1::PATH_DSLP;
  }
  return v1::PATH_UNSPECIFIED;
}

// Streamed text with stop strings: text that could still be the start of a stop string is held
// back, so the client never sees a stop string.
class TextTracker {
 public:
  TextTracker(const Tokenizer* tokenizer, const v1::GenerateRequest& request)
      : decoder_(tokenizer->NewStreamDecoder()),
        stops_(request.stop_strings().begin(), request.stop_strings().end()) {
    for (const std::string& s : stops_) max_stop_bytes_ = std::max(max_stop_bytes_, s.size());
  }

  // Adds a token's text. Returns the text that may be released now; sets *stop to the stop
  // string when one completed (the returned text then ends right before it).
  std::string Push(int32_t id, std::string* stop) {
    return Release(decoder_.Push(id), false, stop);
  }
  // The rest at the end of the stream.
  std::string Flush(std::string* stop) { return Release(decoder_.Flush(), true, stop); }

 private:
  std::string Release(const std::string& piece, bool final, std::string* stop) {
    // Search only where a new match can be: the held bytes plus the new piece.
    held_ += piece;
    size_t best = std::string::npos;
    for (const std::string& s : stops_) {
      const size_t pos = held_.find(s);
      if (pos != std::string::npos && pos < best) {
        best = pos;
        *stop = s;
      }
    }
    if (best != std::string::npos) {
      std::string out = held_.substr(0, best);
      held_.clear();
      return out;
    }
    size_t keep = final || max_stop_bytes_ == 0 ? 0 : std::min(held_.size(), max_stop_bytes_ - 1);
    size_t cut = held_.size() - keep;
    // Never split a UTF-8 character: back up over continuation bytes.
    while (cut > 0 && cut < held_.size() && (static_cast<uint8_t>(held_[cut]) & 0xC0) == 0x80) {
      --cut;
    }
    std::string out = held_.substr(0, cut);
    held_.erase(0, cut);
    return out;
  }

  Tokenizer::StreamDecoder decoder_;
  std::vector<std::string> stops_;
  size_t max_stop_bytes_ = 0;
  std::string held_;
};

}  // namespace

struct Router::Inflight {
  std::string request_id;
  GenerateSink* sink = nullptr;
  absl::Mutex mu;
  // The worker calls of the current attempt, broken by Cancel and by the watcher.
  DecodeStream* stream ABSL_GUARDED_BY(mu) = nullptr;
  std::vector<PrefillCall*> prefill_calls ABSL_GUARDED_BY(mu);
  // Cancel RPC.
  bool cancelled_by_rpc ABSL_GUARDED_BY(mu) = false;
  // The client went away (watcher).
  bool client_gone ABSL_GUARDED_BY(mu) = false;

  void CancelCallsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (stream != nullptr) stream->Cancel();
    for (PrefillCall* c : prefill_calls) c->Cancel();
  }
  bool Cancelled() ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    return cancelled_by_rpc || client_gone;
  }
  bool CancelledByRpc() ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    return cancelled_by_rpc;
  }
  bool ClientGone() ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    return client_gone;
  }
};

// The state of one Generate call across its dispatch attempts. Used by the Generate thread only.
struct Router::Request {
  const v1::GenerateRequest* proto = nullptr;
  GenerateSink* sink = nullptr;
  std::shared_ptr<Inflight> inflight;
  std::string id;
  std::vector<int32_t> prompt;
  absl::Time arrival;
  absl::Time deadline;
  // What every attempt sends to the decode worker (plus the hand-off for SLP/DSLP).
  dv1::AdmitRequest admit;
  std::optional<TextTracker> text;
  v1::Timing timing;
  int32_t tokens_streamed = 0;
  absl::Time first_token_time;
  absl::Time last_token_time;
  bool wrote_any = false;
  bool client_write_failed = false;
  // Set when a stop string completed: the stream ends there.
  std::string stop_string;
  // Cleared when the prefill workers answered DSLP with UNIMPLEMENTED.
  bool dslp_allowed = true;

  bool Write(v1::GenerateResponse& r) {
    if (!wrote_any) r.set_request_id(id);
    wrote_any = true;
    if (!sink->Write(r)) {
      client_write_failed = true;
      return false;
    }
    return true;
  }

  // Streams one generated token. False when the stream must end (the client is gone, or a stop
  // string completed).
  bool EmitToken(int32_t token_id) {
    v1::GenerateResponse out;
    v1::Token* t = out.mutable_token();
    t->set_token_id(token_id);
    t->set_index(tokens_streamed);
    if (text.has_value()) {
      std::string piece = text->Push(token_id, &stop_string);
      if (proto->detokenize()) t->set_text(std::move(piece));
    }
    const absl::Time now = absl::Now();
    if (tokens_streamed == 0) first_token_time = now;
    last_token_time = now;
    ++tokens_streamed;
    if (!Write(out)) return false;
    return stop_string.empty();
  }
};

// A finished prefill: the first token and where the prompt's KV cache waits for the decode worker.
struct Router::Prefilled {
  int32_t first_token_id = -1;
  dv1::KvHandle kv_handle;
  // The id the prefill workers know the request by, and the workers holding a hand-off buffer of
  // it (rank 0, plus any other rank that reported a handle).
  std::string prefill_request_id;
  std::vector<WorkerView> exports;
  // Every prefill worker that ran it (rank order).
  std::vector<std::string> worker_ids;
  bool released = false;
  // Leading prompt tokens whose KV came from the decode worker's prefix cache (ExportPrefix).
  int64_t prefix_tokens = 0;
};

namespace {

// A failed worker call that means the worker (or the connection to it) is gone, as opposed to an
// answer about the request: UNAVAILABLE, or CANCELLED when nobody on the router's side cancelled
// the call (gRPC reports a peer killed mid-stream that way on unix sockets; a worker that cancels
// a request itself ends the call OK with FINISH_REASON_CANCELLED). The caller rules out the
// router's own cancellations: the client's (cancel, disconnect), the Cancel RPC, the request's
// deadline, and calls the router broke off itself. Only this marks a worker dead; rejections
// (RESOURCE_EXHAUSTED), deadlines and other errors are answers from a live worker.
bool IsConnectionLost(const absl::Status& s) {
  return absl::IsUnavailable(s) || absl::IsCancelled(s);
}

// Failures before the first token that another dispatch may fix: a lost connection, a worker's
// internal failure (retried elsewhere without marking it dead) or a rejection (another worker
// may have room).
bool IsRetryable(const absl::Status& s) {
  return IsConnectionLost(s) || absl::IsUnknown(s) || absl::IsInternal(s) || absl::IsAborted(s) ||
         absl::IsResourceExhausted(s);
}

}  // namespace

Router::Router(RouterOptions options, WorkerRegistry* registry, DecodeClientFactory* decode_clients,
               PrefillClientFactory* prefill_clients, const Tokenizer* tokenizer,
               const Clock* clock)
    : options_(std::move(options)),
      registry_(registry),
      decode_clients_(decode_clients),
      prefill_clients_(prefill_clients),
      tokenizer_(tokenizer),
      clock_(clock),
      prefill_queue_({.max_waiting = options_.max_prefill_queue, .poll = options_.cancel_poll}),
      watcher_([this] { WatchCancellations(); }) {}

Router::~Router() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  watcher_ = std::jthread();  // joins
}

void Router::CheckCancellations() {
  absl::MutexLock lock(&mu_);
  check_cancellations_ = true;
}

void Router::WatchCancellations() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(this, &Router::WatcherWakes), options_.cancel_poll);
    if (stopping_) break;
    check_cancellations_ = false;
    bool any = false;
    for (auto& [id, inflight] : inflight_) {
      if (!inflight->sink->IsCancelled()) continue;
      absl::MutexLock request_lock(&inflight->mu);
      if (inflight->client_gone) continue;
      inflight->client_gone = true;
      inflight->CancelCallsLocked();
      any = true;
    }
    if (any) prefill_queue_.Poke();  // a waiter in the prefill queue leaves now
  }
}

void Router::StartDraining() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

bool Router::Serving() const {
  {
    absl::MutexLock lock(&mu_);
    if (draining_) return false;
  }
  return !registry_->Live(WorkerKind::kDecode).empty();
}

int32_t Router::inflight() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int32_t>(inflight_.size());
}

int32_t Router::AdmissionLimit() const {
  int64_t room = 0;
  for (const WorkerView& w : registry_->Live(WorkerKind::kDecode)) {
    // A worker that has not reported its capacity yet (no heartbeat since it registered, or an
    // older worker): the limit is the router's own.
    if (w.load.batch_size <= 0) return options_.max_inflight;
    room += w.load.batch_size + std::max(w.load.max_waiting, 0);
  }
  if (room == 0) return options_.max_inflight;  // no live decode worker: Route says so
  return static_cast<int32_t>(std::min<int64_t>(options_.max_inflight, room));
}

int32_t Router::PrefillQueueLimit() const {
  int64_t room = 0;
  for (const WorkerView& w : registry_->Live(WorkerKind::kPrefill)) {
    if (w.load.batch_size <= 0 || w.load.max_waiting <= 0) return options_.max_prefill_queue;
    room += w.load.max_waiting;
  }
  if (room == 0) return options_.max_prefill_queue;  // no live prefill worker: Route says so
  return static_cast<int32_t>(std::min<int64_t>(options_.max_prefill_queue, room));
}

absl::Status Router::Admit(const std::string& request_id, GenerateSink* sink,
                           std::shared_ptr<Inflight>* out) {
  const int32_t limit = AdmissionLimit();
  absl::MutexLock lock(&mu_);
  ++requests_total_;
  if (draining_) {
    ++requests_rejected_;
    return absl::UnavailableError("router is draining");
  }
  if (static_cast<int32_t>(inflight_.size()) >= limit) {
    ++requests_rejected_;
    return absl::ResourceExhaustedError(absl::StrCat(
        "router: ", limit, " requests in flight",
        limit < options_.max_inflight ? " (the room the live decode workers advertise)" : "",
        "; retry later"));
  }
  std::string id = request_id;
  if (id.empty()) id = absl::StrCat("req-", ++next_request_number_);
  if (inflight_.contains(id)) {
    ++requests_rejected_;
    return absl::AlreadyExistsError(absl::StrCat("request_id: ", id, " is in flight"));
  }
  auto inflight = std::make_shared<Inflight>();
  inflight->request_id = id;
  inflight->sink = sink;
  inflight_[id] = inflight;
  *out = std::move(inflight);
  return absl::OkStatus();
}

void Router::Release(const std::shared_ptr<Inflight>& inflight) {
  absl::MutexLock lock(&mu_);
  inflight_.erase(inflight->request_id);
}

void Router::CountWorker(const std::string& worker_id, int delta) {
  absl::MutexLock lock(&mu_);
  if ((worker_inflight_[worker_id] += delta) == 0) worker_inflight_.erase(worker_id);
}

absl::Status Router::Cancel(const std::string& request_id) {
  std::shared_ptr<Inflight> inflight;
  {
    absl::MutexLock lock(&mu_);
    auto it = inflight_.find(request_id);
    if (it == inflight_.end()) {
      return absl::NotFoundError(absl::StrCat("request ", request_id, " is not in flight"));
    }
    inflight = it->second;
  }
  {
    absl::MutexLock lock(&inflight->mu);
    inflight->cancelled_by_rpc = true;
    inflight->CancelCallsLocked();
  }
  prefill_queue_.Poke();
  return absl::OkStatus();
}

absl::StatusOr<RouteDecision> Router::Route(const std::vector<int32_t>& prompt,
                                            bool use_prefix_cache, PathHintKind hint,
                                            bool dslp_allowed, int attempt, absl::Time deadline,
                                            Inflight& inflight,
                                            const std::vector<std::string>& excluded) {
  // A retry waits for workers to come back (a restart takes about a second). So does a new request
  // while every known decode worker is dead (restarting); with none registered ever, it fails now.
  std::optional<absl::Time> wait_until;
  while (true) {
    PolicyInput in;
    const auto prompt_tokens = static_cast<int64_t>(prompt.size());
    in.prompt_tokens = prompt_tokens;
    in.hint = hint;
    in.decode_workers = registry_->Live(WorkerKind::kDecode);
    std::erase_if(in.decode_workers, [&](const WorkerView& w) {
      return std::find(excluded.begin(), excluded.end(), w.identity.worker_id) != excluded.end();
    });
    if (prefill_clients_ != nullptr) in.prefill_workers = registry_->Live(WorkerKind::kPrefill);
    in.dslp_allowed = dslp_allowed;
    // Ask the decode workers' prefix caches when the answer can change the decision (several
    // decode workers, or a prompt long enough for a prefill worker) or what a prefill worker
    // computes (SLP, hinted: it then prefills only the uncached suffix).
    const bool auto_may_use =
        hint == PathHintKind::kAuto &&
        (in.decode_workers.size() >= 2 ||
         (!in.prefill_workers.empty() && prompt_tokens >= options_.policy.chunk_threshold_tokens));
    const bool slp_may_use = hint == PathHintKind::kSlp && !in.prefill_workers.empty();
    if (use_prefix_cache && prompt_tokens >= 2 && (auto_may_use || slp_may_use)) {
      in.cached_tokens = CachedPrefixes(prompt, in.decode_workers);
    }
    in.now = clock_->Now();
    {
      absl::MutexLock lock(&mu_);
      in.decode_active_now = decode_active_ > 0;
      in.last_decode_active = last_decode_active_;
    }
    absl::StatusOr<RouteDecision> d = DecideRoute(in, options_.policy);
    if (d.ok()) return d;
    if (!wait_until.has_value()) {
      bool wait = attempt > 0;
      for (const WorkerView& w : registry_->Snapshot()) {
        wait = wait || w.identity.kind == WorkerKind::kDecode;
      }
      wait_until =
          wait ? std::min(deadline, absl::Now() + options_.retry_wait) : absl::InfinitePast();
    }
    if (absl::Now() >= *wait_until) return d;
    // A prefill worker named by a hint may come back too, but only for a retry.
    if (!absl::IsUnavailable(d.status()) &&
        !(attempt > 0 && absl::IsFailedPrecondition(d.status()))) {
      return d;
    }
    if (inflight.Cancelled()) return absl::CancelledError("cancelled while waiting for a worker");
    absl::SleepFor(absl::Milliseconds(50));
  }
}

std::map<std::string, int64_t> Router::CachedPrefixes(const std::vector<int32_t>& prompt,
                                                      const std::vector<WorkerView>& workers) {
  std::map<std::string, int64_t> out;
  // A worker that does not answer quickly holds nothing as far as routing goes. The workers are
  // asked at once, so a slow one costs the deadline once, not once per worker.
  const absl::Time deadline = absl::Now() + options_.prefix_match_timeout;
  std::vector<absl::StatusOr<int64_t>> answers(workers.size(), int64_t{0});
  auto ask = [&](size_t i) {
    const WorkerView& w = workers[i];
    answers[i] = decode_clients_->ForEndpoint(w.identity.endpoint, w.incarnation)
                     ->MatchPrefix(prompt, deadline);
  };
  {
    std::vector<std::jthread> others;
    for (size_t i = 1; i < workers.size(); ++i) others.emplace_back(ask, i);
    if (!workers.empty()) ask(0);
  }  // joins
  for (size_t i = 0; i < workers.size(); ++i) {
    if (answers[i].ok() && *answers[i] > 0) out[workers[i].identity.worker_id] = *answers[i];
  }
  return out;
}

absl::Status Router::Generate(const v1::GenerateRequest& proto, absl::Time deadline,
                              GenerateSink* sink) {
  Request req;
  req.arrival = absl::Now();
  req.deadline = deadline;
  req.proto = &proto;
  req.sink = sink;
  HMOE_RETURN_IF_ERROR(ValidateGenerateRequest(proto, options_.limits, tokenizer_));
  HMOE_ASSIGN_OR_RETURN(req.prompt, ResolvePrompt(proto, options_.limits, tokenizer_));
  HMOE_RETURN_IF_ERROR(Admit(proto.request_id(), sink, &req.inflight));
  absl::Cleanup release = [&] { Release(req.inflight); };
  req.id = req.inflight->request_id;

  req.admit.set_request_id(req.id);
  req.admit.mutable_prompt_token_ids()->Assign(req.prompt.begin(), req.prompt.end());
  *req.admit.mutable_sampling() = rpc::SamplingToProto(SamplingFromApi(proto));
  req.admit.set_max_new_tokens(proto.max_new_tokens());
  req.admit.mutable_stop_token_ids()->CopyFrom(proto.stop_token_ids());
  req.admit.set_ignore_eos(proto.ignore_eos());
  const bool use_prefix_cache = !proto.has_cache_prompt() || proto.cache_prompt();
  req.admit.set_no_prefix_cache(!use_prefix_cache);
  if (tokenizer_ != nullptr && (proto.detokenize() || proto.stop_strings_size() > 0)) {
    req.text.emplace(tokenizer_, proto);
  }

  absl::Status last_error;
  // Decode workers that answered this request with an error; retries go elsewhere.
  std::vector<std::string> excluded;
  for (int attempt = 0; attempt < options_.max_dispatch_attempts; ++attempt) {
    if (!excluded.empty()) {
      bool other = false;
      for (const WorkerView& w : registry_->Live(WorkerKind::kDecode)) {
        other = other ||
                std::find(excluded.begin(), excluded.end(), w.identity.worker_id) == excluded.end();
      }
      if (!other) {
        // Every live decode worker refused it: their answer is the request's (e.g.
        // RESOURCE_EXHAUSTED when all are full).
        absl::MutexLock lock(&mu_);
        (absl::IsResourceExhausted(last_error) ? requests_rejected_ : requests_failed_)++;
        return last_error;
      }
    }
    absl::StatusOr<RouteDecision> routed =
        Route(req.prompt, use_prefix_cache, HintKind(proto.path_hint()), req.dslp_allowed, attempt,
              deadline, *req.inflight, excluded);
    if (!routed.ok() && req.inflight->Cancelled()) return CancelledOutcome(req).status;
    if (!routed.ok()) {
      absl::MutexLock lock(&mu_);
      if (attempt == 0) {
        ++requests_rejected_;
        return routed.status();
      }
      ++requests_failed_;
      return absl::Status(
          routed.status().code(),
          absl::StrCat(routed.status().message(), " (after ", last_error.ToString(), ")"));
    }
    Outcome outcome = RunAttempt(req, *routed, attempt);
    if (!outcome.retry) {
      if (!outcome.status.ok() && !absl::IsCancelled(outcome.status)) {
        absl::MutexLock lock(&mu_);
        ++requests_failed_;
      }
      return outcome.status;
    }
    last_error = outcome.status;
    if (!outcome.exclude_worker.empty()) excluded.push_back(outcome.exclude_worker);
  }
  if (absl::IsResourceExhausted(last_error)) {
    // The last worker tried had no room: say so, as every attempt ended in an answer.
    absl::MutexLock lock(&mu_);
    ++requests_rejected_;
    return last_error;
  }
  {
    absl::MutexLock lock(&mu_);
    ++requests_failed_;
  }
  return absl::UnavailableError(absl::StrCat("no worker could serve the request after ",
                                             options_.max_dispatch_attempts,
                                             " attempts; last error: ", last_error.ToString()));
}

absl::Status Router::Finish(Request& req, v1::Finished f) {
  v1::Timing* t = f.mutable_timing();
  *t = req.timing;
  if (req.tokens_streamed > 0) {
    t->set_ttft_us(absl::ToInt64Microseconds(req.first_token_time - req.arrival));
  }
  if (req.tokens_streamed > 1) {
    t->set_tpot_us(absl::ToInt64Microseconds(req.last_token_time - req.first_token_time) /
                   (req.tokens_streamed - 1));
  }
  t->set_total_us(absl::ToInt64Microseconds(absl::Now() - req.arrival));
  f.mutable_usage()->set_prompt_tokens(static_cast<int32_t>(req.prompt.size()));
  v1::GenerateResponse out;
  *out.mutable_finished() = std::move(f);
  req.Write(out);
  return absl::OkStatus();
}

Router::Outcome Router::CancelledOutcome(Request& req) {
  if (req.inflight->CancelledByRpc() && !req.client_write_failed) {
    v1::Finished f;
    f.set_stop_token_id(-1);
    f.set_reason(FinishReasonToApi(FinishReason::kCancelled));
    f.set_error_message("cancelled by the Cancel RPC");
    f.mutable_usage()->set_completion_tokens(req.tokens_streamed);
    return {false, Finish(req, std::move(f))};
  }
  return {false, absl::CancelledError("client cancelled")};
}

Router::Outcome Router::RunAttempt(Request& req, const RouteDecision& route, int attempt) {
  const std::optional<WorkerView> decode = registry_->Find(route.decode_worker_id);
  if (!decode.has_value()) {
    return {true, absl::UnavailableError(
                      absl::StrCat("decode worker ", route.decode_worker_id, " vanished"))};
  }
  req.timing.set_path(ToProto(route.path));
  req.timing.clear_worker_ids();
  req.timing.add_worker_ids(route.decode_worker_id);
  req.timing.set_attempts(attempt + 1);
  HMOE_VLOG(1) << "req=" << req.id << " " << PathName(route.path) << " decode "
               << route.decode_worker_id << " attempt " << attempt + 1;

  // --- prefill on prefill workers (SLP / DSLP)
  std::optional<Prefilled> prefilled;
  absl::Cleanup release_handoff = [&] {
    if (prefilled.has_value() && !prefilled->released) ReleaseHandoff(*prefilled, req.id);
  };
  if (route.path != Path::kChunked) {
    absl::StatusOr<Prefilled> p = RunPrefill(req, route, attempt);
    if (!p.ok()) {
      const absl::Status& s = p.status();
      if (req.inflight->Cancelled()) return CancelledOutcome(req);
      // UNIMPLEMENTED: a worker without DSLP. INVALID_ARGUMENT on the policy's (not the client's)
      // choice of DSLP: a prompt these workers cannot split (e.g. a rank's share over their
      // --max-step-tokens); SLP runs it in several passes, or answers the same error.
      const bool policy_choice = HintKind(req.proto->path_hint()) == PathHintKind::kAuto;
      if (route.path == Path::kDslp &&
          (absl::IsUnimplemented(s) || (absl::IsInvalidArgument(s) && policy_choice))) {
        HMOE_LOG(WARNING) << "req=" << req.id << " DSLP refused (" << s << "); retrying as SLP";
        req.dslp_allowed = false;
        return {true, s};
      }
      if (IsRetryable(s) && absl::Now() < req.deadline) {
        HMOE_LOG(WARNING) << "req=" << req.id << " prefill failed (" << s << "); retrying";
        return {true, s};
      }
      return {false, s};
    }
    prefilled = *std::move(p);
    for (const std::string& w : prefilled->worker_ids) req.timing.add_worker_ids(w);
  } else {
    req.timing.set_queue_us(absl::ToInt64Microseconds(absl::Now() - req.arrival));
  }

  // --- the decode worker's stream
  dv1::AdmitRequest admit = req.admit;
  if (prefilled.has_value()) {
    *admit.mutable_kv_handle() = prefilled->kv_handle;
    admit.set_first_token_id(prefilled->first_token_id);
    // SLP on the CPU computes every token exactly as the CPU decode worker's chunked prefill does
    // (the engine's results do not depend on chunking or batching); DSLP's ring attention and a
    // GPU's kernels round differently.
    bool exact = route.path == Path::kSlp && decode->identity.device.rfind("cpu", 0) == 0;
    for (const std::string& id : prefilled->worker_ids) {
      const std::optional<WorkerView> w = registry_->Find(id);
      exact = exact && w.has_value() && w->identity.device.rfind("cpu", 0) == 0;
    }
    admit.set_kv_cacheable(options_.prefix_cache_all_imports || exact);
  }
  std::shared_ptr<DecodeClient> client =
      decode_clients_->ForEndpoint(decode->identity.endpoint, decode->incarnation);
  // Counted before the call starts, so GetStatus never shows a worker serving a request the
  // router does not count yet.
  {
    absl::MutexLock lock(&mu_);
    ++decode_active_;
  }
  CountWorker(route.decode_worker_id, +1);
  std::unique_ptr<DecodeStream> stream;
  absl::Cleanup unactive = [&] {
    {
      absl::MutexLock lock(&req.inflight->mu);
      req.inflight->stream = nullptr;
    }
    CountWorker(route.decode_worker_id, -1);
    absl::MutexLock lock(&mu_);
    --decode_active_;
    last_decode_active_ = clock_->Now();
  };
  stream = client->Admit(admit, req.deadline);
  {
    absl::MutexLock lock(&req.inflight->mu);
    req.inflight->stream = stream.get();
    if (req.inflight->cancelled_by_rpc || req.inflight->client_gone) stream->Cancel();
  }

  dv1::AdmitResponse in;
  std::optional<dv1::Finished> finished;
  // Whether the router broke the stream off itself (the client is gone, a stop string, the first
  // token was a stop token). A stream that ended by itself is not cancelled: TryCancel before
  // Finish would replace the worker's status (e.g. RESOURCE_EXHAUSTED) with CANCELLED.
  bool broken_off = false;
  while (!finished.has_value() && stream->Read(&in)) {
    if (in.has_kv_imported()) {
      if (!prefilled.has_value()) continue;
      // The prefill worker's token is the first generated one; the decode worker does not stream
      // it. A stop/EOS token ends the request there (the decode worker's Finished says so).
      const int32_t first = prefilled->first_token_id;
      const bool is_stop =
          (!req.proto->ignore_eos() &&
           std::find(options_.eos_token_ids.begin(), options_.eos_token_ids.end(), first) !=
               options_.eos_token_ids.end()) ||
          std::find(req.proto->stop_token_ids().begin(), req.proto->stop_token_ids().end(),
                    first) != req.proto->stop_token_ids().end();
      const bool go_on = is_stop || req.EmitToken(first);
      ReleaseHandoff(*prefilled, req.id);
      if (!go_on) {
        broken_off = true;
        break;
      }
    } else if (in.has_token()) {
      if (!req.EmitToken(in.token().token_id())) {
        broken_off = true;
        break;
      }
    } else if (in.has_finished()) {
      finished = in.finished();
    }
  }
  if (broken_off) stream->Cancel();
  const absl::Status status = stream->Finish();
  if (req.client_write_failed || req.inflight->ClientGone()) {
    return {false, absl::CancelledError("client cancelled")};
  }

  v1::Finished f;
  f.set_stop_token_id(-1);
  if (!req.stop_string.empty()) {
    f.set_reason(FinishReasonToApi(FinishReason::kStop));
    f.set_stop_string(req.stop_string);
  } else if (finished.has_value() && status.ok()) {
    f.set_reason(FinishReasonToApi(rpc::FinishReasonFromProto(finished->reason())));
    f.set_stop_token_id(finished->stop_token_id());
    f.set_error_message(finished->error_message());
    if (req.text.has_value()) {
      std::string rest = req.text->Flush(&req.stop_string);
      if (!req.stop_string.empty()) {
        f.set_reason(FinishReasonToApi(FinishReason::kStop));
        f.set_stop_string(req.stop_string);
      }
      if (req.proto->detokenize()) f.set_text(std::move(rest));
    }
  } else if (req.inflight->CancelledByRpc()) {
    return CancelledOutcome(req);
  } else {
    // The worker failed. Before any token the request can go elsewhere.
    // Not cancelled by the client or the Cancel RPC (handled above) nor by a stop string.
    const std::string where = absl::StrCat("decode worker ", decode->identity.worker_id, " after ",
                                           req.tokens_streamed, " tokens: ");
    if (status.ok()) return {false, absl::InternalError(where + "stream ended without Finished")};
    // The request's own deadline ended the call: an answer about the request, not the worker.
    if (absl::IsDeadlineExceeded(status) || absl::Now() >= req.deadline) {
      return {false, absl::DeadlineExceededError(
                         absl::StrCat(where, "deadline exceeded (", status.ToString(), ")"))};
    }
    const bool lost = !broken_off && IsConnectionLost(status);
    if (lost) registry_->MarkDead(decode->identity.worker_id, decode->incarnation);
    if (req.tokens_streamed == 0 && (lost || IsRetryable(status))) {
      HMOE_LOG(WARNING) << "req=" << req.id << " decode worker " << decode->identity.worker_id
                        << " failed before the first token (" << status << "); retrying";
      // A worker that answered (rejected or failed the request) is not asked again for this
      // request; one whose connection broke may come back (restarted) and is.
      Outcome o{true, absl::Status(status.code(), where + std::string(status.message()))};
      if (!lost) o.exclude_worker = decode->identity.worker_id;
      return o;
    }
    if (lost) {
      return {false, absl::UnavailableError(
                         absl::StrCat(where, "connection lost (", status.ToString(), ")"))};
    }
    return {false, absl::Status(status.code(), where + std::string(status.message()))};
  }
  f.mutable_usage()->set_completion_tokens(finished.has_value() && req.stop_string.empty()
                                               ? finished->usage().completion_tokens()
                                               : req.tokens_streamed);
  if (finished.has_value()) {
    // A prefill worker that prefilled only the suffix reused the decode worker's cached prefix.
    const int64_t reused = prefilled.has_value() ? prefilled->prefix_tokens : 0;
    f.mutable_usage()->set_cached_prompt_tokens(
        static_cast<int32_t>(std::max<int64_t>(finished->usage().cached_tokens(), reused)));
  }
  return {false, Finish(req, std::move(f))};
}

absl::StatusOr<Router::Prefilled> Router::RunPrefill(Request& req, const RouteDecision& route,
                                                     int attempt) {
  if (prefill_clients_ == nullptr || route.prefill_worker_ids.empty()) {
    return absl::FailedPreconditionError("no prefill workers");
  }
  const bool dslp = route.path == Path::kDslp;
  HMOE_ASSIGN_OR_RETURN(
      const std::vector<std::string> granted,
      prefill_queue_.Acquire(
          route.prefill_worker_ids, dslp ? PrefillQueue::Need::kAll : PrefillQueue::Need::kAny,
          req.deadline, [&] { return req.inflight->Cancelled(); },
          [&](const std::string& id) {
            const std::optional<WorkerView> w = registry_->Find(id);
            return w.has_value() && w->state == WorkerState::kLive;
          },
          PrefillQueueLimit()));
  absl::Cleanup free_workers = [&] { prefill_queue_.Release(granted); };
  req.timing.set_queue_us(absl::ToInt64Microseconds(absl::Now() - req.arrival));

  std::vector<WorkerView> workers;
  for (const std::string& id : granted) {
    std::optional<WorkerView> w = registry_->Find(id);
    if (!w.has_value() || w->state != WorkerState::kLive) {
      return absl::UnavailableError(absl::StrCat("prefill worker ", id, " is gone"));
    }
    workers.push_back(*std::move(w));
  }

  pv1::PrefillRequest base;
  // A retry gets a new id: the worker of the failed attempt may still hold it.
  base.set_request_id(attempt == 0 ? req.id : absl::StrCat(req.id, ":", attempt + 1));
  base.mutable_prompt_token_ids()->Assign(req.prompt.begin(), req.prompt.end());
  *base.mutable_sampling() = rpc::SamplingToProto(SamplingFromApi(*req.proto));
  std::string group;
  if (dslp) {
    absl::MutexLock lock(&mu_);
    group = absl::StrCat(options_.dslp_group_prefix, "-", ++next_dslp_group_);
  }
  // SLP after a prefix the decode worker caches: its KV goes to the prefill worker, which
  // prefills only the rest (DSLP prefills whole prompts). Any failure here just means a whole
  // prefill. The decode worker owns the buffer until we release it (the prefill worker unlinks it
  // once read, so this only frees what a failed attempt left).
  std::shared_ptr<DecodeClient> prefix_owner;
  absl::Cleanup release_prefix = [&] {
    if (prefix_owner == nullptr) return;
    const absl::Status s = prefix_owner->ReleasePrefixExport(
        base.request_id(), absl::Now() + options_.release_timeout);
    if (!s.ok() && !absl::IsNotFound(s)) {
      HMOE_LOG(WARNING) << "req=" << req.id << " release of the prefix export on decode worker "
                        << route.decode_worker_id << ": " << s;
    }
  };
  if (!dslp && route.cached_tokens > 0 && req.prompt.size() >= 2) {
    const std::optional<WorkerView> d = registry_->Find(route.decode_worker_id);
    if (d.has_value()) {
      std::shared_ptr<DecodeClient> client =
          decode_clients_->ForEndpoint(d->identity.endpoint, d->incarnation);
      absl::StatusOr<dv1::KvHandle> h = client->ExportPrefix(
          base.request_id(), req.prompt, static_cast<int64_t>(req.prompt.size()) - 1,
          std::min(req.deadline, absl::Now() + options_.prefix_export_timeout));
      if (!h.ok()) {
        HMOE_LOG(WARNING) << "req=" << req.id << " prefix export from decode worker "
                          << route.decode_worker_id << " failed (" << h.status()
                          << "); prefilling the whole prompt";
      } else if (h->num_tokens() > 0) {
        prefix_owner = std::move(client);
        *base.mutable_prefix_kv() = *std::move(h);
      }
    }
  }
  const int world = static_cast<int>(workers.size());
  std::vector<std::unique_ptr<PrefillCall>> calls;
  for (int rank = 0; rank < world; ++rank) {
    pv1::PrefillRequest r = base;
    if (dslp) {
      pv1::DslpGroup* g = r.mutable_dslp();
      g->set_group_id(group);
      g->set_rank(rank);
      g->set_world_size(world);
      g->set_shm_group(group);
      g->set_ep_mode(static_cast<pv1::EpMode>(options_.dslp_ep_mode));
    }
    // Counted before the call starts (see the decode stream); the Cleanup below uncounts.
    CountWorker(workers[rank].identity.worker_id, +1);
    calls.push_back(
        prefill_clients_->ForEndpoint(workers[rank].identity.endpoint, workers[rank].incarnation)
            ->Prefill(r, req.deadline));
  }
  {
    absl::MutexLock lock(&req.inflight->mu);
    for (auto& c : calls) req.inflight->prefill_calls.push_back(c.get());
    if (req.inflight->cancelled_by_rpc || req.inflight->client_gone) {
      req.inflight->CancelCallsLocked();
    }
  }
  // Runs before `calls` is destroyed.
  absl::Cleanup unregister = [&] {
    {
      absl::MutexLock lock(&req.inflight->mu);
      req.inflight->prefill_calls.clear();
    }
    for (const WorkerView& w : workers) CountWorker(w.identity.worker_id, -1);
  };

  std::vector<absl::StatusOr<pv1::PrefillResponse>> results(
      world, absl::UnknownError("prefill did not run"));
  if (world == 1) {
    results[0] = calls[0]->Wait();
  } else {
    // The ranks wait for each other. A rank that fails on its own (its call broke: the worker is
    // gone; or a bad request) gets the others cancelled at once. A rank that reports a broken
    // group (ABORTED) does not: the others get dslp_failure_grace to report, so the call of the
    // rank that died fails too and names it; then whatever still runs is cancelled.
    absl::Mutex m;
    int done = 0;
    bool hard = false, broken = false, cancelled_here = false;
    {
      std::vector<std::jthread> waiters;
      for (int rank = 0; rank < world; ++rank) {
        waiters.emplace_back([&, rank] {
          absl::StatusOr<pv1::PrefillResponse> r = calls[rank]->Wait();
          absl::MutexLock lock(&m);
          if (!r.ok() && absl::IsCancelled(r.status()) && !cancelled_here &&
              !req.inflight->Cancelled() && absl::Now() < req.deadline) {
            // Nobody cancelled it: gRPC reports a peer killed mid-call this way on unix sockets.
            r = absl::UnavailableError(
                absl::StrCat("connection lost (", r.status().message(), ")"));
          }
          if (!r.ok()) (absl::IsAborted(r.status()) ? broken : hard) = true;
          results[rank] = std::move(r);
          ++done;
        });
      }
      bool cancel = false;
      {
        absl::MutexLock lock(&m);
        const auto settled = [&] { return done == world || hard || broken; };
        const auto finished = [&] { return done == world || hard; };
        m.Await(absl::Condition(&settled));
        if (!finished())
          m.AwaitWithTimeout(absl::Condition(&finished), options_.dslp_failure_grace);
        cancel = done < world;
        cancelled_here = cancel;
      }
      if (cancel) {
        for (auto& c : calls) c->Cancel();
      }
    }  // joins the waiters
  }

  Prefilled p;
  p.prefill_request_id = base.request_id();
  p.worker_ids = granted;
  for (int rank = 0; rank < world; ++rank) {
    if (results[rank].ok() && results[rank]->has_kv_handle()) p.exports.push_back(workers[rank]);
  }
  // What explains a failure: a rank that failed on its own (for DSLP, a broken call means that
  // worker is gone), else a rank reporting a broken group (ABORTED), else a cancellation.
  auto severity = [](const absl::Status& s) {
    return s.ok() ? 0 : absl::IsCancelled(s) ? 1 : absl::IsAborted(s) ? 2 : 3;
  };
  const absl::Status* error = nullptr;
  int error_rank = -1;
  for (int rank = 0; rank < world; ++rank) {
    const absl::Status& s = results[rank].status();
    if (!s.ok() && (error == nullptr || severity(s) > severity(*error))) {
      error = &s;
      error_rank = rank;
    }
  }
  if (error != nullptr && dslp) {
    ReleaseHandoff(p, req.id);
    const WorkerView& w = workers[error_rank];
    const std::string rank_of = absl::StrCat("prefill worker ", w.identity.worker_id, " (rank ",
                                             error_rank, " of ", world, ")");
    if (req.inflight->Cancelled() || absl::IsCancelled(*error)) {
      return absl::Status(error->code(), absl::StrCat(rank_of, ": ", error->message()));
    }
    if (absl::IsAborted(*error)) {
      // Every rank that answered reports a broken group; none is known to be gone.
      return absl::UnavailableError(absl::StrCat("DSLP group ", group, " failed: ", rank_of,
                                                 " reported: ", error->message()));
    }
    if (IsConnectionLost(*error) && absl::Now() < req.deadline) {
      registry_->MarkDead(w.identity.worker_id, w.incarnation);
      return absl::UnavailableError(absl::StrCat("DSLP group ", group, " failed: ", rank_of,
                                                 " is gone (", error->ToString(), ")"));
    }
    return absl::Status(error->code(), absl::StrCat(rank_of, ": ", error->message()));
  }
  if (error == nullptr && !results[0]->has_kv_handle()) {
    ReleaseHandoff(p, req.id);
    return absl::InternalError(
        absl::StrCat("prefill worker ", granted[0], " returned no kv_handle for request ", req.id));
  }
  if (error == nullptr && (results[0]->first_token_id() < 0 ||
                           results[0]->first_token_id() >= options_.limits.vocab_size)) {
    ReleaseHandoff(p, req.id);
    return absl::InternalError(absl::StrCat("prefill worker ", granted[0], " returned token id ",
                                            results[0]->first_token_id(),
                                            " outside the vocabulary"));
  }
  if (error != nullptr) {
    ReleaseHandoff(p, req.id);
    const WorkerView& w = workers[error_rank];
    if (!req.inflight->Cancelled() && absl::Now() < req.deadline && IsConnectionLost(*error)) {
      registry_->MarkDead(w.identity.worker_id, w.incarnation);
    }
    return absl::Status(error->code(), absl::StrCat("prefill worker ", w.identity.worker_id, ": ",
                                                    error->message()));
  }
  p.first_token_id = results[0]->first_token_id();
  p.kv_handle = results[0]->kv_handle();
  p.prefix_tokens = results[0]->prefix_tokens();
  HMOE_VLOG(1) << "req=" << req.id << " prefilled on " << granted[0] << " (" << world
               << " rank(s)), first token " << p.first_token_id;
  return p;
}

void Router::ReleaseHandoff(Prefilled& p, const std::string& request_id) {
  if (p.released) return;
  p.released = true;
  for (const WorkerView& w : p.exports) {
    const absl::Status s =
        prefill_clients_->ForEndpoint(w.identity.endpoint, w.incarnation)
            ->Release(p.prefill_request_id, absl::Now() + options_.release_timeout);
    // NOT_FOUND: the worker's export timeout (or a restart) freed it already.
    if (!s.ok() && !absl::IsNotFound(s)) {
      HMOE_LOG(WARNING) << "req=" << request_id << " release of the KV hand-off on prefill worker "
                        << w.identity.worker_id << ": " << s;
    }
  }
}

v1::ModelInfo Router::GetModelInfo() const {
  v1::ModelInfo info;
  info.set_model(options_.model_name);
  info.set_vocab_size(options_.limits.vocab_size);
  info.set_context_length(options_.limits.context_length);
  info.set_has_tokenizer(tokenizer_ != nullptr);
  info.set_bos_token_id(options_.bos_token_id);
  info.set_eos_token_id(options_.eos_token_id);
  info.set_chunk_threshold_tokens(static_cast<int32_t>(options_.policy.chunk_threshold_tokens));
  info.set_decode_idle_window_ms(absl::ToInt64Milliseconds(options_.policy.decode_idle_window));
  info.set_max_request_bytes(options_.max_request_bytes);
  return info;
}

v1::RouterStatus Router::GetStatus() const {
  v1::RouterStatus s;
  const int32_t limit = AdmissionLimit();
  const int32_t prefill_limit = PrefillQueueLimit();
  const absl::Time now = clock_->Now();
  const std::vector<WorkerView> workers = registry_->Snapshot();
  absl::MutexLock lock(&mu_);
  for (const WorkerView& w : workers) {
    v1::WorkerInfo* i = s.add_workers();
    i->set_worker_id(w.identity.worker_id);
    i->set_kind(w.identity.kind == WorkerKind::kDecode ? v1::WORKER_KIND_DECODE
                                                       : v1::WORKER_KIND_PREFILL);
    i->set_state(w.state == WorkerState::kLive       ? v1::WORKER_STATE_LIVE
                 : w.state == WorkerState::kDraining ? v1::WORKER_STATE_DRAINING
                                                     : v1::WORKER_STATE_DEAD);
    i->set_endpoint(w.identity.endpoint);
    i->set_device(w.identity.device);
    i->set_pid(w.identity.pid);
    i->set_incarnation(w.incarnation);
    i->set_ms_since_heartbeat(absl::ToInt64Milliseconds(now - w.last_heartbeat));
    i->set_running(w.load.running);
    i->set_waiting(w.load.waiting);
    i->set_batch_size(w.load.batch_size);
    i->set_kv_blocks_free(w.load.kv_blocks_free);
    i->set_kv_blocks_total(w.load.kv_blocks_total);
    i->set_tokens_per_second(w.load.tokens_per_second);
    i->set_prefix_cache_tokens(w.load.prefix_cache_tokens);
    i->set_prefix_cache_hit_tokens(w.load.prefix_cache_hit_tokens);
    i->set_prefix_cache_hits(w.load.prefix_cache_hits);
    i->set_prefix_cache_evicted_blocks(w.load.prefix_cache_evicted_blocks);
    auto it = worker_inflight_.find(w.identity.worker_id);
    i->set_router_inflight(it == worker_inflight_.end() ? 0 : it->second);
  }
  s.set_inflight(static_cast<int32_t>(inflight_.size()));
  s.set_max_inflight(limit);
  s.set_prefill_queue(prefill_queue_.waiting());
  s.set_max_prefill_queue(prefill_limit);
  s.set_requests_total(requests_total_);
  s.set_requests_rejected(requests_rejected_);
  s.set_requests_failed(requests_failed_);
  s.set_ms_since_decode_active(decode_active_ > 0 ? 0
                               : last_decode_active_.has_value()
                                   ? absl::ToInt64Milliseconds(now - *last_decode_active_)
                                   : -1);
  return s;
}

}  // namespace hmoe::router
