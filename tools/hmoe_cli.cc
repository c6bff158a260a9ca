// hmoe: command-line client of hmoe-router (proto/hmoe_v1.proto), and the node deployment writer.
//   hmoe generate --addr 127.0.0.1:50051 --prompt "Hello" --max-new-tokens 32
//   hmoe generate --addr ... --prompt-ids 1,2,3 --max-new-tokens 8
//   hmoe status --addr ...
//   hmoe health --addr ... [--service NAME] [--wait-s S]
//   hmoe load --addr ... --duration-s 60 --concurrency 4 --log requests.tsv   (scripts/soak.sh)
//   hmoe deploy --model DIR --out DIR [--gpus N] [--prefill-workers N] [--listen ADDR] ...
//       [--calibration FILE]   (the router thresholds `hmoe calibrate` wrote)
//   hmoe http-bench --addr ... --http-addr 127.0.0.1:8000 --samples 200 --streams 64
//       (scripts/http_bench.sh: TTFT over HTTP vs gRPC, concurrent SSE streams)
//   hmoe bench --addr ... [--rate R | --arrival closed --concurrency C] [--scenario all] --json F
//       [--protocol http --http-addr HOST:PORT]   (docs/bench.md; the command lives in
//       tools/bench/)
//   hmoe calibrate --addr ... --calibration node.json [--lengths 64,128,...] [--batch-sizes 1,2,4]
//     (docs/bench.md "Calibration"; then hmoe deploy ... --calibration node.json)
// Flags accept dashes or underscores. `generate` streams tokens (text when the router has a
// tokenizer) to stdout, then prints the finish reason, usage and timing (queue, TTFT, TPOT, path)
// on stderr. `health` works against any gRPC server with the standard health service (router,
// workers, weightd: --addr unix:/path.sock); with --wait-s it polls until SERVING. `deploy`
// writes a supervisord configuration for this node (tools/deploy_config.h, deploy/README.md).
// Exit code: 0 on success, 1 on an RPC error (its status is printed), 2 on bad usage.

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include <grpcpp/grpcpp.h>

#include "common/base/flags.h"
#include "common/rpc/grpc_status.h"
#include "proto/health.grpc.pb.h"
#include "proto/hmoe_v1.grpc.pb.h"
#include "tools/bench/bench_command.h"
#include "tools/bench/calibrate_command.h"
#include "tools/bench/calibration.h"
#include "tools/bench/http_client.h"
#include "tools/deploy_config.h"

#include <nlohmann/json.hpp>

ABSL_FLAG(std::string, addr, "127.0.0.1:50051", "router address");
ABSL_FLAG(std::string, prompt, "", "prompt text (needs a router started with --model)");
ABSL_FLAG(std::string, prompt_ids, "", "prompt token ids, comma-separated");
ABSL_FLAG(int, max_new_tokens, 32, "tokens to generate at most");
ABSL_FLAG(double, temperature, 0, "0: greedy");
ABSL_FLAG(int, top_k, 0, "0: off");
ABSL_FLAG(double, top_p, 0, "0: off");
ABSL_FLAG(double, min_p, 0, "0: off");
ABSL_FLAG(double, repetition_penalty, 0, "0: off");
ABSL_FLAG(double, presence_penalty, 0, "0: off");
ABSL_FLAG(uint64_t, seed, 0, "sampling seed");
ABSL_FLAG(std::vector<std::string>, stop, {}, "stop strings, comma-separated");
ABSL_FLAG(std::string, hint, "auto", "path hint: auto, chunked, slp or dslp");
ABSL_FLAG(std::string, request_id, "", "request id (default: the router picks one)");
ABSL_FLAG(bool, ignore_eos, false, "do not stop at EOS");
ABSL_FLAG(bool, cache_prompt, true,
          "generate: reuse the decode worker's prefix cache (false: prefill the whole prompt)");
ABSL_FLAG(bool, token_ids, false,
          "print the generated token ids (space-separated) instead of text, also when the router "
          "has a tokenizer (to compare with hmoe-generate)");
