#include "prefill_worker/prefill_scheduler.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/comm/shm_collective.h"

namespace hmoe::prefill {

struct PrefillScheduler::Job {
  PrefillJob spec;
  absl::Time arrival;
  // Set by Cancel, a vanished caller or Shutdown; polled by the runner between layers.
  std::atomic<bool> cancel{false};
  bool done = false;  // guarded by PrefillScheduler::mu_
  absl::StatusOr<PrefillOutcome> result = absl::UnknownError("not run");  // guarded by mu_
};

PrefillScheduler::PrefillScheduler(SlpRunner* runner, ExportTable* exports,
                                   PrefillSchedulerOptions options)
    : runner_(runner),
      exports_(exports),
      options_(std::move(options)),
      thread_([this] { ModelLoop(); }) {}

PrefillScheduler::~PrefillScheduler() { Shutdown(); }

absl::Status PrefillScheduler::Validate(const PrefillJob& job) const {
  if (job.id.empty()) return absl::InvalidArgumentError("request_id: empty");
  if (job.prompt.empty()) return absl::InvalidArgumentError("prompt_token_ids: empty prompt");
  const int64_t n = static_cast<int64_t>(job.prompt.size());
  if (n > runner_->max_prompt_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_token_ids: ", n,
                                                   " tokens, this worker prefills at most ",
                                                   runner_->max_prompt_tokens()));
  }
  const int64_t vocab = runner_->config().vocab_size;
  for (size_t i = 0; i < job.prompt.size(); ++i) {
    if (job.prompt[i] < 0 || job.prompt[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("prompt_token_ids[", i, "]: token id ",
                                                     job.prompt[i], " outside [0, ", vocab, ")"));
    }
  }
  SamplingParams sampling = job.sampling;
  sampling.max_new_tokens = 1;
  HMOE_RETURN_IF_ERROR(ValidateSamplingParams(sampling));  // InvalidArgument naming the field
  if (job.prefix.has_value()) {
    if (job.dslp.has_value()) {
      return absl::InvalidArgumentError("prefix_kv: not with dslp (DSLP prefills whole prompts)");
    }
    if (job.prefix->num_tokens < 1 || job.prefix->num_tokens >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("prefix_kv.num_tokens: ", job.prefix->num_tokens, ", expected 1 to ", n - 1,
                       " (the prompt has ", n, " tokens)"));
    }
    if (absl::Status s =
            ValidateKvHandleSpec(*job.prefix, HandoffShapeOf(runner_->kv_cache_config()));
        !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("prefix_kv: ", s.message()));
    }
  }
  if (job.dslp.has_value()) {
    HMOE_RETURN_IF_ERROR(ValidateDslpGroup(*job.dslp, runner_->device().kind()));
    HMOE_RETURN_IF_ERROR(runner_->CheckDslpPrompt(n, job.dslp->world_size));
  }
  return absl::OkStatus();
}

std::unique_ptr<KvImportSource> PrefillScheduler::OpenPrefix(const Job& job) {
  const KvHandleSpec& spec = *job.spec.prefix;
  absl::StatusOr<std::unique_ptr<KvImportSource>> source =
      importer_->Open(spec, HandoffShapeOf(runner_->kv_cache_config()));
  // One-shot: unlink the name now (our mapping stays valid), so the decode worker's buffer is
  // freed as soon as we are done with it rather than when the router releases it.
  if (absl::Status s = KvHandoffSegment::Remove(spec.shm_name); !s.ok() && !absl::IsNotFound(s)) {
    HMOE_LOG(WARNING) << "req=" << job.spec.id << " unlink prefix " << spec.shm_name << ": " << s;
  }
  if (!source.ok()) {
    HMOE_LOG(WARNING) << "req=" << job.spec.id << " prefix kv " << spec.shm_name << " unusable ("
                      << source.status() << "); prefilling the whole prompt";
    return nullptr;
  }
  return *std::move(source);
}

