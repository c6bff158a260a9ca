#include "decode_worker/scheduler.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"

namespace hmoe::decode {
namespace {

// Seconds of stepping the tokens/s figure covers.
constexpr absl::Duration kRateWindow = absl::Seconds(5);
constexpr size_t kMaxRequestIdBytes = 256;

int64_t Micros(absl::Duration d) { return absl::ToInt64Microseconds(d); }

absl::Status CheckTokens(std::span<const int32_t> tokens, int64_t vocab, absl::string_view field) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "]: token id ", tokens[i], " outside [0, ", vocab, ")"));
    }
  }
  return absl::OkStatus();
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

struct Scheduler::Active {
  GenerationRequest request;
  std::shared_ptr<RequestChannel> channel;
  std::optional<Sampler> sampler;
  std::unique_ptr<StepSequence> sequence;
  // Prompt tokens whose KV is in the cache.
  int64_t prompt_done = 0;
  // Of those, reused from the prefix cache at admission.
  int64_t cached_tokens = 0;
  // While prefilling: the request's turn for a step's first prompt chunk (lowest first, ties to
  // the older request). Joining the batch once s steps have run gives s - 1; taking a chunk in
  // step s (counted from 0) gives s + 1. So a prompt that joins goes before one that had the last
  // step's chunk, and prompts that wait take turns with it (round robin): a long prompt delays a
  // short one by at most one chunk, and gets at least every second step's first chunk itself.
  int64_t chunk_turn = 0;
  // Past the prompt: the token the next step feeds (the last one sampled).
  int32_t next_input = -1;
  bool cancel = false;
  std::string cancel_reason;
  bool finished = false;
  absl::Time admit_time;
  absl::Time start_time;  // joined the running batch
  absl::Time first_token_time;
  absl::Time last_token_time;
  int64_t inter_token_sum_us = 0;
  int64_t inter_token_count = 0;
  int32_t completion_tokens = 0;

  bool prefilling() const { return prompt_done < request.prompt_tokens(); }
};

absl::StatusOr<PackingPolicy> ParsePackingPolicy(const std::string& value) {
  if (value == "auto") return PackingPolicy::kAuto;
  if (value == "always") return PackingPolicy::kAlways;
  return absl::InvalidArgumentError(
      absl::StrCat("prefill packing \"", value, "\" must be auto or always"));
}

const char* PackingPolicyName(PackingPolicy p) {
  return p == PackingPolicy::kAuto ? "auto" : "always";
}

// ------------------------------------------------------------------------------- creation

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Create(StepEngine& engine,
                                                             const SchedulerOptions& options) {
  if (options.batch_size < 1 || options.batch_size > engine.max_step_sequences()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch size ", options.batch_size, " must be in [1, ", engine.max_step_sequences(), "]"));
  }
  if (options.chunk_size < 1 ||
      options.chunk_size + options.batch_size > engine.max_step_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk size ", options.chunk_size, " must be >= 1 and chunk size + batch size (",
        options.chunk_size + options.batch_size, ") at most the engine's step of ",
        engine.max_step_tokens(), " tokens"));
  }
  if (options.prefills_per_step < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefills per step ", options.prefills_per_step, " must be >= 1"));
  }
  if (options.max_waiting < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max waiting ", options.max_waiting, " must be >= 0"));
  }
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<StepRunner> runner,
                        StepRunner::Create(engine, options.dual_batch));
  std::unique_ptr<Scheduler> s(new Scheduler(engine, options, std::move(runner)));
  s->engine_thread_ = std::jthread([raw = s.get()] { raw->EngineLoop(); });
  return s;
}

Scheduler::Scheduler(StepEngine& engine, const SchedulerOptions& options,
                     std::unique_ptr<StepRunner> runner)
    : engine_(engine), options_(options), runner_(std::move(runner)) {
  local_.kv_blocks_total = engine_.kv_blocks_total();
  local_.kv_blocks_free = engine_.kv_blocks_free();
  stats_ = local_;
}

Scheduler::~Scheduler() { Shutdown(); }

// ------------------------------------------------------------------------------- callers

