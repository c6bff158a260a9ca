#pragma once

// Real hmoe-prefill-worker and hmoe-decode-worker processes for the KV hand-off tests
// (prefill_worker_integration_test.cc on the CPU, cuda_handoff_gpu_test.cc on a GPU): start a
// worker and wait until it serves, the prefill worker's client, and an Admit stream consumed the
// way the router consumes it.

#include <dirent.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "common/engine/reference/reference_model.h"
#include "common/model/checkpoint.h"
#include "proto/decode.grpc.pb.h"
#include "proto/health.grpc.pb.h"
#include "proto/prefill.grpc.pb.h"
#include "tests/decode_worker/decode_test_util.h"
#include "tests/integration/child_process.h"

namespace hmoe::prefill::testing {

// Tokens each hand-off test generates (the first from the prefill worker).
inline constexpr int kTokens = 64;

// What the tests of a suite share: a temp dir, the model they serve and its reference.
struct HandOffEnv {
  decode::testing::ScopedTempDir dir;
  std::string model;  // the checkpoint directory, or the .gguf file
  ModelConfig config;
  std::unique_ptr<Checkpoint> checkpoint;  // null for a GGUF
  std::unique_ptr<reference::ReferenceModel> reference;
};

// A temp dir holding model preset `preset` (written there) and its reference forward pass; null
// (with a test failure) when any step fails. "<preset>-gguf" writes the preset as a Q4_K_M GGUF
// (hmoe-make-model --format gguf --quant q4_k_m) and takes the FP32 reference on its dequantized
// weights (issue 18).
inline std::unique_ptr<HandOffEnv> MakeHandOffEnv(const std::string& preset) {
  auto env = std::make_unique<HandOffEnv>();
  if (env->dir.path().empty()) {
    ADD_FAILURE() << "no temp dir";
    return nullptr;
  }
  if (preset.ends_with("-gguf")) {
    absl::StatusOr<std::string> path = decode::testing::WriteGgufPreset(
        preset.substr(0, preset.size() - 5), env->dir.File(preset));
    if (!path.ok()) {
      ADD_FAILURE() << "write " << preset << ": " << path.status();
      return nullptr;
    }
    env->model = *path;
    absl::StatusOr<decode::testing::GgufReference> ref =
        decode::testing::MakeGgufReference(env->model);
    if (!ref.ok()) {
      ADD_FAILURE() << ref.status();
      return nullptr;
    }
    env->config = ref->config;
    env->reference = std::move(ref->model);
    return env;
  }
  env->model = env->dir.File(preset);
  if (absl::Status s = decode::testing::WritePreset(preset, env->model); !s.ok()) {
    ADD_FAILURE() << "write " << preset << ": " << s;
    return nullptr;
  }
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(env->model);
  if (!ckpt.ok()) {
    ADD_FAILURE() << ckpt.status();
    return nullptr;
  }
  env->checkpoint = *std::move(ckpt);
  env->config = env->checkpoint->config();
  auto ref = reference::ReferenceModel::Create(env->checkpoint->config(), *env->checkpoint);
  if (!ref.ok()) {
    ADD_FAILURE() << ref.status();
    return nullptr;
  }
  env->reference = *std::move(ref);
  return env;
}

inline std::vector<int32_t> Prompt(int n, int seed) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(static_cast<int32_t>(2 + (seed * 131 + i * 37) % 1000));
  return p;
}

inline bool ShmExists(const std::string& name) {
  return std::filesystem::exists("/dev/shm/" + name);
}

// /dev/shm entries whose name starts with `prefix`.
inline std::vector<std::string> ShmWithPrefix(const std::string& prefix) {
  std::vector<std::string> out;
  if (DIR* dir = ::opendir("/dev/shm")) {
    while (const dirent* e = ::readdir(dir)) {
      if (absl::StartsWith(e->d_name, prefix)) out.emplace_back(e->d_name);
    }
    ::closedir(dir);
  }
  return out;
}

template <typename F>
bool Eventually(F cond, std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return cond();
}