absl::StatusOr<SlpResult> PrefillScheduler::RunDslpJob(Job& job, const std::string& export_name) {
  const DslpGroupSpec& g = *job.spec.dslp;
  absl::StatusOr<SlpResult> ran = absl::UnknownError("not run");
  {
    absl::StatusOr<std::unique_ptr<Collective>> comm =
        JoinDslpGroup(g, runner_->device().kind(), options_.dslp_join, job.cancel);
    if (!comm.ok()) {
      ran = comm.status();
    } else {
      ran = runner_->RunDslp(job.spec.prompt, job.spec.sampling, export_name, job.cancel, **comm,
                             g.ep_mode_set ? g.ep_mode : options_.dslp_ep_mode);
    }
    // The collective goes here: this rank leaves the group (peers still waiting for it fail).
  }
  if (ran.ok()) return ran;
  // A group that never formed may leave its shared-memory object behind (its name is unique to
  // this request, so removing it cannot hurt a live group), and so may groups whose ranks all
  // died: clean both up.
  if (!g.shm_group.empty()) {
    if (absl::StatusOr<bool> removed = RemoveShmGroup(g.shm_group); !removed.ok()) {
      HMOE_LOG(WARNING) << "dslp group " << g.group_id << ": " << removed.status();
    }
  }
  if (absl::StatusOr<int> stale = RemoveStaleShmGroups(); !stale.ok()) {
    HMOE_LOG(WARNING) << "stale dslp groups: " << stale.status();
  }
  return GroupFailureStatus(ran.status(), g);
}

absl::StatusOr<PrefillOutcome> PrefillScheduler::Prefill(PrefillJob spec,
                                                         const std::function<bool()>& caller_gone) {
  HMOE_RETURN_IF_ERROR(Validate(spec));
  auto job = std::make_shared<Job>();
  job->arrival = absl::Now();
  job->spec = std::move(spec);
  const std::string id = job->spec.id;
  {
    absl::MutexLock lock(&mu_);
    if (!accepting_) {
      return absl::UnavailableError("prefill worker is draining; retry on another worker");
    }
    if (in_flight_.contains(id)) {
      return absl::AlreadyExistsError(absl::StrCat("request ", id, " is already in flight"));
    }
    if (exports_->Contains(id)) {
      return absl::AlreadyExistsError(
          absl::StrCat("request ", id, " still holds a kv export (Release it first)"));
    }
    if (static_cast<int>(queue_.size()) >= options_.max_waiting) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "prefill queue full (", queue_.size(), " waiting, at most ", options_.max_waiting, ")"));
    }
    queue_.push_back(job);
    in_flight_[id] = job;
  }
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&job->done), options_.poll_interval);
      if (job->done) return job->result;
      if (job->cancel.load(std::memory_order_relaxed)) continue;  // being cancelled
    }
    if (!caller_gone || !caller_gone()) continue;
    absl::MutexLock lock(&mu_);
    if (job->done) continue;
    HMOE_LOG(INFO) << "req=" << id << " caller went away; cancelling the prefill";
    // Relaxed: the runner polls the flag between layers; mu_ orders everything else.
    job->cancel.store(true, std::memory_order_relaxed);
    auto queued = std::find(queue_.begin(), queue_.end(), job);
    if (queued != queue_.end()) {
      queue_.erase(queued);
      FinishLocked(*job, absl::CancelledError("the caller went away"));
    }
  }
}

absl::Status PrefillScheduler::Cancel(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = in_flight_.find(id);
  if (it == in_flight_.end()) {
    return absl::NotFoundError(absl::StrCat("request ", id, " is not queued or running"));
  }
  std::shared_ptr<Job> job = it->second;
  job->cancel.store(true, std::memory_order_relaxed);
  auto queued = std::find(queue_.begin(), queue_.end(), job);
  if (queued != queue_.end()) {
    queue_.erase(queued);
    FinishLocked(*job, absl::CancelledError("cancelled by Cancel RPC"));
  }
  return absl::OkStatus();
}

void PrefillScheduler::FinishLocked(Job& job, absl::StatusOr<PrefillOutcome> result) {
  if (!result.ok()) {
    if (absl::IsCancelled(result.status())) {
      ++stats_.cancelled;
    } else {
      ++stats_.failed;
    }
  }
  job.result = std::move(result);
  job.done = true;
  in_flight_.erase(job.spec.id);
}