absl::Status Scheduler::ValidateRequest(const GenerationRequest& r, const StepEngine& engine) {
  if (r.id.empty()) return absl::InvalidArgumentError("request_id: must not be empty");
  if (r.id.size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_id: longer than ", kMaxRequestIdBytes, " bytes"));
  }
  const int64_t vocab = engine.vocab_size();
  if (r.has_kv()) {
    if (r.kv == nullptr) return absl::InvalidArgumentError("kv_handle: not opened");
    if (r.kv_num_tokens < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv_handle.num_tokens: ", r.kv_num_tokens, " must be >= 1"));
    }
    if (!r.prompt.empty() && static_cast<int64_t>(r.prompt.size()) != r.kv_num_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt_token_ids: ", r.prompt.size(), " tokens with a kv_handle of ", r.kv_num_tokens,
          " tokens (with a kv_handle the prompt is optional and must match it)"));
    }
    if (r.first_token < 0 || r.first_token >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("first_token_id: token id ", r.first_token, " outside [0, ", vocab, ")"));
    }
  } else if (r.prompt.empty()) {
    return absl::InvalidArgumentError(
        "prompt_token_ids: empty prompt (give prompt tokens or a kv_handle)");
  }
  HMOE_RETURN_IF_ERROR(CheckTokens(r.prompt, vocab, "prompt_token_ids"));
  HMOE_RETURN_IF_ERROR(CheckTokens(r.sampling.stop_token_ids, vocab, "stop_token_ids"));
  HMOE_RETURN_IF_ERROR(ValidateSamplingParams(r.sampling));
  HMOE_RETURN_IF_ERROR(CheckFitsContext("prompt_token_ids", r.prompt_tokens(),
                                        r.sampling.max_new_tokens, engine.max_context_tokens()));
  const int64_t total = r.prompt_tokens() + r.sampling.max_new_tokens;
  const int64_t blocks = CeilDiv(total, engine.kv_block_tokens());
  if (blocks > engine.kv_blocks_total()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("kv cache: prompt + max_new_tokens = ", total, " tokens need ", blocks,
                     " blocks but the pool has ", engine.kv_blocks_total(), " blocks of ",
                     engine.kv_block_tokens(), " tokens"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<RequestChannel>> Scheduler::Submit(GenerationRequest request) {
  const absl::Time now = absl::Now();
  HMOE_RETURN_IF_ERROR(ValidateRequest(request, engine_));
  auto active = std::make_unique<Active>();
  active->sampler.emplace(
      Sampler::Create(request.sampling, request.prompt, engine_.eos_token_ids()));
  active->channel = std::make_shared<RequestChannel>();
  active->admit_time = now;
  active->request = std::move(request);
  std::shared_ptr<RequestChannel> channel = active->channel;
  const std::string id = active->request.id;
  const int64_t prompt_tokens = active->request.prompt_tokens();
  const bool has_kv = active->request.has_kv();
  const int64_t max_new = active->request.sampling.max_new_tokens;
  {
    absl::MutexLock lock(&mu_);
    if (draining_ || stopping_) {
      return absl::UnavailableError("decode worker is shutting down; not admitting requests");
    }
    if (in_flight_.contains(id)) {
      return absl::AlreadyExistsError(absl::StrCat("request_id: ", id, " is already in flight"));
    }
    if (num_waiting_ >= options_.max_waiting) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "waiting queue full (", num_waiting_, " requests wait for a batch slot or KV blocks)"));
    }
    in_flight_.insert(id);
    ++num_waiting_;
    inbox_.push_back(std::move(active));
  }
  HMOE_LOG(INFO) << "req=" << id << " admitted: " << (has_kv ? "kv hand-off of " : "prompt of ")
                 << prompt_tokens << " tokens, max_new_tokens " << max_new;
  return channel;
}

absl::Status Scheduler::Cancel(const std::string& request_id, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  if (!in_flight_.contains(request_id)) {
    return absl::NotFoundError(absl::StrCat("request ", request_id, " is not in flight"));
  }
  cancels_.emplace_back(request_id, reason);
  return absl::OkStatus();
}

void Scheduler::StopAccepting() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

bool Scheduler::WaitIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithDeadline(absl::Condition(this, &Scheduler::Idle), deadline);
}

void Scheduler::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    stopping_ = true;
  }
  if (engine_thread_.joinable()) engine_thread_.join();
}

