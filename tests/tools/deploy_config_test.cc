// The supervisord configuration `hmoe deploy` writes (tools/deploy_config.h): programs, start
// order, restart and stop policy, devices, the prefill-worker count rules, path checks, the
// owner-only run directory and binary discovery. The configuration is run for real by the router
// stack tests (tests/router/router_stack_test.cc).

#include "tools/deploy_config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

#include "gtest/gtest.h"

namespace hmoe::deploy {
namespace {

// section name -> key -> value.
using Conf = std::map<std::string, std::map<std::string, std::string>>;

Conf Parse(const std::string& text) {
  Conf conf;
  std::string section;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == ';') continue;
    if (line[0] == '[') {
      section = std::string(line.substr(1, line.size() - 2));
      conf[section];
      continue;
    }
    const size_t eq = line.find('=');
    if (eq == absl::string_view::npos) continue;
    std::string key(absl::StripAsciiWhitespace(line.substr(0, eq)));
    conf[section][key] = std::string(absl::StripAsciiWhitespace(line.substr(eq + 1)));
  }
  return conf;
}

class DeployConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat("/tmp/hmoe-deploy-test-", ::getpid());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_ + "/model");
    std::ofstream(dir_ + "/model/config.json") << "{}";
    // A CMake build tree with stand-in executables.
    for (const char* rel : {"weightd/hmoe-weightd", "decode_worker/hmoe-decode-worker",
                            "router/hmoe-router", "tools/hmoe"}) {
      MakeExecutable(absl::StrCat(dir_, "/build/", rel));
    }
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  static void MakeExecutable(const std::string& path) {
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    std::ofstream(path) << "#!/bin/sh\n";
    ::chmod(path.c_str(), 0755);
  }

  DeployOptions Options() {
    DeployOptions o;
    o.model_dir = dir_ + "/model";
    o.out_dir = dir_ + "/out";
    o.bin = FindBinaries({dir_ + "/build/tools"});
    return o;
  }

  std::string dir_;
};

TEST_F(DeployConfigTest, FindsBinariesInABuildTree) {
  const Binaries b = FindBinaries({dir_ + "/build/tools"});
  EXPECT_EQ(b.weightd, dir_ + "/build/weightd/hmoe-weightd");
  EXPECT_EQ(b.decode_worker, dir_ + "/build/decode_worker/hmoe-decode-worker");
  EXPECT_EQ(b.router, dir_ + "/build/router/hmoe-router");
  EXPECT_EQ(b.hmoe, dir_ + "/build/tools/hmoe");
  EXPECT_EQ(b.prefill_worker, "");
  // A flat bin directory works too.
  MakeExecutable(dir_ + "/bin/hmoe-router");
  EXPECT_EQ(FindBinaries({dir_ + "/bin"}).router, dir_ + "/bin/hmoe-router");
}

TEST_F(DeployConfigTest, TwoGpusGetAPrefillWorkerEachInStartOrder) {
  MakeExecutable(dir_ + "/build/prefill_worker/hmoe-prefill-worker");
  DeployOptions o = Options();
  o.gpus = 2;
  o.drain_seconds = 30;
  absl::StatusOr<DeployOptions> r = Resolve(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prefill_workers, 2);
  const Conf conf = Parse(RenderSupervisordConf(*r));
  const std::vector<std::string> programs = {"program:weightd", "program:prefill-0",
                                             "program:prefill-1", "program:decode",
                                             "program:router"};
  int last_priority = 0;
  for (const std::string& p : programs) {
    ASSERT_TRUE(conf.contains(p)) << p;
    const auto& s = conf.at(p);
    int priority = 0;
    ASSERT_TRUE(absl::SimpleAtoi(s.at("priority"), &priority)) << p;
    EXPECT_GE(priority, last_priority) << p << " starts before the program listed before it";
    last_priority = priority;
    EXPECT_EQ(s.at("autostart"), "true") << p;
    EXPECT_EQ(s.at("autorestart"), "true") << p;
    EXPECT_EQ(s.at("stopsignal"), "TERM") << p;
    EXPECT_EQ(s.at("redirect_stderr"), "true") << p;
    int stopwait = 0;
    ASSERT_TRUE(absl::SimpleAtoi(s.at("stopwaitsecs"), &stopwait));
    EXPECT_GT(stopwait, 30) << p << ": must exceed the drain time";
    EXPECT_EQ(s.at("stdout_logfile"), absl::StrCat(r->log_dir, "/", p.substr(8), ".log"));
  }
  EXPECT_LT(std::stoi(conf.at("program:weightd").at("priority")),
            std::stoi(conf.at("program:prefill-0").at("priority")));
  EXPECT_LT(std::stoi(conf.at("program:decode").at("priority")),
            std::stoi(conf.at("program:router").at("priority")));
  // Devices: decode attention on cuda:0, prefill worker i on cuda:i.
  const std::string decode = conf.at("program:decode").at("command");
  EXPECT_TRUE(absl::StrContains(decode, "--device cuda:0")) << decode;
  EXPECT_TRUE(absl::StrContains(conf.at("program:prefill-1").at("command"), "--device cuda:1"));
  // Workers wait for weightd, then become the worker (exec), registering with the router.
  EXPECT_TRUE(absl::StrContains(decode, "health --addr unix:" + r->run_dir + "/weightd.sock"))
      << decode;
  EXPECT_TRUE(absl::StrContains(decode, "&& exec " + r->bin.decode_worker)) << decode;
  EXPECT_TRUE(absl::StrContains(decode, "--router unix:" + r->run_dir + "/router.sock")) << decode;
  EXPECT_TRUE(absl::StrContains(conf.at("program:router").at("command"),
                                "--registry-socket " + r->run_dir + "/router.sock"));
  // The OpenAI HTTP API is on by default (issue 17).
  EXPECT_TRUE(
      absl::StrContains(conf.at("program:router").at("command"), "--http-listen=127.0.0.1:8000"))
      << conf.at("program:router").at("command");
  EXPECT_EQ(conf.at("program:weightd").at("environment"),
            absl::StrCat("HMOE_RUNTIME_DIR=\"", r->run_dir, "\""));
  // supervisorctl talks to an owner-only socket.
  EXPECT_EQ(conf.at("unix_http_server").at("chmod"), "0700");
  EXPECT_EQ(conf.at("supervisorctl").at("serverurl"),
            "unix://" + conf.at("unix_http_server").at("file"));
}

