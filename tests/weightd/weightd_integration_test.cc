// hmoe-weightd as a real process, with real worker processes (hmoe-weightd-inspect) attaching to
// its shared memory: byte equality from two processes, read-only mappings, kill -9 and adoption,
// NUMA slices, proportional memory (PSS) and bad input. Binaries come from $<TARGET_FILE:...>.

#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "common/model/checkpoint.h"
#include "common/shm/control_segment.h"
#include "common/shm/weight_store.h"
#include "proto/health.grpc.pb.h"
#include "proto/weightd.grpc.pb.h"
#include "tests/integration/child_process.h"
#include "tests/weightd/test_checkpoint.h"

namespace hmoe::weightd {
namespace {

using ::hmoe::testing::ChildOptions;
using ::hmoe::testing::ChildProcess;
using ::hmoe::testing::TempDir;
using ::hmoe::testing::UniqueInstanceName;
using ::hmoe::testing::WriteTestCheckpoint;
using namespace std::chrono_literals;

constexpr char kWeightd[] = HMOE_WEIGHTD_PATH;
constexpr char kInspect[] = HMOE_INSPECT_PATH;

int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t p = text.find(what); p != std::string::npos; p = text.find(what, p + 1)) ++n;
  return n;
}

class WeightdProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    model_ = dir_.File("model");
    ASSERT_TRUE(WriteTestCheckpoint(model_).ok());
    runtime_dir_ = dir_.File("run");
    ASSERT_EQ(::mkdir(runtime_dir_.c_str(), 0700), 0);
    // This process attaches too; WeightStore needs no runtime dir, the socket path below does.
    instance_ = UniqueInstanceName("wdproc");
    socket_ = absl::StrCat(runtime_dir_, "/weightd.", instance_, ".sock");
  }
  void TearDown() override {
    absl::Status s = shm::RemoveInstance(instance_);
    EXPECT_TRUE(s.ok() || absl::IsNotFound(s)) << s;
  }

  ChildOptions Options(std::vector<std::string> argv, const std::string& log_name) {
    ChildOptions o;
    o.argv = std::move(argv);
    o.env = {{"HMOE_RUNTIME_DIR", runtime_dir_}};
    o.stdout_path = dir_.File(log_name + ".out");
    o.stderr_path = dir_.File(log_name + ".err");
    return o;
  }

  absl::StatusOr<ChildProcess> StartWeightd(const std::string& log_name,
                                            std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {kWeightd, "--model", model_, "--instance", instance_};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return ChildProcess::Start(Options(std::move(argv), log_name));
  }

  absl::StatusOr<ChildProcess> StartInspect(const std::string& log_name,
                                            std::vector<std::string> extra) {
    std::vector<std::string> argv = {kInspect, "--instance", instance_};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return ChildProcess::Start(Options(std::move(argv), log_name));
  }

  // Polls the standard health service until SERVING (the state before that is NOT_SERVING or no
  // socket yet). Fails if the process exits or the deadline passes.
  void WaitServing(ChildProcess& weightd, std::chrono::milliseconds timeout = 20s) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      ASSERT_TRUE(weightd.Running()) << "weightd exited: " << weightd.ReadStderr();
      // A fresh channel per attempt: a channel that failed to connect backs off for seconds.
      if (std::filesystem::exists(socket_)) {
        auto channel = grpc::CreateChannel("unix:" + socket_, grpc::InsecureChannelCredentials());
        auto health = grpc::health::v1::Health::NewStub(channel);
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + 1s);
        grpc::health::v1::HealthCheckRequest req;
        grpc::health::v1::HealthCheckResponse resp;
        if (health->Check(&ctx, req, &resp).ok() &&
            resp.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
          return;
        }
      }
      std::this_thread::sleep_for(20ms);
    }
    FAIL() << "weightd not SERVING after " << timeout.count() << " ms: " << weightd.ReadStderr();
  }

  v1::WeightdStatus GetStatus() {
    auto channel = grpc::CreateChannel("unix:" + socket_, grpc::InsecureChannelCredentials());
    auto stub = v1::WeightdService::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + 5s);
    v1::WeightdStatus status;
    const grpc::Status s = stub->GetStatus(&ctx, v1::GetStatusRequest(), &status);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return status;
  }

  uint64_t TensorBytes() {
    absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(model_);
    EXPECT_TRUE(ckpt.ok());
    return ckpt.ok() ? (*ckpt)->total_tensor_bytes() : 0;
  }

  TempDir dir_;
  std::string model_;
  std::string runtime_dir_;
  std::string instance_;
  std::string socket_;
};