SchedulerStats Scheduler::stats() const {
  absl::MutexLock lock(&mu_);
  SchedulerStats s = stats_;
  s.draining = draining_;
  s.waiting = num_waiting_;
  // The rate covers recent stepping only: idle for a whole window means 0.
  if (last_step_time_ == absl::Time() || absl::Now() - last_step_time_ > kRateWindow) {
    s.tokens_per_second = 0;
  }
  s.kv_blocks_free = engine_.kv_blocks_free();
  s.prefix_cache = engine_.prefix_cache_stats();
  return s;
}

// ------------------------------------------------------------------------------- engine thread

void Scheduler::EngineLoop() {
  bool stalled = false;  // nothing could run last time: block for news
  while (true) {
    const bool block = stalled || (running_.empty() && waiting_.empty());
    if (!TakeInbox(block)) break;
    ApplyCancels();
    RemoveFinished();
    AdmitWaiting();
    stalled = !RunOneStep();
    RemoveFinished();
    PublishStats();
  }
  // Shutting down: everything still here is cancelled.
  {
    absl::MutexLock lock(&mu_);
    while (!inbox_.empty()) {
      waiting_.push_back(std::move(inbox_.front()));
      inbox_.pop_front();
    }
  }
  auto cancel = [this](std::unique_ptr<Active>& a) {
    if (!a->finished) {
      Finish(*a, FinishReason::kCancelled, absl::CancelledError("worker shutting down"), -1);
    }
  };
  for (auto& a : running_) cancel(a);
  for (auto& a : waiting_) cancel(a);
  RemoveFinished();
  PublishStats();
}

bool Scheduler::TakeInbox(bool block) {
  absl::MutexLock lock(&mu_);
  if (block) mu_.Await(absl::Condition(this, &Scheduler::HasInboxWork));
  if (stopping_) return false;
  while (!inbox_.empty()) {
    waiting_.push_back(std::move(inbox_.front()));
    inbox_.pop_front();
  }
  for (auto& c : cancels_) pending_cancels_.push_back(std::move(c));
  cancels_.clear();
  return true;
}

void Scheduler::ApplyCancels() {
  for (const auto& cancel : pending_cancels_) {
    auto mark = [&cancel](Active& a) {
      if (a.request.id == cancel.first && !a.finished) {
        a.cancel = true;
        a.cancel_reason = cancel.second;
      }
    };
    for (auto& a : waiting_) mark(*a);
    for (auto& a : running_) mark(*a);
  }
  pending_cancels_.clear();
  for (auto& a : waiting_) {
    if (a->cancel && !a->finished) {
      Finish(*a, FinishReason::kCancelled, absl::CancelledError(a->cancel_reason), -1);
    }
  }
  for (auto& a : running_) {
    if (a->cancel && !a->finished) {
      Finish(*a, FinishReason::kCancelled, absl::CancelledError(a->cancel_reason), -1);
    }
  }
}

void Scheduler::AdmitWaiting() {
  while (static_cast<int>(running_.size()) < options_.batch_size && !waiting_.empty()) {
    Active& a = *waiting_.front();
    if (a.finished) {
      waiting_.pop_front();
      continue;
    }
    const int64_t reserve = a.request.prompt_tokens() + a.request.sampling.max_new_tokens;
    const absl::Time t0 = absl::Now();
    absl::StatusOr<std::unique_ptr<StepSequence>> seq =
        a.request.kv != nullptr
            ? engine_.NewImportedSequence(reserve, *a.request.kv,
                                          a.request.kv_cacheable && a.request.use_prefix_cache
                                              ? std::span<const int32_t>(a.request.prompt)
                                              : std::span<const int32_t>())
        : a.request.use_prefix_cache ? engine_.NewSequenceFromPrefix(reserve, a.request.prompt)
                                     : engine_.NewSequence(reserve);
    if (absl::IsResourceExhausted(seq.status())) break;  // FIFO: wait for blocks to free up
    if (!seq.ok()) {
      absl::Status error = seq.status();
      if (a.request.kv != nullptr) {
        error = absl::Status(
            error.code(),
            absl::StrCat("import kv from ", a.request.kv->description(), ": ", error.message()));
      }
      Finish(a, FinishReason::kError, std::move(error), -1);
      waiting_.pop_front();
      continue;
    }
    a.sequence = *std::move(seq);
    a.start_time = absl::Now();
    if (!a.request.has_kv() && a.sequence->num_tokens() > 0) {
      a.prompt_done = a.cached_tokens = a.sequence->num_tokens();
      HMOE_LOG(INFO) << "req=" << a.request.id << " prefix cache: " << a.cached_tokens << " of "
                     << a.request.prompt.size() << " prompt tokens reused";
    }
    if (a.request.has_kv()) {
      // The ack: the payload is in our pool; unmap the source and tell the caller.
      a.request.kv.reset();
      a.prompt_done = a.request.kv_num_tokens;
      local_.kv_tokens_imported += a.request.kv_num_tokens;
      a.channel->Push(KvImportedEvent{a.request.kv_num_tokens, Micros(a.start_time - t0)});
      // The prefill worker's token is the first generated one.
      const FinishReason reason = a.sampler->Accept(a.request.first_token);
      ++a.completion_tokens;
      ++local_.tokens_generated;
      a.last_token_time = a.start_time;
      if (reason != FinishReason::kNone) {
        Finish(a, reason, absl::OkStatus(),
               reason == FinishReason::kLength ? -1 : a.request.first_token);
      } else {
        a.next_input = a.request.first_token;
      }
    }
    a.chunk_turn = local_.steps - 1;
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
    absl::MutexLock lock(&mu_);
    --num_waiting_;
  }
}