ABSL_FLAG(double, timeout_s, 300, "deadline of the call");
ABSL_FLAG(std::string, service, "", "health: the service to check (\"\": the server as a whole)");
ABSL_FLAG(double, wait_s, 0, "health: poll until SERVING for up to this long (0: check once)");
// deploy
ABSL_FLAG(std::string, model, "", "deploy: checkpoint directory or GGUF file (*.gguf)");
ABSL_FLAG(std::string, out, "", "deploy: directory for supervisord.conf (run/ and logs/ inside)");
ABSL_FLAG(std::string, run_dir, "", "deploy: sockets directory (default <out>/run; made 0700)");
ABSL_FLAG(std::string, log_dir, "", "deploy: logs directory (default <out>/logs)");
ABSL_FLAG(int, gpus, 0, "deploy: GPUs of the node (0: CPU only)");
ABSL_FLAG(int, prefill_workers, -1,
          "deploy: prefill workers (-1: one per GPU; one CPU worker without GPUs when the "
          "hmoe-prefill-worker binary exists)");
ABSL_FLAG(std::string, instance, "hmoe", "deploy: weightd instance name");
ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "deploy: the router's public address");
ABSL_FLAG(std::string, http_listen, "127.0.0.1:8000",
          "deploy: the router's OpenAI-compatible HTTP address (empty: off)");
ABSL_FLAG(std::string, bin_dir, "",
          "deploy: where the executables are (a bin directory or a CMake build tree; default: "
          "next to this hmoe)");
ABSL_FLAG(int, drain_seconds, 30, "deploy: drain time of each process on SIGTERM");
ABSL_FLAG(std::string, weightd_args, "", "deploy: extra hmoe-weightd flags (space-separated)");
ABSL_FLAG(std::string, prefill_args, "", "deploy: extra hmoe-prefill-worker flags");
ABSL_FLAG(std::string, decode_args, "", "deploy: extra hmoe-decode-worker flags");
ABSL_FLAG(std::string, router_args, "", "deploy: extra hmoe-router flags");
ABSL_FLAG(std::string, calibration, "",
          "calibrate: the calibration file to write; deploy: a file `hmoe calibrate` wrote, whose "
          "thresholds go to the router (--chunk-threshold, --decode-idle-window-s)");
ABSL_FLAG(std::string, dslp_ep_mode, "",
          "deploy: DSLP expert parallelism across the prefill workers: standard or small_ep "
          "(default: the workers' default, small_ep)");
// load
ABSL_FLAG(double, duration_s, 60, "load: send new requests for this long");
ABSL_FLAG(int, concurrency, 4, "load: client threads, each with one request in flight");
ABSL_FLAG(std::string, log, "", "load: append one tab-separated line per request to this file");
ABSL_FLAG(double, burst_every_s, 30, "load: a burst every this many seconds (0: none)");
ABSL_FLAG(int, burst_size, 100, "load: requests sent at once in a burst");
ABSL_FLAG(int, long_tokens, 600, "load: long prompts have half to all of this many tokens");
// http-bench
ABSL_FLAG(std::string, http_addr, "127.0.0.1:8000",
          "http-bench, bench --protocol http: the router's HTTP address (its --http-listen)");
ABSL_FLAG(int, samples, 200, "http-bench: sequential requests per protocol for the TTFT figures");
ABSL_FLAG(int, streams, 64, "http-bench: concurrent SSE streams (0: skip)");
ABSL_FLAG(int, stream_tokens, 32, "http-bench: max_tokens of each concurrent stream");
ABSL_FLAG(int, cpus, 0,
          "deploy: CPU cores shared by two or more CPU prefill workers (0: this machine's)");

namespace {

namespace v1 = hmoe::v1;

std::unique_ptr<grpc::ClientContext> Context() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(
      absl::ToChronoTime(absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_timeout_s))));
  return ctx;
}

int Fail(const std::string& what, const grpc::Status& s) {
  std::cerr << what << ": " << hmoe::rpc::GrpcCodeName(s.error_code()) << ": " << s.error_message()
            << "\n";
  return 1;
}

int Health(const std::shared_ptr<grpc::Channel>& channel) {
  using grpc::health::v1::HealthCheckResponse;
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(absl::GetFlag(FLAGS_service));
  const absl::Time until = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_wait_s));
  while (true) {
    HealthCheckResponse resp;
    grpc::ClientContext ctx;
    // A short deadline per check when waiting, so a server that is not up yet is retried.
    const absl::Duration per_call = absl::GetFlag(FLAGS_wait_s) > 0
                                        ? absl::Seconds(2)
                                        : absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + per_call));
    const grpc::Status s = stub->Check(&ctx, req, &resp);
    const bool serving = s.ok() && resp.status() == HealthCheckResponse::SERVING;
    if (serving || absl::Now() >= until) {
      if (!s.ok()) return Fail("health", s);
      std::cout << HealthCheckResponse::ServingStatus_Name(resp.status()) << "\n";
      return serving ? 0 : 1;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
}