TEST_F(WeightdProcessTest, TwoWorkerProcessesSeeEveryTensorByteAndCannotWrite) {
  absl::StatusOr<ChildProcess> weightd = StartWeightd("weightd");
  ASSERT_TRUE(weightd.ok()) << weightd.status();
  WaitServing(*weightd);
  const v1::WeightdStatus status = GetStatus();
  EXPECT_EQ(status.state(), v1::SERVING_STATE_READY);
  EXPECT_FALSE(status.adopted());
  EXPECT_EQ(status.bytes_read_from_checkpoint(), TensorBytes());

  // Two separate processes attach and compare every tensor and every part with the checkpoint.
  absl::StatusOr<ChildProcess> a = StartInspect("a", {"--verify", "--model", model_});
  absl::StatusOr<ChildProcess> b = StartInspect("b", {"--verify", "--model", model_});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->WaitForExit(20s).value_or(-1), 0) << a->ReadStdout() << a->ReadStderr();
  EXPECT_EQ(b->WaitForExit(20s).value_or(-1), 0) << b->ReadStdout() << b->ReadStderr();
  EXPECT_NE(a->ReadStdout().find("verify: OK"), std::string::npos) << a->ReadStdout();
  EXPECT_NE(b->ReadStdout().find("verify: OK"), std::string::npos) << b->ReadStdout();

  // A write through a worker's mapping faults. The store is attached before fork(); the child
  // only executes the store instruction.
  absl::StatusOr<std::unique_ptr<shm::WeightStore>> store = shm::WeightStore::Attach(instance_);
  ASSERT_TRUE(store.ok()) << store.status();
  absl::StatusOr<TensorView> t = (*store)->GetTensor("model.norm.weight");
  ASSERT_TRUE(t.ok());
  auto* target = const_cast<volatile std::byte*>(t->data);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::signal(SIGSEGV, SIG_DFL);  // Sanitizers install their own handler; we want the signal.
    target[0] = std::byte{0x5a};
    ::_exit(0);
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGSEGV) << wstatus;

  // hmoe-weightd-inspect --remove refuses while weightd runs.
  absl::StatusOr<ChildProcess> early = StartInspect("early-remove", {"--remove"});
  ASSERT_TRUE(early.ok());
  EXPECT_EQ(early->WaitForExit(10s).value_or(-1), 1);
  EXPECT_NE(early->ReadStderr().find("still serves it"), std::string::npos) << early->ReadStderr();

  EXPECT_EQ(weightd->Terminate(10s).value_or(-1), 0) << weightd->ReadStderr();
  // Without --remove-on-exit the store outlives weightd, until removed.
  EXPECT_TRUE(shm::WeightStore::Attach(instance_).ok());
  absl::StatusOr<ChildProcess> remove = StartInspect("remove", {"--remove"});
  ASSERT_TRUE(remove.ok());
  EXPECT_EQ(remove->WaitForExit(10s).value_or(-1), 0) << remove->ReadStderr();
  EXPECT_TRUE(absl::IsNotFound(shm::WeightStore::Attach(instance_).status()));
}