bool Scheduler::RunOneStep() {
  std::vector<StepInput> inputs;
  std::vector<Active*> owners;
  std::vector<int64_t> prefill_tokens;  // per input; 0 for a decode token
  // Prompt tokens this step may still take: whole chunks of the prefilling requests, while they
  // fit in one chunk's worth, the count allows and (beyond the first) the packing policy takes
  // them; the first not taken ends the packing. The first chunk is the turn of the prefilling
  // request that has waited longest for one (Active::chunk_turn: round robin, so a short prompt
  // is not held behind every chunk of a long one); the rest follow oldest first. A request's
  // chunks are always the next chunk_size tokens of its own prompt, whatever else shares the step.
  int64_t prefill_budget = options_.chunk_size;
  int64_t decoding = 0;  // sequences of the step that decode one token
  for (const auto& ap : running_) decoding += !ap->finished && !ap->prefilling();
  // The fit as of the last step (RunOneStep refreshes local_.step_cost after every step).
  const std::optional<StepCost>& cost =
      options_.fixed_step_cost.has_value() ? options_.fixed_step_cost : local_.step_cost;
  std::vector<Active*> candidates;
  for (const auto& ap : running_) {
    if (ap->finished || !ap->prefilling()) continue;
    candidates.push_back(ap.get());
  }
  if (!candidates.empty()) {
    // Only the first chunk is by turn (the oldest of equal turns); the others keep the batch's
    // (arrival) order.
    auto first = std::min_element(
        candidates.begin(), candidates.end(),
        [](const Active* x, const Active* y) { return x->chunk_turn < y->chunk_turn; });
    std::rotate(candidates.begin(), first, first + 1);
  }
  std::vector<std::pair<const Active*, int64_t>> chunks;  // taken: request, prompt tokens
  for (Active* a : candidates) {
    const int64_t remaining = a->request.prompt_tokens() - a->prompt_done;
    const int64_t n = std::min(remaining, options_.chunk_size);
    const int64_t prefills = static_cast<int64_t>(chunks.size());
    const bool packs = prefills == 0 || options_.packing == PackingPolicy::kAlways ||
                       (cost.has_value() && cost->WorthPacking(decoding + prefills, n));
    if (n > prefill_budget || prefills == options_.prefills_per_step || !packs) break;
    prefill_budget -= n;
    if (prefills > 0) ++local_.packed_prefills;
    a->chunk_turn = local_.steps + 1;
    chunks.emplace_back(a, n);
  }
  for (auto& ap : running_) {
    Active& a = *ap;
    if (a.finished) continue;
    if (a.prefilling()) {
      auto it =
          std::find_if(chunks.begin(), chunks.end(), [&](const auto& c) { return c.first == &a; });
      if (it == chunks.end()) continue;
      const int64_t n = it->second;
      StepInput in;
      in.sequence = a.sequence.get();
      in.tokens = std::span<const int32_t>(a.request.prompt).subspan(a.prompt_done, n);
      in.want_logits = a.prompt_done + n == a.request.prompt_tokens();
      inputs.push_back(in);
      prefill_tokens.push_back(n);
    } else {
      StepInput in;
      in.sequence = a.sequence.get();
      in.tokens = std::span<const int32_t>(&a.next_input, 1);
      in.want_logits = true;
      inputs.push_back(in);
      prefill_tokens.push_back(0);
    }
    owners.push_back(&a);
  }
  if (inputs.empty()) return false;

  const absl::Time t0 = absl::Now();
  std::vector<StepResult> results = runner_->Run(inputs);
  const absl::Time t1 = absl::Now();
  const int64_t step_us = Micros(t1 - t0);
  int64_t step_tokens = 0;
  for (const StepInput& in : inputs) step_tokens += static_cast<int64_t>(in.tokens.size());
  step_cost_.Add(step_tokens, static_cast<double>(step_us));
  local_.step_cost = step_cost_.Estimate();
  if (local_.step_cost.has_value() && t1 - last_cost_log_ >= absl::Minutes(1)) {
    last_cost_log_ = t1;
    HMOE_LOG(INFO) << "step cost fit: " << static_cast<int64_t>(local_.step_cost->fixed_us)
                   << " us + " << static_cast<int64_t>(local_.step_cost->per_token_us)
                   << " us/token over " << step_cost_.samples() << " steps; "
                   << local_.packed_prefills << " prefill chunk(s) packed so far (packing "
                   << PackingPolicyName(options_.packing) << ", up to "
                   << options_.prefills_per_step << " per step)";
  }
  ++local_.steps;
  if (runner_->last_split().dual) ++local_.dual_steps;
  HMOE_VLOG(2) << "step " << local_.steps << ": " << inputs.size() << " sequences"
               << (runner_->last_split().dual ? " (dual batch)" : "") << ", " << step_us << " us";

  const int64_t tokens_before = local_.tokens_generated;
  for (size_t i = 0; i < inputs.size(); ++i) {
    Active& a = *owners[i];
    StepResult& r = results[i];
    if (!r.status.ok()) {
      HMOE_LOG(ERROR) << "req=" << a.request.id << " step failed: " << r.status;
      Finish(a, FinishReason::kError, r.status, -1);
      continue;
    }
    if (prefill_tokens[i] > 0) {
      a.prompt_done += prefill_tokens[i];
      local_.prompt_tokens_prefilled += prefill_tokens[i];
      if (a.prefilling()) continue;
      // The prompt's full blocks are final now: requests arriving meanwhile can share them.
      OfferPrefix(a, /*finished=*/false);
    }
    SampleAndEmit(a, r.logits, step_us);
  }
  const int64_t sampled = local_.tokens_generated - tokens_before;
  rate_window_.emplace_back(t1, sampled);
  rate_steps_.push_back(absl::ToDoubleSeconds(t1 - t0));
  rate_tokens_ += sampled;
  rate_seconds_ += rate_steps_.back();
  while (t1 - rate_window_.front().first > kRateWindow) {
    rate_tokens_ -= rate_window_.front().second;
    rate_seconds_ -= rate_steps_.front();
    rate_window_.pop_front();
    rate_steps_.pop_front();
  }
  return true;
}