void PrefillScheduler::ModelLoop() {
  while (true) {
    std::shared_ptr<Job> job;
    std::string export_name;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &PrefillScheduler::HasWorkOrStop));
      if (stop_) return;
      job = queue_.front();
      queue_.pop_front();
      running_ = job;
      export_name = absl::StrCat(options_.export_prefix, next_export_++);
    }
    const absl::Time start = absl::Now();
    const std::string& id = job->spec.id;
    const bool dslp = job->spec.dslp.has_value();
    std::unique_ptr<KvImportSource> prefix;
    if (!dslp && job->spec.prefix.has_value()) prefix = OpenPrefix(*job);
    absl::StatusOr<SlpResult> ran = dslp ? RunDslpJob(*job, export_name)
                                         : runner_->Run(job->spec.prompt, job->spec.sampling,
                                                        export_name, job->cancel, prefix.get());
    prefix.reset();  // unmapped: the decode worker's segment is gone once we unlinked it
    absl::StatusOr<PrefillOutcome> outcome = absl::UnknownError("not run");
    if (!ran.ok()) outcome = ran.status();
    if (ran.ok()) {
      PrefillOutcome o;
      o.first_token = ran->first_token;
      if (ran->kv != nullptr) o.handle = ran->kv->handle();
      o.prompt_tokens = ran->prompt_tokens;
      o.prefix_tokens = ran->prefix_tokens;
      o.queue_us = absl::ToInt64Microseconds(start - job->arrival);
      o.prefill_us = ran->prefill_us;
      o.export_us = ran->export_us;
      o.bytes_streamed = ran->streaming.bytes_streamed;
      o.load_wait_us = static_cast<int64_t>(ran->streaming.load_wait_seconds * 1e6);
      o.peak_device_bytes = static_cast<int64_t>(ran->peak_device_bytes);
      o.ring_slots = ran->ring_slots;
      o.hidden_fraction = ran->streaming.hidden_fraction();
      o.exported = ran->kv != nullptr;
      if (dslp) {
        o.dslp_rank = ran->dslp_rank;
        o.dslp_local_tokens = ran->dslp.local_tokens;
        o.dslp_bytes_sent = static_cast<int64_t>(ran->dslp.comm.total_sent());
      }
      const std::string what = o.exported ? ran->kv->description() : "none (dslp rank > 0)";
      // The export is owned by the table from here on (freed by Release or the timeout).
      absl::Status added = absl::OkStatus();
      if (o.exported) added = exports_->Add(id, std::move(ran->kv));
      if (!added.ok()) {
        outcome = added;
      } else if (dslp) {
        outcome = o;
        const DslpStats& d = ran->dslp;
        HMOE_LOG(INFO) << "req=" << id << " dslp group " << job->spec.dslp->group_id << " rank "
                       << d.rank << "/" << d.world_size << " (" << EpModeName(d.ep_mode)
                       << "): prefilled " << o.prompt_tokens << " tokens (" << d.local_tokens
                       << " here) in " << o.prefill_us / 1000 << " ms (queue " << o.queue_us / 1000
                       << " ms, " << o.bytes_streamed << " weight bytes streamed, "
                       << d.comm.total_sent() << " bytes sent to peers): first token "
                       << o.first_token << ", kv " << what;
      } else {
        outcome = o;
        HMOE_LOG(INFO) << "req=" << id << " prefilled " << o.prompt_tokens - o.prefix_tokens
                       << " tokens after a " << o.prefix_tokens << "-token cached prefix in "
                       << o.prefill_us / 1000 << " ms (queue " << o.queue_us / 1000 << " ms, ring "
                       << o.ring_slots << ", " << ran->streaming.passes << " pass(es), "
                       << o.bytes_streamed << " weight bytes streamed, "
                       << static_cast<int>(100 * o.hidden_fraction)
                       << "% of copy time hidden): first token " << o.first_token << ", kv "
                       << what;
      }
    } else {
      HMOE_LOG(INFO) << "req=" << id << " prefill failed: " << ran.status();
    }
    absl::MutexLock lock(&mu_);
    if (dslp) {
      ++stats_.dslp_prefills;
      stats_.last_dslp_group = job->spec.dslp->group_id;
    }
    if (outcome.ok()) {
      ++stats_.prefills;
      stats_.prompt_tokens += outcome->prompt_tokens;
      stats_.last_peak_device_bytes = outcome->peak_device_bytes;
      stats_.last_ring_slots = outcome->ring_slots;
    }
    FinishLocked(*job, std::move(outcome));
    running_ = nullptr;
  }
}

void PrefillScheduler::StopAccepting() {
  absl::MutexLock lock(&mu_);
  accepting_ = false;
}

bool PrefillScheduler::WaitIdle(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithDeadline(absl::Condition(this, &PrefillScheduler::Idle), deadline);
}

void PrefillScheduler::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    accepting_ = false;
    while (!queue_.empty()) {
      std::shared_ptr<Job> job = queue_.front();
      queue_.pop_front();
      FinishLocked(*job, absl::UnavailableError("prefill worker shut down"));
    }
    if (running_ != nullptr) running_->cancel.store(true, std::memory_order_relaxed);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

PrefillSchedulerStats PrefillScheduler::stats() const {
  absl::MutexLock lock(&mu_);
  PrefillSchedulerStats s = stats_;
  s.draining = !accepting_;
  s.busy = running_ != nullptr;
  s.waiting = static_cast<int>(queue_.size());
  return s;
}

}  // namespace hmoe::prefill