TEST_F(WeightdProcessTest, KillNineKeepsWorkerMappingsAndRestartAdoptsWithoutReading) {
  absl::StatusOr<ChildProcess> first = StartWeightd("first");
  ASSERT_TRUE(first.ok());
  WaitServing(*first);
  absl::StatusOr<ChildProcess> worker =
      StartInspect("worker", {"--verify", "--model", model_, "--touch", "--hold"});
  ASSERT_TRUE(worker.ok());
  ASSERT_TRUE(worker->WaitForOutput("holding", 20s).ok())
      << worker->ReadStdout() << worker->ReadStderr();
  ASSERT_TRUE(first->Kill().ok());
  EXPECT_EQ(first->exit_info()->signal, SIGKILL);

  absl::StatusOr<ChildProcess> second = StartWeightd("second");
  ASSERT_TRUE(second.ok());
  WaitServing(*second);
  const v1::WeightdStatus status = GetStatus();
  EXPECT_TRUE(status.adopted());
  EXPECT_EQ(status.adopt_count(), 1u);
  EXPECT_EQ(status.generation(), 1u);
  EXPECT_EQ(status.bytes_read_from_checkpoint(), 0u);
  EXPECT_EQ(status.pid(), second->pid());
  EXPECT_NE(second->ReadStderr().find("adopted generation 1"), std::string::npos)
      << second->ReadStderr();
  std::printf("restarted weightd ready %.3f s after start (adopted)\n", status.startup_seconds());

  // The worker attached before the crash re-verifies every byte through its old mappings.
  EXPECT_EQ(worker->Terminate(20s).value_or(-1), 0) << worker->ReadStdout();
  const std::string out = worker->ReadStdout();
  EXPECT_EQ(Count(out, "verify: OK"), 2) << out;
  EXPECT_EQ(second->Terminate(10s).value_or(-1), 0) << second->ReadStderr();
}

TEST_F(WeightdProcessTest, RemoveOnExitRemovesTheSegments) {
  absl::StatusOr<ChildProcess> weightd = StartWeightd("weightd", {"--remove-on-exit"});
  ASSERT_TRUE(weightd.ok());
  WaitServing(*weightd);
  absl::StatusOr<std::unique_ptr<shm::WeightStore>> store = shm::WeightStore::Attach(instance_);
  ASSERT_TRUE(store.ok());
  EXPECT_EQ(weightd->Terminate(10s).value_or(-1), 0) << weightd->ReadStderr();
  EXPECT_TRUE(absl::IsNotFound(shm::WeightStore::Attach(instance_).status()));
  // Workers attached before keep their mapping.
  EXPECT_TRUE((*store)->GetTensor("model.embed_tokens.weight").ok());
  EXPECT_FALSE(std::filesystem::exists(socket_));
}