void Scheduler::SampleAndEmit(Active& a, const std::vector<float>& logits, int64_t step_us) {
  absl::StatusOr<int32_t> token = a.sampler->Sample(logits);
  if (!token.ok()) {
    Finish(a, FinishReason::kError, token.status(), -1);
    return;
  }
  const FinishReason reason = a.sampler->Accept(*token);
  const absl::Time now = absl::Now();
  ++a.completion_tokens;
  ++local_.tokens_generated;
  if (a.first_token_time == absl::Time()) a.first_token_time = now;
  if (a.last_token_time != absl::Time()) {
    a.inter_token_sum_us += Micros(now - a.last_token_time);
    ++a.inter_token_count;
  }
  a.last_token_time = now;
  if (reason == FinishReason::kEos || reason == FinishReason::kStop) {  // not streamed
    Finish(a, reason, absl::OkStatus(), *token);
    return;
  }
  TokenEvent e;
  e.token = *token;
  e.index = static_cast<int32_t>(a.sampler->generated().size()) - 1;
  e.time_since_admit_us = Micros(now - a.admit_time);
  e.step_us = step_us;
  a.channel->Push(e);
  if (reason == FinishReason::kLength) {
    Finish(a, reason, absl::OkStatus(), -1);
    return;
  }
  a.next_input = *token;
}

