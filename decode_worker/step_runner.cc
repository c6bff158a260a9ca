#include "decode_worker/step_runner.h"

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"

namespace hmoe::decode {
void StepRunner::Alternation::Reset() {
  absl::MutexLock lock(&mu_);
  done_[0] = done_[1] = 0;
  retired_[0] = retired_[1] = false;
}

void StepRunner::Alternation::Acquire(int party, int64_t turn) {
  absl::MutexLock lock(&mu_);
  const int other = 1 - party;
  const int64_t need = party == 0 ? turn : turn + 1;
  auto ready = [this, other, need]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return retired_[other] || done_[other] >= need;
  };
  mu_.Await(absl::Condition(&ready));
}

void StepRunner::Alternation::Release(int party) {
  absl::MutexLock lock(&mu_);
  ++done_[party];
}

void StepRunner::Alternation::Retire(int party) {
  absl::MutexLock lock(&mu_);
  retired_[party] = true;
}

class StepRunner::Turn {
 public:
  Turn(Alternation& resource, int party, int64_t turn)
      : resource_(party >= 0 ? &resource : nullptr), party_(party) {
    if (resource_ != nullptr) resource_->Acquire(party_, turn);
  }
  ~Turn() {
    if (resource_ != nullptr) resource_->Release(party_);
  }
  Turn(const Turn&) = delete;
  Turn& operator=(const Turn&) = delete;

 private:
  Alternation* resource_;
  int party_;
};

size_t BalancedSplit(std::span<const int64_t> token_counts) {
  HMOE_CHECK(token_counts.size() >= 2) << "BalancedSplit needs two inputs";
  int64_t total = 0;
  for (int64_t n : token_counts) total += n;
  size_t best = 1;
  int64_t best_diff = -1;
  int64_t prefix = 0;
  for (size_t k = 1; k < token_counts.size(); ++k) {
    prefix += token_counts[k - 1];
    const int64_t diff = std::llabs(total - 2 * prefix);
    if (best_diff < 0 || diff < best_diff) {
      best = k;
      best_diff = diff;
    }
  }
  return best;
}

absl::StatusOr<std::unique_ptr<StepRunner>> StepRunner::Create(StepEngine& engine,
                                                               bool dual_batch) {
  HMOE_ASSIGN_OR_RETURN(std::unique_ptr<StepBatch> first, engine.NewStepBatch());
  std::unique_ptr<StepBatch> second;
  if (dual_batch) {
    HMOE_ASSIGN_OR_RETURN(second, engine.NewStepBatch());
  }
  return std::unique_ptr<StepRunner>(new StepRunner(engine, std::move(first), std::move(second)));
}

StepRunner::StepRunner(StepEngine& engine, std::unique_ptr<StepBatch> first,
                       std::unique_ptr<StepBatch> second)
    : engine_(engine),
      first_(std::move(first)),
      second_(std::move(second)),
      helper_result_(absl::UnknownError("no step")) {
  if (second_ != nullptr) {
    helper_ = std::jthread([this](std::stop_token stop) { HelperLoop(stop); });
  }
}

StepRunner::~StepRunner() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (helper_.joinable()) helper_.join();
}

void StepRunner::HelperLoop(std::stop_token /*stop*/) {
  while (true) {
    std::span<const StepInput> inputs;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &StepRunner::HelperReady));
      if (stopping_) return;
      inputs = helper_inputs_;
      helper_has_work_ = false;
    }
    absl::StatusOr<std::vector<std::vector<float>>> result =
        RunBatch(*second_, inputs, /*party=*/1);
    absl::MutexLock lock(&mu_);
    helper_result_ = std::move(result);
    helper_done_ = true;
  }
}

absl::StatusOr<std::vector<std::vector<float>>> StepRunner::RunBatch(
    StepBatch& batch, std::span<const StepInput> inputs, int party) {
  const int64_t num_layers = engine_.num_layers();
  auto run = [&]() -> absl::StatusOr<std::vector<std::vector<float>>> {
    {
      Turn turn(attention_, party, 0);
      HMOE_RETURN_IF_ERROR(batch.Begin(inputs));
      if (num_layers > 0) HMOE_RETURN_IF_ERROR(batch.RunAttention(0));
    }
    for (int64_t layer = 0; layer < num_layers; ++layer) {
      {
        Turn turn(ffn_, party, layer);
        HMOE_RETURN_IF_ERROR(batch.RunFfn(layer));
      }
      if (layer + 1 < num_layers) {
        Turn turn(attention_, party, layer + 1);
        HMOE_RETURN_IF_ERROR(batch.RunAttention(layer + 1));
      }
    }
    Turn turn(attention_, party, std::max<int64_t>(num_layers, 1));
    return batch.Finish();
  };
  absl::StatusOr<std::vector<std::vector<float>>> result = run();
  if (party >= 0) {
    attention_.Retire(party);
    ffn_.Retire(party);
  }
  return result;
}

std::vector<StepResult> StepRunner::Run(std::span<const StepInput> inputs) {
  std::vector<StepResult> results(inputs.size());
  auto fill = [&](size_t begin, size_t end,
                  absl::StatusOr<std::vector<std::vector<float>>>& batch_result) {
    for (size_t i = begin; i < end; ++i) {
      if (!batch_result.ok()) {
        results[i].status = batch_result.status();
      } else if (batch_result->size() != end - begin) {
        results[i].status =
            absl::InternalError(absl::StrCat("engine step returned ", batch_result->size(),
                                             " results for ", end - begin, " inputs"));
      } else {
        results[i].logits = std::move((*batch_result)[i - begin]);
      }
    }
  };

  if (second_ == nullptr || inputs.size() < 2) {
    last_split_ = StepSplit{false, inputs.size()};
    absl::StatusOr<std::vector<std::vector<float>>> r = RunBatch(*first_, inputs, /*party=*/-1);
    fill(0, inputs.size(), r);
    return results;
  }

  std::vector<int64_t> counts;
  counts.reserve(inputs.size());
  for (const StepInput& in : inputs) counts.push_back(static_cast<int64_t>(in.tokens.size()));
  const size_t split = BalancedSplit(counts);
  last_split_ = StepSplit{true, split};
  attention_.Reset();
  ffn_.Reset();
  {
    absl::MutexLock lock(&mu_);
    helper_inputs_ = inputs.subspan(split);
    helper_done_ = false;
    helper_has_work_ = true;
  }
  absl::StatusOr<std::vector<std::vector<float>>> a =
      RunBatch(*first_, inputs.subspan(0, split), /*party=*/0);
  absl::StatusOr<std::vector<std::vector<float>>> b = absl::UnknownError("no result");
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&helper_done_));
    b = std::move(helper_result_);
    helper_result_ = absl::UnknownError("no step");
  }
  fill(0, split, a);
  fill(split, inputs.size(), b);
  return results;
}

}  // namespace hmoe::decode