std::vector<std::string> SplitArgs(const std::string& flag) {
  return absl::StrSplit(flag, absl::ByAnyChar(" \t"), absl::SkipEmpty());
}

int Deploy(const char* argv0) {
  hmoe::deploy::DeployOptions o;
  o.model_dir = absl::GetFlag(FLAGS_model);
  o.out_dir = absl::GetFlag(FLAGS_out);
  if (o.model_dir.empty() || o.out_dir.empty()) {
    std::cerr << "deploy: --model DIR and --out DIR are required\n";
    return 2;
  }
  o.run_dir = absl::GetFlag(FLAGS_run_dir);
  o.log_dir = absl::GetFlag(FLAGS_log_dir);
  o.gpus = absl::GetFlag(FLAGS_gpus);
  o.prefill_workers = absl::GetFlag(FLAGS_prefill_workers);
  o.instance = absl::GetFlag(FLAGS_instance);
  o.listen = absl::GetFlag(FLAGS_listen);
  o.http_listen = absl::GetFlag(FLAGS_http_listen);
  o.drain_seconds = absl::GetFlag(FLAGS_drain_seconds);
  o.weightd_args = SplitArgs(absl::GetFlag(FLAGS_weightd_args));
  o.prefill_args = SplitArgs(absl::GetFlag(FLAGS_prefill_args));
  o.decode_args = SplitArgs(absl::GetFlag(FLAGS_decode_args));
  o.router_args = SplitArgs(absl::GetFlag(FLAGS_router_args));
  o.dslp_ep_mode = absl::GetFlag(FLAGS_dslp_ep_mode);
  o.cpus = absl::GetFlag(FLAGS_cpus);
  if (const std::string file = absl::GetFlag(FLAGS_calibration); !file.empty()) {
    const absl::StatusOr<hmoe::bench::RouterThresholds> t = hmoe::bench::ReadCalibrationFile(file);
    if (!t.ok()) {
      std::cerr << "deploy: --calibration: " << t.status().message() << "\n";
      return 2;
    }
    o.chunk_threshold = t->chunk_threshold_tokens;
    o.decode_idle_window_s = t->decode_idle_window_s;
  }
  std::vector<std::string> search;
  if (!absl::GetFlag(FLAGS_bin_dir).empty()) {
    search.push_back(absl::GetFlag(FLAGS_bin_dir));
  } else {
    std::error_code ec;
    std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (ec) self = argv0;
    search.push_back(self.parent_path().string());
  }
  o.bin = hmoe::deploy::FindBinaries(search);
  absl::StatusOr<hmoe::deploy::DeployOptions> written = hmoe::deploy::WriteDeployment(o);
  if (!written.ok()) {
    std::cerr << "deploy: " << written.status().message() << "\n";
    return absl::IsInvalidArgument(written.status()) ? 2 : 1;
  }
  const std::string conf = written->out_dir + "/supervisord.conf";
  std::cout << "wrote " << conf << " (weightd, " << written->prefill_workers
            << " prefill worker(s), decode worker, router on " << written->listen
            << (written->http_listen.empty() ? "" : " and http://" + written->http_listen) << ")\n";
  if (written->chunk_threshold > 0) {
    std::cout << "  router thresholds from " << absl::GetFlag(FLAGS_calibration)
              << ": --chunk-threshold=" << written->chunk_threshold
              << " --decode-idle-window-s=" << written->decode_idle_window_s << "\n";
  }
  std::cout << "  start:   supervisord -c " << conf << "\n"
            << "  status:  supervisorctl -c " << conf << " status\n"
            << "  stop:    supervisorctl -c " << conf << " shutdown\n"
            << "  logs:    " << written->log_dir << "/\n";
  return 0;
}