TEST_F(WeightdProcessTest, ForcedNumaSlicesReassembleExactly) {
  absl::StatusOr<ChildProcess> weightd =
      StartWeightd("weightd", {"--numa-slices", "2", "--dense-policy", "replicate"});
  ASSERT_TRUE(weightd.ok());
  WaitServing(*weightd);
  absl::StatusOr<ChildProcess> check =
      StartInspect("check", {"--verify", "--model", model_, "--tensors"});
  ASSERT_TRUE(check.ok());
  EXPECT_EQ(check->WaitForExit(20s).value_or(-1), 0) << check->ReadStdout();
  EXPECT_NE(check->ReadStdout().find("2 expert slice(s), dense replicate"), std::string::npos)
      << check->ReadStdout();
  absl::StatusOr<std::unique_ptr<shm::WeightStore>> store = shm::WeightStore::Attach(instance_);
  ASSERT_TRUE(store.ok());
  const std::string down = "model.layers.1.mlp.experts.2.down_proj.weight";
  absl::StatusOr<std::vector<shm::TensorPartView>> parts = (*store)->GetParts(down);
  ASSERT_TRUE(parts.ok());
  ASSERT_EQ(parts->size(), 2u);
  std::vector<std::byte> whole((*store)->manifest().Find(down)->size_bytes);
  ASSERT_TRUE(shm::AssembleFromParts(*(*store)->manifest().Find(down), *parts, whole).ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(model_);
  ASSERT_TRUE(ckpt.ok());
  EXPECT_EQ(std::memcmp(whole.data(), (*ckpt)->GetTensor(down)->data, whole.size()), 0);
  EXPECT_EQ(weightd->Terminate(10s).value_or(-1), 0);
}

// Sum of Pss over the mappings of the instance's data segments (/proc/<pid>/smaps): files
// /dev/shm/hmoe.<instance>.* or SysV segments.
uint64_t ShmPssBytes(pid_t pid, const std::string& instance) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/smaps"));
  std::string line;
  bool in_shm = false;
  uint64_t kb = 0;
  while (std::getline(in, line)) {
    const bool header = !line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) &&
                        line.find('-') != std::string::npos && line.find(':') > line.find(' ');
    if (header) {
      in_shm = line.find("/SYSV") != std::string::npos ||
               line.find(absl::StrCat("/dev/shm/hmoe.", instance, ".g")) != std::string::npos;
    } else if (in_shm && line.rfind("Pss:", 0) == 0) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      uint64_t v = 0;
      if (f.size() >= 2 && absl::SimpleAtoi(f[1], &v)) kb += v;
    }
  }
  return kb * 1024;
}

TEST_F(WeightdProcessTest, WeightdAndThreeWorkersHoldAboutOneCopy) {
  absl::StatusOr<ChildProcess> weightd = StartWeightd("weightd", {"--hugepages", "off"});
  ASSERT_TRUE(weightd.ok());
  WaitServing(*weightd);
  std::vector<ChildProcess> workers;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<ChildProcess> w = StartInspect(absl::StrCat("w", i), {"--touch", "--hold"});
    ASSERT_TRUE(w.ok());
    workers.push_back(*std::move(w));
  }
  for (ChildProcess& w : workers) ASSERT_TRUE(w.WaitForOutput("holding", 20s).ok());
  uint64_t pss = ShmPssBytes(weightd->pid(), instance_);
  for (ChildProcess& w : workers) pss += ShmPssBytes(w.pid(), instance_);
  const uint64_t tensors = TensorBytes();
  std::printf("shared-memory PSS of weightd + 3 workers: %llu bytes = %.3f x %llu tensor bytes\n",
              static_cast<unsigned long long>(pss), static_cast<double>(pss) / tensors,
              static_cast<unsigned long long>(tensors));
  // Every worker touched every byte, so private copies would show as ~4x; sharing gives ~1x.
  EXPECT_GE(pss, tensors * 95 / 100);
  EXPECT_LE(pss, tensors * 105 / 100);
  for (ChildProcess& w : workers) EXPECT_EQ(w.Terminate(10s).value_or(-1), 0);
  EXPECT_EQ(weightd->Terminate(10s).value_or(-1), 0);
}

TEST_F(WeightdProcessTest, SecondWeightdForTheInstanceIsRefused) {
  absl::StatusOr<ChildProcess> first = StartWeightd("first");
  ASSERT_TRUE(first.ok());
  WaitServing(*first);
  absl::StatusOr<ChildProcess> second = StartWeightd("second");
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->WaitForExit(10s).value_or(-1), 1);
  EXPECT_NE(second->ReadStderr().find(absl::StrCat("already served by weightd pid ", first->pid())),
            std::string::npos)
      << second->ReadStderr();
  EXPECT_TRUE(first->Running());
  EXPECT_EQ(first->Terminate(10s).value_or(-1), 0);
}

// Runs weightd to completion and returns its exit code and stderr.
struct Outcome {
  int code = -1;
  std::string log;
};