void Scheduler::OfferPrefix(Active& a, bool finished) {
  if (!a.request.use_prefix_cache || a.sequence == nullptr || a.request.prompt.empty()) return;
  // Imported KV is another path's arithmetic: reusing it would not give the tokens of prefilling
  // here unless the path is bit-identical, which the caller says.
  if (a.request.has_kv() && !a.request.kv_cacheable) return;
  // The sequence holds the prompt, then the generated tokens fed back (all but the last sampled).
  std::vector<int32_t> tokens = a.request.prompt;
  if (finished) {
    const std::vector<int32_t>& generated = a.sampler->generated();
    tokens.insert(tokens.end(), generated.begin(), generated.end());
  }
  engine_.OfferPrefix(*a.sequence, tokens, finished);
}

void Scheduler::Finish(Active& a, FinishReason reason, absl::Status error, int32_t stop_token) {
  if (a.finished) return;
  a.finished = true;
  // A failed step may have left partial rows; anything else leaves a KV valid for its tokens.
  if (reason != FinishReason::kError) OfferPrefix(a, /*finished=*/true);
  a.sequence.reset();  // Frees the KV blocks now (those the prefix cache took stay).
  a.request.kv.reset();
  const absl::Time now = absl::Now();
  FinishEvent f;
  f.reason = reason;
  f.stop_token = stop_token;
  f.error = std::move(error);
  f.prompt_tokens = static_cast<int32_t>(a.request.prompt_tokens());
  f.completion_tokens = a.completion_tokens;
  f.imported_tokens = a.request.has_kv() ? static_cast<int32_t>(a.request.kv_num_tokens) : 0;
  f.cached_tokens = static_cast<int32_t>(a.cached_tokens);
  const absl::Time started = a.start_time == absl::Time() ? now : a.start_time;
  f.queue_us = Micros(started - a.admit_time);
  f.first_token_us =
      a.first_token_time == absl::Time() ? 0 : Micros(a.first_token_time - a.admit_time);
  f.total_us = Micros(now - a.admit_time);
  f.mean_inter_token_us = a.inter_token_count == 0 ? 0 : a.inter_token_sum_us / a.inter_token_count;
  ++local_.requests_finished;
  if (reason == FinishReason::kCancelled) ++local_.requests_cancelled;
  if (reason == FinishReason::kError) ++local_.requests_failed;
  HMOE_LOG(INFO) << "req=" << a.request.id << " finished: " << FinishReasonName(reason) << ", "
                 << a.completion_tokens << " tokens, " << f.total_us / 1000 << " ms"
                 << (f.error.ok() ? "" : absl::StrCat(" (", f.error.ToString(), ")"));
  {
    absl::MutexLock lock(&mu_);
    in_flight_.erase(a.request.id);
    if (a.start_time == absl::Time()) --num_waiting_;  // it never left the waiting list
    // Published with the erase, so a caller that saw WaitIdle return sees the counts.
    stats_.requests_finished = local_.requests_finished;
    stats_.requests_cancelled = local_.requests_cancelled;
    stats_.requests_failed = local_.requests_failed;
    stats_.tokens_generated = local_.tokens_generated;
  }
  a.channel->Push(std::move(f));
}

void Scheduler::RemoveFinished() {
  std::erase_if(running_, [](const std::unique_ptr<Active>& a) { return a->finished; });
  std::erase_if(waiting_, [](const std::unique_ptr<Active>& a) { return a->finished; });
}

void Scheduler::PublishStats() {
  local_.running = static_cast<int>(running_.size());
  local_.max_running_seen = std::max(local_.max_running_seen, local_.running);
  local_.waiting = static_cast<int>(waiting_.size());
  local_.tokens_per_second = rate_seconds_ > 0 ? rate_tokens_ / rate_seconds_ : 0.0;
  absl::MutexLock lock(&mu_);
  stats_ = local_;
  last_step_time_ = rate_window_.empty() ? absl::Time() : rate_window_.back().first;
}

}  // namespace hmoe::decode