int Status(v1::Hmoe::Stub* stub) {
  v1::ModelInfo info;
  grpc::Status s = stub->GetModelInfo(Context().get(), {}, &info);
  if (!s.ok()) return Fail("GetModelInfo", s);
  v1::RouterStatus st;
  s = stub->GetStatus(Context().get(), {}, &st);
  if (!s.ok()) return Fail("GetStatus", s);
  std::cout << absl::StrFormat(
      "model %s: vocab %d, context %d, tokenizer %s, chunk threshold %d\n"
      "requests: %d in flight (max %d), %d total, %d rejected, %d failed\n",
      info.model().empty() ? "(token ids only)" : info.model(), info.vocab_size(),
      info.context_length(), info.has_tokenizer() ? "yes" : "no", info.chunk_threshold_tokens(),
      st.inflight(), st.max_inflight(), st.requests_total(), st.requests_rejected(),
      st.requests_failed());
  for (const v1::WorkerInfo& w : st.workers()) {
    std::cout << absl::StrFormat(
        "  %-16s %-8s %-9s %-8s inc %d  running %d/%d waiting %d  kv %d/%d  %.1f tok/s  "
        "heartbeat %d ms ago  %s\n",
        w.worker_id(), v1::WorkerKind_Name(w.kind()).substr(12),
        v1::WorkerState_Name(w.state()).substr(13), w.device(), w.incarnation(), w.running(),
        w.batch_size(), w.waiting(), w.kv_blocks_free(), w.kv_blocks_total(), w.tokens_per_second(),
        w.ms_since_heartbeat(), w.endpoint());
  }
  return 0;
}

int Generate(v1::Hmoe::Stub* stub) {
  v1::GenerateRequest req;
  const std::string prompt = absl::GetFlag(FLAGS_prompt);
  const std::string prompt_ids = absl::GetFlag(FLAGS_prompt_ids);
  if (prompt.empty() == prompt_ids.empty()) {
    std::cerr << "give exactly one of --prompt or --prompt-ids\n";
    return 2;
  }
  if (!prompt.empty()) {
    req.set_prompt_text(prompt);
  } else {
    for (absl::string_view part : absl::StrSplit(prompt_ids, ',', absl::SkipWhitespace())) {
      int32_t id = 0;
      if (!absl::SimpleAtoi(part, &id)) {
        std::cerr << "--prompt-ids: not an integer: " << part << "\n";
        return 2;
      }
      req.mutable_prompt_token_ids()->add_ids(id);
    }
  }
  v1::ModelInfo info;
  grpc::Status s = stub->GetModelInfo(Context().get(), {}, &info);
  if (!s.ok()) return Fail("GetModelInfo", s);
  req.set_detokenize(info.has_tokenizer() && !absl::GetFlag(FLAGS_token_ids));
  req.set_request_id(absl::GetFlag(FLAGS_request_id));
  req.set_max_new_tokens(absl::GetFlag(FLAGS_max_new_tokens));
  req.set_ignore_eos(absl::GetFlag(FLAGS_ignore_eos));
  req.set_cache_prompt(absl::GetFlag(FLAGS_cache_prompt));
  v1::SamplingParams* sp = req.mutable_sampling();
  sp->set_temperature(static_cast<float>(absl::GetFlag(FLAGS_temperature)));
  sp->set_top_k(absl::GetFlag(FLAGS_top_k));
  sp->set_top_p(static_cast<float>(absl::GetFlag(FLAGS_top_p)));
  sp->set_min_p(static_cast<float>(absl::GetFlag(FLAGS_min_p)));
  sp->set_repetition_penalty(static_cast<float>(absl::GetFlag(FLAGS_repetition_penalty)));
  sp->set_presence_penalty(static_cast<float>(absl::GetFlag(FLAGS_presence_penalty)));
  sp->set_seed(absl::GetFlag(FLAGS_seed));
  for (const std::string& stop : absl::GetFlag(FLAGS_stop)) req.add_stop_strings(stop);
  const std::string hint = absl::GetFlag(FLAGS_hint);
  if (hint == "auto") {
    req.set_path_hint(v1::PATH_HINT_AUTO);
  } else if (hint == "chunked") {
    req.set_path_hint(v1::PATH_HINT_CHUNKED);
  } else if (hint == "slp") {
    req.set_path_hint(v1::PATH_HINT_SLP);
  } else if (hint == "dslp") {
    req.set_path_hint(v1::PATH_HINT_DSLP);
  } else {
    std::cerr << "--hint: auto, chunked, slp or dslp\n";
    return 2;
  }

  auto ctx = Context();
  auto reader = stub->Generate(ctx.get(), req);
  v1::GenerateResponse r;
  v1::Finished finished;
  int tokens = 0;
  while (reader->Read(&r)) {
    if (r.has_token()) {
      ++tokens;
      if (req.detokenize()) {
        std::cout << r.token().text();
      } else {
        std::cout << (tokens > 1 ? " " : "") << r.token().token_id();
      }
      std::cout.flush();
    } else if (r.has_finished()) {
      finished = r.finished();
      std::cout << finished.text();
    }
  }
  std::cout << "\n";
  s = reader->Finish();
  if (!s.ok()) return Fail("generate", s);
  const v1::Timing& t = finished.timing();
  std::cerr << absl::StrFormat(
      "finish %s, %d prompt (%d cached) + %d generated tokens, path %s (%d attempt%s), queue "
      "%.1f ms, TTFT %.1f ms, TPOT %.1f ms, total %.1f ms\n",
      v1::FinishReason_Name(finished.reason()).substr(14), finished.usage().prompt_tokens(),
      finished.usage().cached_prompt_tokens(), finished.usage().completion_tokens(),
      v1::Path_Name(t.path()).substr(5), t.attempts(), t.attempts() == 1 ? "" : "s",
      t.queue_us() / 1e3, t.ttft_us() / 1e3, t.tpot_us() / 1e3, t.total_us() / 1e3);
  return 0;
}

