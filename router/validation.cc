#include "router/validation.h"

#include <algorithm>
#include <optional>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#include "common/base/status_macros.h"
#include "common/model/tokenizer.h"
#include "common/sampling/sampling.h"
#include "router/api_convert.h"

namespace hmoe::router {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

bool IsRequestIdChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == ':' || c == '-';
}

}  // namespace

absl::Status ValidateSampling(const hmoe::v1::SamplingParams& s) {
  v1::GenerateRequest request;
  *request.mutable_sampling() = s;
  request.set_max_new_tokens(1);
  return ValidateSamplingParams(SamplingFromApi(request));
}

absl::Status ValidateGenerateRequest(const hmoe::v1::GenerateRequest& request,
                                     const ModelLimits& limits, const Tokenizer* tokenizer) {
  if (limits.max_request_bytes > 0 &&
      static_cast<int64_t>(request.ByteSizeLong()) > limits.max_request_bytes) {
    return Invalid("request", absl::StrCat(request.ByteSizeLong(), " bytes exceeds the limit of ",
                                           limits.max_request_bytes));
  }
  const std::string& id = request.request_id();
  if (id.size() > static_cast<size_t>(kMaxRequestIdLength)) {
    return Invalid("request_id", absl::StrCat("longer than ", kMaxRequestIdLength, " characters"));
  }
  for (char c : id) {
    if (!IsRequestIdChar(c)) return Invalid("request_id", "only [A-Za-z0-9._:-] allowed");
  }
  switch (request.prompt_case()) {
    case hmoe::v1::GenerateRequest::kPromptTokenIds:
      if (request.prompt_token_ids().ids().empty()) {
        return Invalid("prompt_token_ids", "empty prompt");
      }
      break;
    case hmoe::v1::GenerateRequest::kPromptText:
      if (request.prompt_text().empty()) return Invalid("prompt_text", "empty prompt");
      if (tokenizer == nullptr) {
        return Invalid("prompt_text", "the router has no tokenizer (start it with --model)");
      }
      break;
    case hmoe::v1::GenerateRequest::PROMPT_NOT_SET:
      return Invalid("prompt", "empty prompt (set prompt_token_ids or prompt_text)");
  }
  // The sampling rules and max_new_tokens >= 1: common/sampling's, for every boundary.
  HMOE_RETURN_IF_ERROR(ValidateSamplingParams(SamplingFromApi(request)));
  // Every prompt has a token: a max_new_tokens that leaves none is refused before tokenizing.
  HMOE_RETURN_IF_ERROR(
      CheckFitsContext("max_new_tokens", 1, request.max_new_tokens(), limits.context_length));
  for (int i = 0; i < request.stop_token_ids_size(); ++i) {
    const int32_t t = request.stop_token_ids(i);
    if (t < 0 || t >= limits.vocab_size) {
      return Invalid(absl::StrCat("stop_token_ids[", i, "]"),
                     absl::StrCat("token id ", t, " outside [0, ", limits.vocab_size, ")"));
    }
  }
  if (request.stop_strings_size() > 0 && tokenizer == nullptr) {
    return Invalid("stop_strings", "the router has no tokenizer (start it with --model)");
  }
  for (int i = 0; i < request.stop_strings_size(); ++i) {
    if (request.stop_strings(i).empty()) {
      return Invalid(absl::StrCat("stop_strings[", i, "]"), "empty string");
    }
  }
  if (request.detokenize() && tokenizer == nullptr) {
    return Invalid("detokenize", "the router has no tokenizer (start it with --model)");
  }
  if (!hmoe::v1::PathHint_IsValid(request.path_hint())) {
    return Invalid("path_hint", absl::StrCat("unknown value ", request.path_hint()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> ResolvePrompt(const hmoe::v1::GenerateRequest& request,
                                                   const ModelLimits& limits,
                                                   const Tokenizer* tokenizer) {
  std::vector<int32_t> ids;
  absl::string_view field = "prompt_token_ids";
  if (request.prompt_case() == hmoe::v1::GenerateRequest::kPromptText) {
    field = "prompt_text";
    if (tokenizer == nullptr) {
      return Invalid(field, "the router has no tokenizer (start it with --model)");
    }
    // Encoding stops once the prompt cannot fit (issue 16): an over-long text costs no BPE.
    const int64_t room =
        limits.context_length > 0
            ? std::max<int64_t>(0, int64_t{limits.context_length} - request.max_new_tokens())
            : INT64_MAX;
    std::optional<std::vector<int32_t>> encoded = tokenizer->EncodeWithin(
        request.prompt_text(), tokenizer->add_bos_token(), /*parse_special=*/false, room);
    if (!encoded.has_value()) {
      return Invalid(field,
                     absl::StrCat("prompt longer than ", room, " tokens: with max_new_tokens (",
                                  request.max_new_tokens(), ") it exceeds the context length ",
                                  limits.context_length));
    }
    ids = *std::move(encoded);
  } else {
    ids.assign(request.prompt_token_ids().ids().begin(), request.prompt_token_ids().ids().end());
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= limits.vocab_size) {
        return Invalid(absl::StrCat("prompt_token_ids[", i, "]"),
                       absl::StrCat("token id ", ids[i], " outside [0, ", limits.vocab_size, ")"));
      }
    }
  }
  if (ids.empty()) return Invalid(field, "empty prompt");
  HMOE_RETURN_IF_ERROR(CheckFitsContext(std::string_view(field.data(), field.size()),
                                        static_cast<int64_t>(ids.size()), request.max_new_tokens(),
                                        limits.context_length));
  return ids;
}

absl::Status ValidateListenAddress(const std::string& address) {
  const auto bad = [&address](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("--listen \"", address, "\": ", why,
                     " (want HOST:PORT, e.g. 127.0.0.1:50051, or unix:/absolute/path)"));
  };
  if (absl::StartsWith(address, "unix:")) {
    if (address.size() <= 5 || address[5] != '/')
      return bad("the unix socket path is not absolute");
    return absl::OkStatus();
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return bad("no port");
  const absl::string_view host = absl::string_view(address).substr(0, colon);
  const absl::string_view port = absl::string_view(address).substr(colon + 1);
  if (host.empty()) return bad("no host");
  if (host.front() == '[' ? host.back() != ']' || host.size() < 3
                          : host.find(':') != absl::string_view::npos) {
    return bad("an IPv6 host must be in brackets, e.g. [::1]:50051");
  }
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return bad("the port is not a number");
  }
  int value = 0;
  if (!absl::SimpleAtoi(port, &value) || value > 65535) return bad("the port is above 65535");
  return absl::OkStatus();
}

absl::StatusOr<int> ResolveHeartbeatIntervalMs(int timeout_ms, int interval_ms) {
  if (timeout_ms < 2 || interval_ms < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--heartbeat_timeout_ms must be >= 2 and --heartbeat_interval_ms >= 0 (got ",
                     timeout_ms, " and ", interval_ms, ")"));
  }
  if (interval_ms == 0) return std::max(1, std::min(1000, timeout_ms / 3));
  if (int64_t{timeout_ms} < 2 * int64_t{interval_ms}) {  // no int overflow (found by fuzzing)
    return absl::InvalidArgumentError(
        absl::StrCat("--heartbeat_timeout_ms (", timeout_ms,
                     ") must be at least twice --heartbeat_interval_ms (", interval_ms,
                     "): otherwise live workers show as DEAD between their heartbeats"));
  }
  return interval_ms;
}

}  // namespace hmoe::router