class WeightdBadInputTest : public WeightdProcessTest {
 protected:
  Outcome RunToExit(ChildOptions o) {
    absl::StatusOr<ChildProcess> p = ChildProcess::Start(std::move(o));
    EXPECT_TRUE(p.ok());
    if (!p.ok()) return {};
    Outcome out;
    out.code = p->WaitForExit(20s).value_or(-1);
    out.log = p->ReadStderr();
    EXPECT_TRUE(absl::IsNotFound(shm::ControlSegment::OpenReadOnly(instance_).status()))
        << "a failed weightd left its control segment behind";
    return out;
  }
  Outcome Run() {
    return RunToExit(Options({kWeightd, "--model", model_, "--instance", instance_}, "bad"));
  }
  std::string Shard(int i) const {
    return absl::StrCat(model_, "/model-0000", i, "-of-00002.safetensors");
  }
};

TEST_F(WeightdBadInputTest, MissingFiles) {
  std::filesystem::remove(model_ + "/config.json");
  Outcome o = Run();
  EXPECT_EQ(o.code, 1);
  EXPECT_NE(o.log.find("config.json"), std::string::npos) << o.log;
  model_ = dir_.File("does-not-exist");
  o = Run();
  EXPECT_EQ(o.code, 1);
  EXPECT_NE(o.log.find("does-not-exist"), std::string::npos) << o.log;
}

TEST_F(WeightdBadInputTest, TruncatedShard) {
  std::filesystem::resize_file(Shard(2), std::filesystem::file_size(Shard(2)) / 2);
  const Outcome o = Run();
  EXPECT_EQ(o.code, 1);
  EXPECT_NE(o.log.find("model-00002-of-00002.safetensors"), std::string::npos) << o.log;
}

TEST_F(WeightdBadInputTest, WrongDTypeInHeader) {
  std::fstream f(Shard(1), std::ios::in | std::ios::out | std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  f.read(header.data(), static_cast<std::streamsize>(n));
  const std::string patched = absl::StrReplaceAll(header, {{"\"F8_E4M3\"", "\"F8_E9M9\""}});
  ASSERT_NE(patched, header);
  f.seekp(8);
  f.write(patched.data(), static_cast<std::streamsize>(n));
  f.close();
  const Outcome o = Run();
  EXPECT_EQ(o.code, 1);
  EXPECT_NE(o.log.find("F8_E9M9"), std::string::npos) << o.log;
}

TEST_F(WeightdBadInputTest, ConfigMismatch) {
  const std::string config = absl::StrReplaceAll(
      hmoe::testing::kWeightdTestConfigJson, {{"\"hidden_size\": 256", "\"hidden_size\": 384"}});
  ASSERT_TRUE(WriteFileAtomically(model_ + "/config.json", config).ok());
  const Outcome o = Run();
  EXPECT_EQ(o.code, 1);
  EXPECT_NE(o.log.find("does not match its config.json"), std::string::npos) << o.log;
}

// Issue #16, resource exhaustion: the kernel refuses a data segment its size part-way through
// creating the store (here RLIMIT_FSIZE, which the control segment fits under and a data segment
// does not: ftruncate fails with EFBIG, as it fails with ENOSPC on a full /dev/shm). weightd must
// exit with an error naming the segment, not die of SIGXFSZ, and remove what it had created. A
// full /dev/shm itself cannot be made here without root; the room check that refuses such a store
// up front is WeightDaemonTest.SharedMemoryTooSmallIsAClearErrorAndLeavesNoStore.
TEST_F(WeightdBadInputTest, ASegmentTheKernelRefusesFailsCleanlyWithNoPartialStore) {
  rlimit old_limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  rlimit limit = old_limit;
  limit.rlim_cur = 1 << 20;  // The control segment is well under 1 MiB, a data segment is not.
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limit), 0);  // Inherited by the child...
  absl::StatusOr<ChildProcess> p = ChildProcess::Start(
      Options({kWeightd, "--model", model_, "--instance", instance_, "--hugepages", "off"}, "fsz"));
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old_limit), 0);  // ...not kept by this process.
  ASSERT_TRUE(p.ok()) << p.status();
  const absl::StatusOr<int> code = p->WaitForExit(20s);
  ASSERT_TRUE(code.ok()) << code.status() << p->ReadStderr();  // Exited, not killed by a signal.
  EXPECT_EQ(*code, 1) << p->ReadStderr();
  EXPECT_THAT(p->ReadStderr(),
              ::testing::ContainsRegex("create data segment [0-9]+ .*File too large"));
  EXPECT_TRUE(absl::IsNotFound(shm::ControlSegment::OpenReadOnly(instance_).status()));
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    EXPECT_FALSE(e.path().filename().string().starts_with(absl::StrCat("hmoe.", instance_, ".")))
        << "left behind: " << e.path();
  }
}