// --- hmoe load: a bounded mixed load for the chaos soak (scripts/soak.sh, docs/soak.md).
// Client threads loop over request kinds (short prompts, long prompts past the router's chunk
// threshold, streams the client cancels after the first token, tight client deadlines) until
// --duration-s has passed; every --burst-every-s a burst of --burst-size short requests is sent at
// once, past the stack's capacity. Every request ends as one line of --log:
//   start_ms end_ms kind status attempts worker_ids message        (tab-separated, Unix ms)
// and a summary of kinds x statuses goes to stderr.
struct LoadLog {
  absl::Mutex mu;
  std::FILE* file = nullptr;
  std::map<std::pair<std::string, std::string>, int> counts ABSL_GUARDED_BY(mu);
};

int64_t UnixMs() { return absl::ToUnixMillis(absl::Now()); }

std::string OneLine(std::string s) {
  for (char& c : s) {
    if (c == '\t' || c == '\n' || c == '\r') c = ' ';
  }
  return s;
}

grpc::StatusCode OneRequest(v1::Hmoe::Stub* stub, const v1::ModelInfo& info,
                            const std::string& kind, std::mt19937_64& rng, LoadLog& log) {
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  v1::GenerateRequest req;
  int prompt_len = uniform(4, 16);
  int max_new = 8;
  absl::Duration deadline = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  if (kind == "long") {
    const int longest = std::min(absl::GetFlag(FLAGS_long_tokens), info.context_length() - 8);
    prompt_len = uniform(std::max(longest / 2, 1), std::max(longest, 1));
    max_new = 4;
  } else if (kind == "cancel") {
    max_new = 64;
  } else if (kind == "deadline") {
    deadline = absl::Milliseconds(uniform(1, 150));
  }
  const int top = std::max(info.vocab_size() - 1, 11);
  for (int i = 0; i < prompt_len; ++i) req.mutable_prompt_token_ids()->add_ids(uniform(10, top));
  req.set_max_new_tokens(max_new);
  req.set_ignore_eos(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  const int64_t start = UnixMs();
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse r;
  v1::Finished finished;
  while (reader->Read(&r)) {
    if (r.has_finished()) finished = r.finished();
    if (kind == "cancel" && r.has_token()) ctx.TryCancel();
  }
  const grpc::Status s = reader->Finish();
  const int64_t end = UnixMs();
  const std::string code = hmoe::rpc::GrpcCodeName(s.error_code());
  absl::MutexLock l(&log.mu);
  ++log.counts[{kind, code}];
  absl::FPrintF(log.file, "%d\t%d\t%s\t%s\t%d\t%s\t%s\n", start, end, kind, code,
                finished.timing().attempts(), absl::StrJoin(finished.timing().worker_ids(), ","),
                OneLine(s.error_message()));
  return s.error_code();
}

int Load(v1::Hmoe::Stub* stub) {
  const std::string path = absl::GetFlag(FLAGS_log);
  if (path.empty()) {
    std::cerr << "load: --log FILE is required\n";
    return 2;
  }
  v1::ModelInfo info;
  grpc::Status s = stub->GetModelInfo(Context().get(), {}, &info);
  if (!s.ok()) return Fail("GetModelInfo", s);
  LoadLog log;
  log.file = std::fopen(path.c_str(), "a");
  if (log.file == nullptr) {
    std::cerr << "load: cannot open " << path << ": " << std::strerror(errno) << "\n";
    return 1;
  }
  std::setvbuf(log.file, nullptr, _IOLBF, 0);
  const absl::Time until = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_duration_s));
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  std::vector<std::thread> threads;
  for (int t = 0; t < absl::GetFlag(FLAGS_concurrency); ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed * 1000 + t);
      // short 50 %, long 15 %, cancel 20 %, deadline 15 %.
      std::discrete_distribution<int> pick({50, 15, 20, 15});
      static constexpr const char* kKinds[] = {"short", "long", "cancel", "deadline"};
      while (absl::Now() < until) {
        // A client told to retry later does so after a pause rather than at once.
        if (OneRequest(stub, info, kKinds[pick(rng)], rng, log) == grpc::RESOURCE_EXHAUSTED) {
          absl::SleepFor(absl::Milliseconds(100));
        }
      }
    });
  }
  const double every = absl::GetFlag(FLAGS_burst_every_s);
  if (every > 0) {
    threads.emplace_back([&] {
      std::mt19937_64 rng(seed * 1000 + 999);
      for (absl::Time next = absl::Now() + absl::Seconds(every); next < until;
           next += absl::Seconds(every)) {
        absl::SleepFor(next - absl::Now());
        std::vector<std::thread> burst;
        for (int i = 0; i < absl::GetFlag(FLAGS_burst_size); ++i) {
          burst.emplace_back([&, i] {
            std::mt19937_64 own(rng() + i);
            OneRequest(stub, info, "burst", own, log);
          });
        }
        for (std::thread& b : burst) b.join();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  std::fclose(log.file);
  absl::MutexLock l(&log.mu);
  int total = 0;
  for (const auto& [key, n] : log.counts) {
    std::cerr << absl::StrFormat("%-9s %-20s %d\n", key.first, key.second, n);
    total += n;
  }
  std::cerr << "load: " << total << " requests\n";
  return 0;
}

// --- hmoe http-bench: the OpenAI HTTP API against the gRPC API on the same router
// (scripts/http_bench.sh, docs/PERFORMANCE.md "HTTP vs gRPC"). Both clients live here, so their
// overheads are alike: one persistent connection each (a gRPC channel; HTTP/1.1 keep-alive through
// Boost.Beast), the same random token-id prompts, requests one at a time, HTTP and gRPC
// alternating (which goes first flips every pair, so drift and warm caches cancel). TTFT is the
// time from sending the request to receiving the first token with text: the first SSE event of
// /v1/completions (the router emits one only for non-empty text) and the first Token message with
// non-empty text of Generate (detokenize on, as the HTTP API sets it); when no token has text
// (the detokenizer holds an incomplete character to the end), the end of the stream in both. Then
// --streams concurrent SSE streams, each on its own connection, all released at once; every one
// must end with [DONE] after a finish reason.
struct StreamResult {
  std::string error;  // empty: the stream ended with a finish reason and [DONE]
  double ttft_ms = -1;
  int completion_tokens = 0;
};

// One keep-alive connection (tools/bench/http_client.h) and the checks of http-bench's streams.
class SseClient {
 public:
  absl::Status Connect(const std::string& host_port) { return http_.Connect(host_port); }

  // POSTs `body` (a streaming request) to `path` and reads the event stream to its end.
  StreamResult Stream(const std::string& path, const std::string& body) {
    StreamResult result;
    bool finished = false, done = false;
    absl::Time t0;
    auto on_data = [&](absl::string_view payload) {
      const absl::Time now = absl::Now();
      if (payload == "[DONE]") {
        done = true;
        return;
      }
      const nlohmann::json j = nlohmann::json::parse(payload, nullptr, false);
      if (j.is_discarded() || j.contains("error")) {
        result.error = std::string(payload);
        return;
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        result.completion_tokens = j["usage"].value("completion_tokens", 0);
      }
      if (!j.contains("choices") || !j["choices"].is_array() || j["choices"].empty()) return;
      const nlohmann::json& choice = j["choices"][0];
      // The first event: text, or the end when no token had text.
      if (result.ttft_ms < 0) result.ttft_ms = absl::ToDoubleMilliseconds(now - t0);
      if (choice.contains("finish_reason") && choice["finish_reason"].is_string()) {
        finished = true;
      }
    };
    const hmoe::bench::HttpResponse r = http_.Post(path, body, on_data, [&] { t0 = absl::Now(); });
    if (!r.transport_error.empty()) {
      result.error = absl::StrCat("HTTP: ", r.transport_error);
    } else if (r.status != 200) {
      result.error = absl::StrCat("HTTP ", r.status, ": ", r.body);
    } else if (result.error.empty() && !(finished && done)) {
      result.error = "the stream ended without a finish reason and [DONE]";
    }
    return result;
  }

 private:
  hmoe::bench::HttpClient http_;
};

std::string CompletionBody(const std::vector<int32_t>& ids, int max_tokens) {
  return nlohmann::json{{"prompt", ids},    {"max_tokens", max_tokens},
                        {"temperature", 0}, {"ignore_eos", true},
                        {"stream", true},   {"stream_options", {{"include_usage", true}}}}
      .dump();
}

// TTFT of one Generate call in ms (first Token with text), or an error.
absl::StatusOr<double> GrpcTtft(v1::Hmoe::Stub* stub, const std::vector<int32_t>& ids,
                                int max_tokens) {
  v1::GenerateRequest req;
  for (int32_t id : ids) req.mutable_prompt_token_ids()->add_ids(id);
  req.set_max_new_tokens(max_tokens);
  req.set_ignore_eos(true);
  req.set_detokenize(true);
  auto ctx = Context();
  double ttft = -1;
  const absl::Time t0 = absl::Now();
  auto reader = stub->Generate(ctx.get(), req);
  v1::GenerateResponse r;
  while (reader->Read(&r)) {
    // As the HTTP API's first event: a token with text, or the end when no token had any.
    if (ttft < 0 && ((r.has_token() && !r.token().text().empty()) || r.has_finished())) {
      ttft = absl::ToDoubleMilliseconds(absl::Now() - t0);
    }
  }
  const grpc::Status s = reader->Finish();
  if (!s.ok()) {
    return absl::UnknownError(absl::StrCat("generate: ", hmoe::rpc::GrpcCodeName(s.error_code()),
                                           ": ", s.error_message()));
  }
  if (ttft < 0) return absl::UnknownError("generate: no token and no Finished message");
  return ttft;
}

double Percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

int HttpBench(v1::Hmoe::Stub* stub) {
  v1::ModelInfo info;
  grpc::Status s = stub->GetModelInfo(Context().get(), {}, &info);
  if (!s.ok()) return Fail("GetModelInfo", s);
  if (!info.has_tokenizer()) {
    std::cerr << "http-bench: the router has no tokenizer (start it with --model)\n";
    return 2;
  }
  const std::string http_addr = absl::GetFlag(FLAGS_http_addr);
  const int samples = absl::GetFlag(FLAGS_samples);
  const int max_new = std::max(1, absl::GetFlag(FLAGS_max_new_tokens));
  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  const int top = std::max(info.vocab_size() - 1, 11);
  auto prompt = [&] {
    std::vector<int32_t> ids(std::uniform_int_distribution<int>(8, 16)(rng));
    for (int32_t& id : ids) id = std::uniform_int_distribution<int>(10, top)(rng);
    return ids;
  };
  SseClient http;
  if (absl::Status c = http.Connect(http_addr); !c.ok()) {
    std::cerr << "http-bench: " << c.message() << "\n";
    return 1;
  }
  std::vector<double> http_ms, grpc_ms, diff_ms;
  // Two warm-up pairs (connections, first-request allocations), not counted.
  for (int i = -2; i < samples; ++i) {
    const std::vector<int32_t> ids = prompt();
    double h = -1, g = -1;
    for (int k = 0; k < 2; ++k) {
      if ((k == 0) == (i % 2 == 0)) {
        StreamResult r = http.Stream("/v1/completions", CompletionBody(ids, max_new));
        if (!r.error.empty() || r.ttft_ms < 0) {
          std::cerr << "http-bench: HTTP request " << i << ": " << r.error << "\n";
          return 1;
        }
        h = r.ttft_ms;
      } else {
        absl::StatusOr<double> t = GrpcTtft(stub, ids, max_new);
        if (!t.ok()) {
          std::cerr << "http-bench: gRPC request " << i << ": " << t.status().message() << "\n";
          return 1;
        }
        g = *t;
      }
    }
    if (i < 0) continue;
    http_ms.push_back(h);
    grpc_ms.push_back(g);
    diff_ms.push_back(h - g);
  }
  if (samples > 0) {
    std::cout << absl::StrFormat(
        "ttft over %d interleaved pairs (%d new tokens, prompts of 8-16 ids):\n"
        "  http  p10 %.3f ms  p50 %.3f ms  p90 %.3f ms\n"
        "  grpc  p10 %.3f ms  p50 %.3f ms  p90 %.3f ms\n"
        "  http - grpc: p50 of the differences %.3f ms, difference of the p50s %.3f ms, "
        "of the p10s %.3f ms\n",
        samples, max_new, Percentile(http_ms, 0.1), Percentile(http_ms, 0.5),
        Percentile(http_ms, 0.9), Percentile(grpc_ms, 0.1), Percentile(grpc_ms, 0.5),
        Percentile(grpc_ms, 0.9), Percentile(diff_ms, 0.5),
        Percentile(http_ms, 0.5) - Percentile(grpc_ms, 0.5),
        Percentile(http_ms, 0.1) - Percentile(grpc_ms, 0.1));
  }
  const int streams = absl::GetFlag(FLAGS_streams);
  if (streams <= 0) return 0;
  const int stream_tokens = absl::GetFlag(FLAGS_stream_tokens);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < streams; ++i) prompts.push_back(prompt());
  std::vector<StreamResult> results(streams);
  std::vector<std::unique_ptr<SseClient>> clients;
  for (int i = 0; i < streams; ++i) {
    clients.push_back(std::make_unique<SseClient>());
    if (absl::Status c = clients.back()->Connect(http_addr); !c.ok()) {
      std::cerr << "http-bench: stream " << i << ": " << c.message() << "\n";
      return 1;
    }
  }
  absl::Mutex mu;
  bool go = false;
  std::vector<std::thread> threads;
  for (int i = 0; i < streams; ++i) {
    threads.emplace_back([&, i] {
      {
        absl::MutexLock l(&mu);
        mu.Await(absl::Condition(&go));
      }
      results[i] = clients[i]->Stream("/v1/completions", CompletionBody(prompts[i], stream_tokens));
    });
  }
  const absl::Time t0 = absl::Now();
  {
    absl::MutexLock l(&mu);
    go = true;
  }
  for (std::thread& t : threads) t.join();
  const double wall_s = absl::ToDoubleSeconds(absl::Now() - t0);
  int completed = 0, tokens = 0;
  std::vector<double> ttfts;
  for (int i = 0; i < streams; ++i) {
    if (results[i].error.empty()) {
      ++completed;
      tokens += results[i].completion_tokens;
      ttfts.push_back(results[i].ttft_ms);
    } else {
      std::cerr << "stream " << i << ": " << results[i].error << "\n";
    }
  }
  std::cout << absl::StrFormat(
      "%d concurrent SSE streams (max_tokens %d): %d completed, %d errors, %d tokens in %.2f s "
      "(%.1f tokens/s)",
      streams, stream_tokens, completed, streams - completed, tokens, wall_s, tokens / wall_s);
  if (!ttfts.empty()) {
    std::cout << absl::StrFormat(", TTFT p50 %.1f ms max %.1f ms", Percentile(ttfts, 0.5),
                                 Percentile(ttfts, 1.0));
  }
  std::cout << "\n";
  return completed == streams ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Accept --max-new-tokens as well as --max_new_tokens.
  std::vector<std::string> args(argv, argv + argc);
  std::vector<char*> fixed;
  for (std::string& a : args) {
    if (a.rfind("--", 0) == 0) {
      for (size_t i = 2; i < a.size() && a[i] != '='; ++i) {
        if (a[i] == '-') a[i] = '_';
      }
    }
    fixed.push_back(a.data());
  }
  hmoe::SetUsage(
      "hmoe generate|status|health|load|bench|calibrate|http-bench --addr HOST:PORT [--prompt "
      "TEXT | --prompt-ids 1,2,3] [--max-new-tokens N]\n       hmoe deploy --model DIR --out DIR "
      "[--gpus N] [--prefill-workers N] [--calibration FILE]");
  std::vector<char*> rest = absl::ParseCommandLine(static_cast<int>(fixed.size()), fixed.data());
  if (rest.size() != 2) {
    std::cerr << "usage: hmoe generate|status|health|load|bench|calibrate|http-bench|deploy "
                 "[flags] (--help "
                 "for flags)\n";
    return 2;
  }
  const std::string command = rest[1];
  if (command == "deploy") return Deploy(argv[0]);
  if (command == "bench") return hmoe::bench::RunBenchCommand({argv, argv + argc});
  if (command == "calibrate") return hmoe::bench::RunCalibrateCommand({argv, argv + argc});
  auto channel = grpc::CreateChannel(absl::GetFlag(FLAGS_addr), grpc::InsecureChannelCredentials());
  auto stub = v1::Hmoe::NewStub(channel);
  if (command == "generate") return Generate(stub.get());
  if (command == "status") return Status(stub.get());
  if (command == "health") return Health(channel);
  if (command == "load") return Load(stub.get());
  if (command == "http-bench") return HttpBench(stub.get());
  std::cerr << "unknown command " << command
            << "; use generate, status, health, load, bench, calibrate, http-bench or deploy\n";
  return 2;
}