TEST_F(DeployConfigTest, PrefillWorkerCountRules) {
  DeployOptions o = Options();
  // CPU only, no prefill binary: none.
  absl::StatusOr<DeployOptions> r = Resolve(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prefill_workers, 0);
  Conf conf = Parse(RenderSupervisordConf(*r));
  EXPECT_FALSE(conf.contains("program:prefill-0"));
  EXPECT_TRUE(absl::StrContains(conf.at("program:decode").at("command"), "--device cpu"));
  // Asked for one without the binary: a clear error.
  o.prefill_workers = 1;
  r = Resolve(o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(r.status().message(), "hmoe-prefill-worker")) << r.status();
  // With the binary, CPU only: one on the CPU by default, none with --prefill-workers 0.
  MakeExecutable(dir_ + "/build/prefill_worker/hmoe-prefill-worker");
  o = Options();
  r = Resolve(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->prefill_workers, 1);
  conf = Parse(RenderSupervisordConf(*r));
  EXPECT_TRUE(absl::StrContains(conf.at("program:prefill-0").at("command"), "--device cpu"));
  o.prefill_workers = 0;
  r = Resolve(o);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(Parse(RenderSupervisordConf(*r)).contains("program:prefill-0"));
}

// Two or more prefill workers form DSLP groups: on the CPU they share the cores (--threads
// cpus / N, unpinned) since a group's ranks compute at once; the router gets the EP mode. GPU
// workers keep their defaults; one CPU worker too.
TEST_F(DeployConfigTest, PrefillWorkersOfANodeFormDslpGroups) {
  MakeExecutable(dir_ + "/build/prefill_worker/hmoe-prefill-worker");
  DeployOptions o = Options();
  o.prefill_workers = 3;
  o.cpus = 8;
  o.dslp_ep_mode = "standard";
  absl::StatusOr<DeployOptions> r = Resolve(o);
  ASSERT_TRUE(r.ok()) << r.status();
  Conf conf = Parse(RenderSupervisordConf(*r));
  for (int i = 0; i < 3; ++i) {
    const std::string& cmd = conf.at(absl::StrCat("program:prefill-", i)).at("command");
    EXPECT_TRUE(absl::StrContains(cmd, "--device cpu --router")) << cmd;
    EXPECT_TRUE(absl::StrContains(cmd, "--threads=2 --pin-threads=false")) << cmd;
  }
  EXPECT_TRUE(
      absl::StrContains(conf.at("program:router").at("command"), "--dslp-ep-mode=standard"));
  // User flags come last (absl: the last occurrence wins).
  o.prefill_args = {"--threads=1"};
  r = Resolve(o);
  ASSERT_TRUE(r.ok());
  conf = Parse(RenderSupervisordConf(*r));
  EXPECT_TRUE(absl::EndsWith(conf.at("program:prefill-0").at("command"),
                             "--pin-threads=false --threads=1'"));
  // GPUs, or a single CPU worker: no core sharing; no EP mode: the router's default.
  o = Options();
  o.gpus = 2;
  r = Resolve(o);
  ASSERT_TRUE(r.ok());
  conf = Parse(RenderSupervisordConf(*r));
  EXPECT_FALSE(absl::StrContains(conf.at("program:prefill-1").at("command"), "--threads"));
  EXPECT_FALSE(absl::StrContains(conf.at("program:router").at("command"), "--dslp-ep-mode"));
  o = Options();
  o.prefill_workers = 1;
  r = Resolve(o);
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(absl::StrContains(
      Parse(RenderSupervisordConf(*r)).at("program:prefill-0").at("command"), "--threads"));
  o.dslp_ep_mode = "tensor";
  EXPECT_EQ(Resolve(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(DeployConfigTest, ExtraArgumentsAreAppended) {
  DeployOptions o = Options();
  o.decode_args = {"--threads", "4"};
  o.router_args = {"--chunk-threshold=64"};
  absl::StatusOr<DeployOptions> r = Resolve(o);
  ASSERT_TRUE(r.ok());
  const Conf conf = Parse(RenderSupervisordConf(*r));
  EXPECT_TRUE(absl::EndsWith(conf.at("program:decode").at("command"), "--threads 4'"));
  EXPECT_TRUE(absl::EndsWith(conf.at("program:router").at("command"), "--chunk-threshold=64"));
}

TEST_F(DeployConfigTest, CalibratedThresholdsGoToTheRouter) {
  DeployOptions o = Options();
  absl::StatusOr<DeployOptions> r = Resolve(o);
  ASSERT_TRUE(r.ok());
  // Without a calibration: the router's defaults, no flags.
  std::string cmd = Parse(RenderSupervisordConf(*r)).at("program:router").at("command");
  EXPECT_FALSE(absl::StrContains(cmd, "--chunk-threshold")) << cmd;
  EXPECT_FALSE(absl::StrContains(cmd, "--decode-idle-window-s")) << cmd;
  o.chunk_threshold = 320;
  o.decode_idle_window_s = 0;
  o.router_args = {"--max-inflight=8"};
  r = Resolve(o);
  ASSERT_TRUE(r.ok()) << r.status();
  cmd = Parse(RenderSupervisordConf(*r)).at("program:router").at("command");
  // Before the user's router flags, which win.
  EXPECT_TRUE(
      absl::EndsWith(cmd, "--chunk-threshold=320 --decode-idle-window-s=0 --max-inflight=8"))
      << cmd;
  o.chunk_threshold = int64_t{1} << 31;
  EXPECT_EQ(Resolve(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.chunk_threshold = -1;
  EXPECT_EQ(Resolve(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.chunk_threshold = 64;
  o.decode_idle_window_s = -2;
  const absl::Status s = Resolve(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "idle window")) << s;
}

TEST_F(DeployConfigTest, RejectsWhatSupervisordWouldMisread) {
  DeployOptions o = Options();
  o.out_dir = dir_ + "/out with space";
  EXPECT_EQ(Resolve(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options();
  o.out_dir = dir_ + "/100%";
  EXPECT_EQ(Resolve(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options();
  o.decode_args = {"--x='y'"};
  EXPECT_EQ(Resolve(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options();
  o.run_dir = "/tmp/" + std::string(100, 'r');
  absl::Status s = Resolve(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "--run-dir")) << s;
  o = Options();
  o.model_dir = dir_;  // no config.json
  EXPECT_EQ(Resolve(o).status().code(), absl::StatusCode::kFailedPrecondition);
  o = Options();
  o.model_dir = dir_ + "/missing.gguf";  // a GGUF path must be a file
  s = Resolve(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "GGUF")) << s;
  o = Options();
  o.bin.router.clear();
  s = Resolve(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "hmoe-router")) << s;
  o = Options();
  o.instance = "bad/name";
  EXPECT_EQ(Resolve(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(DeployConfigTest, AGgufFileIsTheModelOfWeightdAndTheRouter) {
  DeployOptions o = Options();
  o.model_dir = dir_ + "/model-00001-of-00002.gguf";
  std::ofstream(o.model_dir) << "GGUF";  // Resolve checks only that it is a file
  absl::StatusOr<DeployOptions> r = Resolve(o);
  ASSERT_TRUE(r.ok()) << r.status();
  const std::string conf = RenderSupervisordConf(*r);
  EXPECT_TRUE(absl::StrContains(conf, "--model " + o.model_dir)) << conf;
  o.gpus = 1;  // the CUDA device refuses GGML block types
  const absl::Status s = Resolve(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "--gpus 0")) << s;
}

TEST_F(DeployConfigTest, WriteCreatesAnOwnerOnlyRunDirAndTheConf) {
  absl::StatusOr<DeployOptions> r = WriteDeployment(Options());
  ASSERT_TRUE(r.ok()) << r.status();
  struct stat st;
  ASSERT_EQ(::stat(r->run_dir.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_TRUE(std::filesystem::is_directory(r->log_dir));
  std::ifstream f(r->out_dir + "/supervisord.conf");
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(Parse(text).contains("program:router"));
}

}  // namespace
}  // namespace hmoe::deploy