// A worker process serving on a unix socket, SERVING once started.
class Process {
 public:
  // `binary` serving env.model on a socket in env.dir, its stderr in env.dir/<tag>.err.
  static std::unique_ptr<Process> Start(const HandOffEnv& env, const std::string& binary,
                                        const std::string& tag, std::vector<std::string> extra,
                                        bool wait = true) {
    auto p = std::unique_ptr<Process>(new Process());
    p->socket_ = env.dir.File(absl::StrCat("run-", tag, "/w.sock"));
    std::vector<std::string> argv = {binary,     "--model",   env.model, "--socket",
                                     p->socket_, "--threads", "1",       "--pin-threads=false"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    ::hmoe::testing::ChildOptions o;
    o.argv = std::move(argv);
    o.stderr_path = env.dir.File(absl::StrCat(tag, ".err"));
    auto child = ::hmoe::testing::ChildProcess::Start(std::move(o));
    EXPECT_TRUE(child.ok()) << child.status();
    if (!child.ok()) return nullptr;
    p->child_ = std::make_unique<::hmoe::testing::ChildProcess>(*std::move(child));
    if (wait && !p->WaitServing()) return nullptr;
    return p;
  }

  bool WaitServing() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < deadline) {
      if (!child_->Running()) {
        ADD_FAILURE() << "worker exited: " << child_->ReadStderr();
        return false;
      }
      if (std::filesystem::exists(socket_)) {
        channel_ = grpc::CreateChannel("unix:" + socket_, grpc::InsecureChannelCredentials());
        auto health = grpc::health::v1::Health::NewStub(channel_);
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
        grpc::health::v1::HealthCheckResponse resp;
        if (health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok() &&
            resp.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
          return true;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ADD_FAILURE() << "worker not SERVING: " << child_->ReadStderr();
    return false;
  }

  int Terminate() {
    absl::StatusOr<int> code = child_->Terminate(std::chrono::seconds(60));
    EXPECT_TRUE(code.ok()) << code.status() << "\n" << child_->ReadStderr();
    return code.ok() ? *code : -1;
  }

  std::shared_ptr<grpc::Channel> channel() const { return channel_; }
  ::hmoe::testing::ChildProcess& child() { return *child_; }
  const std::string& socket() const { return socket_; }

 private:
  Process() = default;
  std::string socket_;
  std::unique_ptr<::hmoe::testing::ChildProcess> child_;
  std::shared_ptr<grpc::Channel> channel_;
};

// The prefill worker's client.
class PrefillClient {
 public:
  explicit PrefillClient(const Process& p) : stub_(v1::PrefillService::NewStub(p.channel())) {}

  grpc::Status Prefill(const v1::PrefillRequest& req, v1::PrefillResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    return stub_->Prefill(&ctx, req, resp);
  }
  grpc::Status Release(const std::string& id) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ReleaseRequest req;
    req.set_request_id(id);
    v1::ReleaseResponse resp;
    return stub_->Release(&ctx, req, &resp);
  }
  grpc::Status Cancel(const std::string& id) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::CancelRequest req;
    req.set_request_id(id);
    v1::CancelResponse resp;
    return stub_->Cancel(&ctx, req, &resp);
  }
  v1::PrefillStatus Status() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::PrefillStatus st;
    const grpc::Status s = stub_->GetStatus(&ctx, v1::GetStatusRequest(), &st);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return st;
  }

 private:
  std::unique_ptr<v1::PrefillService::Stub> stub_;
};

inline v1::PrefillRequest PrefillRequest(const std::string& id, const std::vector<int32_t>& prompt,
                                         const decode::v1::SamplingParams& sampling = {}) {
  v1::PrefillRequest r;
  r.set_request_id(id);
  for (int32_t t : prompt) r.add_prompt_token_ids(t);
  *r.mutable_sampling() = sampling;
  return r;
}

// One Admit stream as the router consumes it: `on_imported` runs when KvImported arrives.
struct Generation {
  grpc::Status status;
  std::vector<int32_t> tokens;  // streamed tokens (without a hand-off's first token)
  bool kv_imported_first = false;
  bool finished = false;
  decode::v1::Finished finish;
};

inline Generation Admit(const Process& decode, const decode::v1::AdmitRequest& request,
                        const std::function<void()>& on_imported = nullptr) {
  auto stub = decode::v1::DecodeService::NewStub(decode.channel());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  Generation g;
  auto reader = stub->Admit(&ctx, request);
  decode::v1::AdmitResponse msg;
  bool first = true;
  while (reader->Read(&msg)) {
    if (msg.has_kv_imported()) {
      g.kv_imported_first = first;
      if (on_imported) on_imported();
    } else if (msg.has_token()) {
      g.tokens.push_back(msg.token().token_id());
    } else if (msg.has_finished()) {
      g.finished = true;
      g.finish = msg.finished();
    }
    first = false;
  }
  g.status = reader->Finish();
  return g;
}

inline decode::v1::AdmitRequest AdmitRequest(const std::string& id,
                                             const std::vector<int32_t>& prompt,
                                             const decode::v1::SamplingParams& sampling = {}) {
  decode::v1::AdmitRequest r;
  r.set_request_id(id);
  for (int32_t t : prompt) r.add_prompt_token_ids(t);
  *r.mutable_sampling() = sampling;
  r.set_max_new_tokens(kTokens);
  r.set_ignore_eos(true);
  return r;
}

// The router's hand-off: the prefill response's handle and first token in an AdmitRequest.
inline decode::v1::AdmitRequest HandOff(const std::string& id, const std::vector<int32_t>& prompt,
                                        const v1::PrefillResponse& prefilled,
                                        const decode::v1::SamplingParams& sampling = {}) {
  decode::v1::AdmitRequest r = AdmitRequest(id, prompt, sampling);
  *r.mutable_kv_handle() = prefilled.kv_handle();
  r.set_first_token_id(prefilled.first_token_id());
  return r;
}

}  // namespace hmoe::prefill::testing
