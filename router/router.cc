#include "router/router.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/model/tokenizer.h"

namespace hmoe::router {
namespace {

namespace v1 = hmoe::v1;
namespace dv1 = hmoe::decode::v1;

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

v1::FinishReason ToProto(dv1::FinishReason r) {
  switch (r) {
    case dv1::FINISH_REASON_EOS:
      return v1::FINISH_REASON_EOS;
    case dv1::FINISH_REASON_STOP:
      return v1::FINISH_REASON_STOP;
    case dv1::FINISH_REASON_LENGTH:
      return v1::FINISH_REASON_LENGTH;
    case dv1::FINISH_REASON_CANCELLED:
      return v1::FINISH_REASON_CANCELLED;
    case dv1::FINISH_REASON_ERROR:
      return v1::FINISH_REASON_ERROR;
    default:
      return v1::FINISH_REASON_UNSPECIFIED;
  }
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
  DecodeStream* stream ABSL_GUARDED_BY(mu) = nullptr;
  // Cancel RPC.
  bool cancelled_by_rpc ABSL_GUARDED_BY(mu) = false;
  // The client went away (watcher).
  bool client_gone ABSL_GUARDED_BY(mu) = false;

  // Breaks the current worker stream (if any) after setting a flag under the lock.
  void CancelStreamLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (stream != nullptr) stream->Cancel();
  }
};

Router::Router(RouterOptions options, WorkerRegistry* registry, DecodeClientFactory* decode_clients,
               const Tokenizer* tokenizer, const Clock* clock)
    : options_(std::move(options)),
      registry_(registry),
      decode_clients_(decode_clients),
      tokenizer_(tokenizer),
      clock_(clock),
      watcher_([this] { WatchCancellations(); }) {}

Router::~Router() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  watcher_ = std::jthread();  // joins
}

void Router::WatchCancellations() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.cancel_poll);
    if (stopping_) break;
    for (auto& [id, inflight] : inflight_) {
      if (!inflight->sink->IsCancelled()) continue;
      absl::MutexLock request_lock(&inflight->mu);
      if (inflight->client_gone) continue;
      inflight->client_gone = true;
      inflight->CancelStreamLocked();
    }
  }
}

void Router::StartDraining() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

int32_t Router::inflight() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int32_t>(inflight_.size());
}

