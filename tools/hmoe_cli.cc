// hmoe: command-line client of hmoe-router (proto/hmoe_v1.proto), and the node deployment writer.
//   hmoe generate --addr 127.0.0.1:50051 --prompt "Hello" --max-new-tokens 32
//   hmoe generate --addr ... --prompt-ids 1,2,3 --max-new-tokens 8
//   hmoe status --addr ...
//   hmoe health --addr ... [--service NAME] [--wait-s S]
//   hmoe load --addr ... --duration-s 60 --concurrency 4 --log requests.tsv   (scripts/soak.sh)
//   hmoe deploy --model DIR --out DIR [--gpus N] [--prefill-workers N] [--listen ADDR] ...
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
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include <grpcpp/grpcpp.h>

#include "common/base/flags.h"
#include "proto/health.grpc.pb.h"
#include "proto/hmoe_v1.grpc.pb.h"
#include "tools/deploy_config.h"

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

const char* CodeName(grpc::StatusCode code) {
  static constexpr const char* kNames[] = {"OK",
                                           "CANCELLED",
                                           "UNKNOWN",
                                           "INVALID_ARGUMENT",
                                           "DEADLINE_EXCEEDED",
                                           "NOT_FOUND",
                                           "ALREADY_EXISTS",
                                           "PERMISSION_DENIED",
                                           "RESOURCE_EXHAUSTED",
                                           "FAILED_PRECONDITION",
                                           "ABORTED",
                                           "OUT_OF_RANGE",
                                           "UNIMPLEMENTED",
                                           "INTERNAL",
                                           "UNAVAILABLE",
                                           "DATA_LOSS",
                                           "UNAUTHENTICATED"};
  const int i = static_cast<int>(code);
  return i >= 0 && i < static_cast<int>(std::size(kNames)) ? kNames[i] : "?";
}

int Fail(const std::string& what, const grpc::Status& s) {
  std::cerr << what << ": " << CodeName(s.error_code()) << ": " << s.error_message() << "\n";
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
            << (written->http_listen.empty() ? "" : " and http://" + written->http_listen) << ")\n"
            << "  start:   supervisord -c " << conf << "\n"
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
  req.set_detokenize(info.has_tokenizer());
  req.set_request_id(absl::GetFlag(FLAGS_request_id));
  req.set_max_new_tokens(absl::GetFlag(FLAGS_max_new_tokens));
  req.set_ignore_eos(absl::GetFlag(FLAGS_ignore_eos));
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
      "finish %s, %d prompt + %d generated tokens, path %s (%d attempt%s), queue %.1f ms, "
      "TTFT %.1f ms, TPOT %.1f ms, total %.1f ms\n",
      v1::FinishReason_Name(finished.reason()).substr(14), finished.usage().prompt_tokens(),
      finished.usage().completion_tokens(), v1::Path_Name(t.path()).substr(5), t.attempts(),
      t.attempts() == 1 ? "" : "s", t.queue_us() / 1e3, t.ttft_us() / 1e3, t.tpot_us() / 1e3,
      t.total_us() / 1e3);
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
  const std::string code = CodeName(s.error_code());
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
      "hmoe generate|status|health|load --addr HOST:PORT [--prompt TEXT | --prompt-ids 1,2,3] "
      "[--max-new-tokens N]\n       hmoe deploy --model DIR --out DIR [--gpus N] "
      "[--prefill-workers N]");
  std::vector<char*> rest = absl::ParseCommandLine(static_cast<int>(fixed.size()), fixed.data());
  if (rest.size() != 2) {
    std::cerr << "usage: hmoe generate|status|health|load|deploy [flags] (--help for flags)\n";
    return 2;
  }
  const std::string command = rest[1];
  if (command == "deploy") return Deploy(argv[0]);
  auto channel = grpc::CreateChannel(absl::GetFlag(FLAGS_addr), grpc::InsecureChannelCredentials());
  auto stub = v1::Hmoe::NewStub(channel);
  if (command == "generate") return Generate(stub.get());
  if (command == "status") return Status(stub.get());
  if (command == "health") return Health(channel);
  if (command == "load") return Load(stub.get());
  std::cerr << "unknown command " << command << "; use generate, status, health, load or deploy\n";
  return 2;
}
