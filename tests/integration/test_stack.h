#pragma once

// The whole service as child processes of an integration test: hmoe-weightd serving a checkpoint,
// the router, one decode worker and N prefill workers, each with its log in the stack's run
// directory. Shared by the tests that drive a real stack (tests/router/router_stack_test.cc,
// tests/cli/bench_smoke_test.cc), so the flags a test stack runs with are written once.
//
//   TestStackOptions o;
//   o.binaries = {HMOE_WEIGHTD_PATH, HMOE_ROUTER_PATH, HMOE_DECODE_WORKER_PATH, ...};
//   o.model = dir + "/tiny";
//   o.run_dir = dir + "/stack";
//   o.tag = "paths";  // unique among the stacks this machine runs at once
//   std::unique_ptr<TestStack> stack = TestStack::Start(std::move(o));
//   ASSERT_NE(stack, nullptr);  // a failure was added saying why
//   ... talk to 127.0.0.1:stack->grpc_port() ...
//   stack.reset();  // SIGTERM, router first; each process must exit 0 after draining
//
// Header-only, like child_process.h.

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include <grpcpp/grpcpp.h>

#include "proto/hmoe_v1.grpc.pb.h"
#include "tests/integration/child_process.h"

#include "gtest/gtest.h"

namespace hmoe::testing {

// Polls a port file (the router's --port-file / --http-port-file: the port and a newline, written
// once it listens). 0 when none appeared within `timeout`.
inline int ReadPortFile(const std::string& path, absl::Duration timeout = absl::Seconds(60)) {
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end) {
    std::ifstream f(path);
    std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    int port = 0;
    if (absl::EndsWith(text, "\n") && absl::SimpleAtoi(absl::StripSuffix(text, "\n"), &port) &&
        port > 0) {
      return port;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return 0;
}

// Until the router at `addr` lists at least `decode` live decode workers and `prefill` live
// prefill workers; false when that did not happen within `timeout`.
inline bool WaitForLiveWorkers(const std::string& addr, int decode, int prefill,
                               absl::Duration timeout = absl::Seconds(60)) {
  auto stub =
      hmoe::v1::Hmoe::NewStub(grpc::CreateChannel(addr, grpc::InsecureChannelCredentials()));
  const absl::Time end = absl::Now() + timeout;
  while (absl::Now() < end) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    hmoe::v1::RouterStatus st;
    if (stub->GetStatus(&ctx, {}, &st).ok()) {
      int d = 0, p = 0;
      for (const hmoe::v1::WorkerInfo& w : st.workers()) {
        if (w.state() != hmoe::v1::WORKER_STATE_LIVE) continue;
        (w.kind() == hmoe::v1::WORKER_KIND_DECODE ? d : p) += 1;
      }
      if (d >= decode && p >= prefill) return true;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

struct TestStackBinaries {
  std::string weightd;
  std::string router;
  std::string decode;
  std::string prefill;  // may be empty when the stack has no prefill worker
};

struct TestStackOptions {
  TestStackBinaries binaries;
  std::string model;    // a checkpoint directory or a .gguf file
  std::string run_dir;  // sockets, port files and logs (created, mode 0700)
  // Names the weightd instance ("<tag>-<pid>") and the prefill workers' ids ("<tag>-prefill-<i>"):
  // a worker removes, at start-up, the hand-off segments of its id whose process is gone, and
  // weightd instances are machine-wide, so the tag must be unique among the stacks this machine
  // runs at once (the pid in the instance covers concurrent test processes).
  std::string tag;
  int prefill_workers = 0;
  bool http = false;  // the OpenAI API on 127.0.0.1, an ephemeral port (http_port())
  // Appended to each process's defaults (a later flag overrides an earlier one).
  std::vector<std::string> router_flags;
  std::vector<std::string> decode_flags;
  std::vector<std::string> prefill_flags;
};

class TestStack {
 public:
  // Starts weightd (and waits until it serves), the router, the decode worker and the prefill
  // workers, then waits until the router lists them live. nullptr, with a test failure carrying
  // the logs that say why, when any of that did not happen.
  static std::unique_ptr<TestStack> Start(TestStackOptions options) {
    auto s = std::unique_ptr<TestStack>(new TestStack(std::move(options)));
    const TestStackOptions& o = s->options_;
    std::filesystem::create_directories(o.run_dir);
    std::filesystem::permissions(o.run_dir, std::filesystem::perms::owner_all);
    const std::string registry = "unix:" + o.run_dir + "/router.sock";

    ChildOptions w;
    w.argv = {o.binaries.weightd,
              "--model",
              o.model,
              "--instance",
              s->instance(),
              "--socket",
              s->run("weightd.sock"),
              "--hugepages",
              "off",
              "--numa",
              "off",
              "--remove-on-exit"};
    w.env = {{"HMOE_RUNTIME_DIR", o.run_dir}};
    w.stderr_path = s->run("weightd.log");
    if (!s->Spawn(std::move(w), &s->weightd_)) return nullptr;
    if (absl::Status st = s->weightd_->WaitForOutput("SERVING instance", std::chrono::seconds(60),
                                                     /*stderr=*/true);
        !st.ok()) {
      ADD_FAILURE() << st << "\n" << s->weightd_->ReadStderr();
      return nullptr;
    }

    ChildOptions r;
    r.argv = {o.binaries.router,
              "--listen=127.0.0.1:0",
              "--model=" + o.model,
              "--registry-socket=" + o.run_dir + "/router.sock",
              "--port-file=" + s->run("port"),
              "--heartbeat-timeout-ms=1000",
              "--drain-seconds=5"};
    if (o.http) {
      r.argv.push_back("--http-listen=127.0.0.1:0");
      r.argv.push_back("--http-port-file=" + s->run("http_port"));
    }
    r.argv.insert(r.argv.end(), o.router_flags.begin(), o.router_flags.end());
    r.stderr_path = s->run("router.log");
    if (!s->Spawn(std::move(r), &s->router_)) return nullptr;

    ChildOptions d;
    d.argv = {o.binaries.decode,
              "--weightd-instance",
              s->instance(),
              "--socket",
              s->run("decode.sock"),
              "--router",
              registry,
              "--worker-id",
              "decode-0",
              "--threads",
              "1",
              "--pin-threads=false",
              "--heartbeat-ms",
              "100",
              "--kv-blocks",
              "256",
              "--kv-block-tokens",
              "16",
              "--drain-seconds",
              "5"};
    d.argv.insert(d.argv.end(), o.decode_flags.begin(), o.decode_flags.end());
    d.stderr_path = s->run("decode.log");
    if (!s->Spawn(std::move(d), &s->decode_)) return nullptr;

    for (int i = 0; i < o.prefill_workers; ++i) {
      ChildOptions p;
      p.argv = {o.binaries.prefill,
                "--weightd-instance",
                s->instance(),
                "--socket",
                s->run(absl::StrCat("prefill-", i, ".sock")),
                "--device",
                "cpu",
                "--router",
                registry,
                "--worker-id",
                s->PrefillId(i),
                "--drain-seconds",
                "5"};
      p.argv.insert(p.argv.end(), o.prefill_flags.begin(), o.prefill_flags.end());
      p.stderr_path = s->run(absl::StrCat("prefill-", i, ".log"));
      s->prefill_.emplace_back();
      if (!s->Spawn(std::move(p), &s->prefill_.back())) return nullptr;
    }

    s->grpc_port_ = ReadPortFile(s->run("port"));
    if (s->grpc_port_ == 0) {
      ADD_FAILURE() << "the router did not listen: " << s->router_->ReadStderr();
      return nullptr;
    }
    if (o.http) {
      s->http_port_ = ReadPortFile(s->run("http_port"));
      if (s->http_port_ == 0) {
        ADD_FAILURE() << "the router's HTTP API did not listen: " << s->router_->ReadStderr();
        return nullptr;
      }
    }
    if (!WaitForLiveWorkers(s->grpc_addr(), 1, o.prefill_workers)) {
      ADD_FAILURE() << "workers did not register:\n"
                    << s->router_->ReadStderr() << "\n"
                    << s->decode_->ReadStderr();
      return nullptr;
    }
    return s;
  }

  // SIGTERM to every process still running, router first, weightd last; each must exit 0.
  ~TestStack() {
    std::vector<ChildProcess*> children = {router_.get(), decode_.get()};
    for (auto& p : prefill_) children.push_back(p.get());
    children.push_back(weightd_.get());
    for (ChildProcess* c : children) {
      if (c == nullptr) continue;
      EXPECT_EQ(c->Terminate(std::chrono::seconds(30)).value_or(-1), 0) << c->ReadStderr();
    }
  }

  TestStack(const TestStack&) = delete;
  TestStack& operator=(const TestStack&) = delete;

  int grpc_port() const { return grpc_port_; }
  std::string grpc_addr() const { return absl::StrCat("127.0.0.1:", grpc_port_); }
  int http_port() const { return http_port_; }  // 0 without options.http
  std::string http_addr() const { return absl::StrCat("127.0.0.1:", http_port_); }

  ChildProcess& weightd() { return *weightd_; }
  ChildProcess& router() { return *router_; }
  ChildProcess& decode() { return *decode_; }
  ChildProcess& prefill(int i) { return *prefill_[i]; }
  std::string PrefillId(int i) const { return absl::StrCat(options_.tag, "-prefill-", i); }
  std::string instance() const { return absl::StrCat(options_.tag, "-", ::getpid()); }
  const std::string& run_dir() const { return options_.run_dir; }
  // A path in the run directory.
  std::string run(const std::string& name) const { return options_.run_dir + "/" + name; }

  // SIGKILLs prefill worker i and reaps it (the destructor then skips it).
  void KillPrefill(int i) {
    EXPECT_TRUE(prefill_[i]->Kill().ok());
    prefill_[i].reset();
  }

 private:
  explicit TestStack(TestStackOptions options) : options_(std::move(options)) {}

  bool Spawn(ChildOptions o, std::unique_ptr<ChildProcess>* out) {
    absl::StatusOr<ChildProcess> c = ChildProcess::Start(std::move(o));
    if (!c.ok()) {
      ADD_FAILURE() << c.status();
      return false;
    }
    *out = std::make_unique<ChildProcess>(*std::move(c));
    return true;
  }

  const TestStackOptions options_;
  int grpc_port_ = 0;
  int http_port_ = 0;
  std::unique_ptr<ChildProcess> weightd_;
  std::unique_ptr<ChildProcess> router_;
  std::unique_ptr<ChildProcess> decode_;
  std::vector<std::unique_ptr<ChildProcess>> prefill_;
};

}  // namespace hmoe::testing