absl::Status Router::Admit(const std::string& request_id, GenerateSink* sink,
                           std::shared_ptr<Inflight>* out) {
  absl::MutexLock lock(&mu_);
  ++requests_total_;
  if (draining_) {
    ++requests_rejected_;
    return absl::UnavailableError("router is draining");
  }
  if (static_cast<int32_t>(inflight_.size()) >= options_.max_inflight) {
    ++requests_rejected_;
    return absl::ResourceExhaustedError(
        absl::StrCat("router: ", options_.max_inflight, " requests in flight; retry later"));
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
  absl::MutexLock lock(&inflight->mu);
  inflight->cancelled_by_rpc = true;
  inflight->CancelStreamLocked();
  return absl::OkStatus();
}

absl::StatusOr<RouteDecision> Router::Route(int64_t prompt_tokens, PathHintKind hint, int attempt,
                                            absl::Time deadline) {
  // A retry waits for a decode worker to come back (a restart takes about a second).
  const absl::Time wait_until =
      attempt == 0 ? absl::InfinitePast() : std::min(deadline, absl::Now() + options_.retry_wait);
  while (true) {
    PolicyInput in;
    in.prompt_tokens = prompt_tokens;
    in.hint = hint;
    in.decode_workers = registry_->Live(WorkerKind::kDecode);
    // No prefill hand-off yet (router.h): the policy sees no prefill workers.
    in.now = clock_->Now();
    {
      absl::MutexLock lock(&mu_);
      in.decode_active_now = decode_active_ > 0;
      in.last_decode_active = last_decode_active_;
    }
    absl::StatusOr<RouteDecision> d = DecideRoute(in, options_.policy);
    if (d.ok() || !absl::IsUnavailable(d.status()) || absl::Now() >= wait_until) return d;
    absl::SleepFor(absl::Milliseconds(50));
  }
}

absl::Status Router::Generate(const v1::GenerateRequest& request, absl::Time deadline,
                              GenerateSink* sink) {
  const absl::Time arrival = absl::Now();
  HMOE_RETURN_IF_ERROR(ValidateGenerateRequest(request, options_.limits, tokenizer_));
  HMOE_ASSIGN_OR_RETURN(std::vector<int32_t> prompt,
                        ResolvePrompt(request, options_.limits, tokenizer_));
  std::shared_ptr<Inflight> inflight;
  HMOE_RETURN_IF_ERROR(Admit(request.request_id(), sink, &inflight));
  absl::Cleanup release = [&] { Release(inflight); };
  const std::string& id = inflight->request_id;

  dv1::AdmitRequest admit;
  admit.set_request_id(id);
  admit.mutable_prompt_token_ids()->Assign(prompt.begin(), prompt.end());
  {
    const v1::SamplingParams& s = request.sampling();
    dv1::SamplingParams* d = admit.mutable_sampling();
    d->set_temperature(s.temperature());
    d->set_top_k(s.top_k());
    d->set_top_p(s.top_p());
    d->set_min_p(s.min_p());
    d->set_repetition_penalty(s.repetition_penalty());
    d->set_presence_penalty(s.presence_penalty());
    d->set_seed(s.seed());
  }
  admit.set_max_new_tokens(request.max_new_tokens());
  admit.mutable_stop_token_ids()->CopyFrom(request.stop_token_ids());
  admit.set_ignore_eos(request.ignore_eos());

  std::optional<TextTracker> text;
  if (tokenizer_ != nullptr && (request.detokenize() || request.stop_strings_size() > 0)) {
    text.emplace(tokenizer_, request);
  }

  v1::Timing timing;
  int32_t tokens_streamed = 0;
  absl::Time first_token_time;
  absl::Time last_token_time;
  bool wrote_any = false;
  auto write = [&](v1::GenerateResponse& r) {
    if (!wrote_any) r.set_request_id(id);
    wrote_any = true;
    return sink->Write(r);
  };
  auto fill_timing = [&](v1::Finished* f) {
    const absl::Time end = absl::Now();
    v1::Timing* t = f->mutable_timing();
    *t = timing;
    if (tokens_streamed > 0) t->set_ttft_us(absl::ToInt64Microseconds(first_token_time - arrival));
    if (tokens_streamed > 1) {
      t->set_tpot_us(absl::ToInt64Microseconds(last_token_time - first_token_time) /
                     (tokens_streamed - 1));
    }
    t->set_total_us(absl::ToInt64Microseconds(end - arrival));
    f->mutable_usage()->set_prompt_tokens(static_cast<int32_t>(prompt.size()));
  };

  absl::Status last_error;
  for (int attempt = 0; attempt < options_.max_dispatch_attempts; ++attempt) {
    absl::StatusOr<RouteDecision> routed = Route(static_cast<int64_t>(prompt.size()),
                                                 HintKind(request.path_hint()), attempt, deadline);
    if (!routed.ok()) {
      if (attempt == 0) return routed.status();
      absl::MutexLock lock(&mu_);
      ++requests_failed_;
      return absl::Status(
          routed.status().code(),
          absl::StrCat(routed.status().message(), " (after ", last_error.ToString(), ")"));
    }
    const RouteDecision route = *std::move(routed);
    std::optional<WorkerView> worker = registry_->Find(route.decode_worker_id);
    if (!worker.has_value()) {
      last_error = absl::UnavailableError(
          absl::StrCat("decode worker ", route.decode_worker_id, " vanished"));
      continue;
    }
    timing.set_path(ToProto(route.path));
    timing.clear_worker_ids();
    timing.add_worker_ids(route.decode_worker_id);
    timing.set_attempts(attempt + 1);
    timing.set_queue_us(absl::ToInt64Microseconds(absl::Now() - arrival));
    HMOE_VLOG(1) << "req=" << id << " " << PathName(route.path) << " on " << route.decode_worker_id
                 << " attempt " << attempt + 1;

    std::shared_ptr<DecodeClient> client = decode_clients_->ForEndpoint(worker->identity.endpoint);
    std::unique_ptr<DecodeStream> stream = client->Admit(admit, deadline);
    {
      absl::MutexLock lock(&inflight->mu);
      inflight->stream = stream.get();
      if (inflight->cancelled_by_rpc || inflight->client_gone) stream->Cancel();
    }
    {
      absl::MutexLock lock(&mu_);
      ++decode_active_;
      ++worker_inflight_[route.decode_worker_id];
    }
    absl::Cleanup unactive = [&] {
      {
        absl::MutexLock lock(&inflight->mu);
        inflight->stream = nullptr;
      }
      absl::MutexLock lock(&mu_);
      --decode_active_;
      last_decode_active_ = clock_->Now();
      if (--worker_inflight_[route.decode_worker_id] == 0) {
        worker_inflight_.erase(route.decode_worker_id);
      }
    };

    dv1::AdmitResponse in;
    std::optional<dv1::Finished> finished;
    std::string stop_string;
    bool client_write_failed = false;
    while (!finished.has_value() && stream->Read(&in)) {
      if (in.has_token()) {
        v1::GenerateResponse out;
        v1::Token* t = out.mutable_token();
        t->set_token_id(in.token().token_id());
        t->set_index(tokens_streamed);
        if (text.has_value()) {
          std::string piece = text->Push(in.token().token_id(), &stop_string);
          if (request.detokenize()) t->set_text(std::move(piece));
        }
        const absl::Time now = absl::Now();
        if (tokens_streamed == 0) first_token_time = now;
        last_token_time = now;
        ++tokens_streamed;
        if (!write(out)) {
          client_write_failed = true;
          break;
        }
        if (!stop_string.empty()) break;
      } else if (in.has_finished()) {
        finished = in.finished();
      }
    }
    if (!finished.has_value()) stream->Cancel();
    const absl::Status status = stream->Finish();
    bool cancelled_by_rpc = false;
    bool client_gone = client_write_failed;
    {
      absl::MutexLock lock(&inflight->mu);
      cancelled_by_rpc = inflight->cancelled_by_rpc;
      client_gone = client_gone || inflight->client_gone;
    }
    if (client_gone) return absl::CancelledError("client cancelled");

    v1::GenerateResponse out;
    v1::Finished* f = out.mutable_finished();
    f->set_stop_token_id(-1);
    if (!stop_string.empty()) {
      f->set_reason(v1::FINISH_REASON_STOP);
      f->set_stop_string(stop_string);
    } else if (finished.has_value() && status.ok()) {
      f->set_reason(ToProto(finished->reason()));
      f->set_stop_token_id(finished->stop_token_id());
      f->set_error_message(finished->error_message());
      if (text.has_value()) {
        std::string rest = text->Flush(&stop_string);
        if (!stop_string.empty()) {
          f->set_reason(v1::FINISH_REASON_STOP);
          f->set_stop_string(stop_string);
        }
        if (request.detokenize()) f->set_text(std::move(rest));
      }
    } else if (cancelled_by_rpc) {
      f->set_reason(v1::FINISH_REASON_CANCELLED);
      f->set_error_message("cancelled by the Cancel RPC");
    } else {
      // The worker failed. Before any token the request can go elsewhere.
      const bool worker_down = absl::IsUnavailable(status) || absl::IsUnknown(status) ||
                               absl::IsInternal(status) || absl::IsAborted(status);
      if (worker_down) registry_->MarkDead(worker->identity.worker_id, worker->incarnation);
      if (worker_down && tokens_streamed == 0 && absl::Now() < deadline) {
        HMOE_LOG(WARNING) << "req=" << id << " decode worker " << worker->identity.worker_id
                          << " failed before the first token (" << status << "); retrying";
        last_error = status;
        continue;
      }
      {
        absl::MutexLock lock(&mu_);
        ++requests_failed_;
      }
      const std::string where = absl::StrCat("decode worker ", worker->identity.worker_id,
                                             " after ", tokens_streamed, " tokens: ");
      if (status.ok()) return absl::InternalError(where + "stream ended without Finished");
      if (worker_down) return absl::UnavailableError(where + std::string(status.message()));
      return absl::Status(status.code(), where + std::string(status.message()));
    }
    f->mutable_usage()->set_completion_tokens(finished.has_value() && stop_string.empty()
                                                  ? finished->usage().completion_tokens()
                                                  : tokens_streamed);
    fill_timing(f);
    write(out);
    return absl::OkStatus();
  }
  {
    absl::MutexLock lock(&mu_);
    ++requests_failed_;
  }
  return absl::UnavailableError(absl::StrCat("no decode worker could serve the request after ",
                                             options_.max_dispatch_attempts,
                                             " attempts; last error: ", last_error.ToString()));
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
    auto it = worker_inflight_.find(w.identity.worker_id);
    i->set_router_inflight(it == worker_inflight_.end() ? 0 : it->second);
  }
  s.set_inflight(static_cast<int32_t>(inflight_.size()));
  s.set_max_inflight(options_.max_inflight);
  s.set_prefill_queue(0);
  s.set_max_prefill_queue(0);
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