TEST_F(WeightdBadInputTest, BadFlags) {
  const Outcome o = RunToExit(Options(
      {kWeightd, "--model", model_, "--instance", instance_, "--hugepages", "4m"}, "flags"));
  EXPECT_EQ(o.code, 2);
  EXPECT_NE(o.log.find("expected auto, 1g, 2m, thp or off"), std::string::npos) << o.log;
}

TEST_F(WeightdBadInputTest, NoPermission) {
  if (::geteuid() != 0) {
    // An unprivileged user cannot read a shard with mode 000.
    ASSERT_EQ(::chmod(Shard(1).c_str(), 0), 0);
    const Outcome o = Run();
    EXPECT_EQ(o.code, 1);
    EXPECT_NE(o.log.find("ermission denied"), std::string::npos) << o.log;
    return;
  }
  // As root, run weightd as nobody. (a) It may not read root's 0700 model directory.
  const std::string nobody_run = dir_.File("nobody-run");
  ASSERT_EQ(::mkdir(nobody_run.c_str(), 0700), 0);
  ASSERT_EQ(::chown(nobody_run.c_str(), 65534, 65534), 0);
  ChildOptions o = Options({kWeightd, "--model", model_, "--instance", instance_}, "nobody-a");
  o.env = {{"HMOE_RUNTIME_DIR", nobody_run}};
  o.uid = 65534;
  o.gid = 65534;
  ASSERT_EQ(::chmod(dir_.path().c_str(), 0711), 0);  // Traversable, so the logs can be written...
  ASSERT_EQ(::chmod(model_.c_str(), 0700), 0);       // ...but the model is root's alone.
  const std::string log_a = dir_.File("nobody-a.err");
  Outcome a = RunToExit(o);
  EXPECT_EQ(a.code, 1);
  EXPECT_NE(a.log.find("ermission denied"), std::string::npos) << a.log;

  // (b) It may not use root's shared memory for the same instance.
  ASSERT_EQ(::chmod(model_.c_str(), 0755), 0);
  for (const auto& entry : std::filesystem::directory_iterator(model_)) {
    ::chmod(entry.path().c_str(), 0644);
  }
  absl::StatusOr<ChildProcess> root_weightd = StartWeightd("root");
  ASSERT_TRUE(root_weightd.ok());
  WaitServing(*root_weightd);
  o.stdout_path = dir_.File("nobody-b.out");
  o.stderr_path = dir_.File("nobody-b.err");
  absl::StatusOr<ChildProcess> p = ChildProcess::Start(o);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->WaitForExit(20s).value_or(-1), 1);
  EXPECT_NE(p->ReadStderr().find("ermission denied"), std::string::npos) << p->ReadStderr();
  EXPECT_NE(p->ReadStderr().find("control segment"), std::string::npos) << p->ReadStderr();
  EXPECT_EQ(root_weightd->Terminate(10s).value_or(-1), 0);
  ::chmod(dir_.path().c_str(), 0700);
}

}  // namespace
}  // namespace hmoe::weightd
