// Issue #4 acceptance 3 on a GPU (label gpu; built with CUDA only): hmoe-prefill-worker on
// cuda:0 exports the prompt's KV cache as a CUDA IPC handle, hmoe-decode-worker imports it —
// into its own GPU's pool (same device) and, with attention on the CPU, through host memory —
// and continues the sequence; 64 greedy tokens agree with the reference forward pass. Also: the
// export is freed after the acknowledgement, an unclaimed one after the timeout (a late import
// of it is NOT_FOUND), and the handle of a prefill worker that died is NOT_FOUND while the
// decode worker serves on. Every test skips, saying why, when no GPU is visible.

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "common/device/device.h"
#include "common/engine/reference/reference_model.h"
#include "common/kernels/cuda/cuda_backend.h"
#include "common/kv_handoff/kv_handoff.h"
#include "common/model/checkpoint.h"
#include "tests/decode_worker/decode_test_util.h"
#include "tests/prefill_worker/handoff_test_util.h"

namespace hmoe::prefill {
namespace {

using ::hmoe::decode::testing::CheckAgreement;
using testing::Admit;
using testing::Eventually;
using testing::Generation;
using testing::HandOff;
using testing::HandOffEnv;
using testing::kTokens;
using testing::PrefillClient;
using testing::PrefillRequest;
using testing::Process;
using testing::Prompt;
namespace dv1 = ::hmoe::decode::v1;

constexpr char kPrefillWorker[] = HMOE_PREFILL_WORKER_PATH;
constexpr char kDecodeWorker[] = HMOE_DECODE_WORKER_PATH;

HandOffEnv* g_env = nullptr;

class CudaHandOffTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (CudaDeviceCount() == 0) return;
    // Notice a worker's GOAWAY promptly (see decode_worker_integration_test.cc).
    ::setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "50", 1);
    g_env = testing::MakeHandOffEnv("tiny").release();
  }
  static void TearDownTestSuite() {
    delete g_env;
    g_env = nullptr;
  }
  void SetUp() override {
    if (CudaDeviceCount() == 0) {
      GTEST_SKIP() << "needs a CUDA GPU (" << cuda::NoDeviceReason()
                   << "): the CUDA IPC hand-off is only unit-tested here";
    }
    ASSERT_NE(g_env, nullptr);
  }

  static std::unique_ptr<Process> StartPrefill(const std::string& tag,
                                               std::vector<std::string> extra = {}) {
    std::vector<std::string> flags = {"--device",
                                      "cuda:0",
                                      "--kv-export",
                                      "cuda-ipc",
                                      "--worker-id",
                                      absl::StrCat("gpu-", ::getpid(), tag),
                                      "--max-prompt-tokens",
                                      "1000"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    return Process::Start(*g_env, kPrefillWorker, "prefill-" + tag, flags);
  }
  static std::unique_ptr<Process> StartDecode(const std::string& tag, const std::string& device) {
    return Process::Start(*g_env, kDecodeWorker, "decode-" + tag,
                          {"--kv-blocks", "64", "--device", device});
  }
};

TEST_F(CudaHandOffTest, GpuHandOffContinuesTheSequenceOnTheGpuAndOnTheCpu) {
  auto prefill = StartPrefill("handoff");
  ASSERT_NE(prefill, nullptr);
  PrefillClient client(*prefill);
  for (const std::string device : {"cuda:0", "cpu"}) {
    SCOPED_TRACE(absl::StrCat("decode worker on ", device));
    auto decode = StartDecode(absl::StrCat("handoff-", device == "cpu" ? "cpu" : "gpu"), device);
    ASSERT_NE(decode, nullptr);
    const std::string id = absl::StrCat("h-", device);
    const std::vector<int32_t> prompt = Prompt(40, static_cast<int>(device.size()));
    v1::PrefillResponse prefilled;
    const grpc::Status s = client.Prefill(PrefillRequest(id, prompt), &prefilled);
    ASSERT_TRUE(s.ok()) << s.error_message() << prefill->child().ReadStderr();
    ASSERT_TRUE(prefilled.kv_handle().has_cuda_ipc_handle());
    EXPECT_EQ(prefilled.kv_handle().cuda_ipc_handle().size(), kKvCudaIpcHandleBytes);
    EXPECT_FALSE(prefilled.kv_handle().cuda_device().empty());
    EXPECT_EQ(prefilled.kv_handle().num_tokens(), 40);
    EXPECT_EQ(client.Status().exports(), 1);

    bool released = false;
    const Generation g =
        Admit(*decode, HandOff(id, prompt, prefilled), [&] { released = client.Release(id).ok(); });
    ASSERT_TRUE(g.status.ok()) << g.status.error_message() << decode->child().ReadStderr();
    EXPECT_TRUE(g.kv_imported_first);
    EXPECT_TRUE(released);
    EXPECT_EQ(client.Status().exports(), 0);  // freed after the ack
    ASSERT_TRUE(g.finished);
    EXPECT_EQ(g.finish.usage().imported_tokens(), 40);
    std::vector<int32_t> tokens = {prefilled.first_token_id()};
    tokens.insert(tokens.end(), g.tokens.begin(), g.tokens.end());
    ASSERT_EQ(tokens.size(), static_cast<size_t>(kTokens));
    auto agreement = CheckAgreement(*g_env->reference, prompt, tokens);
    ASSERT_TRUE(agreement.ok()) << agreement.status();
    EXPECT_TRUE(agreement->ok()) << agreement->detail;
    EXPECT_EQ(decode->Terminate(), 0);
  }
  EXPECT_EQ(prefill->Terminate(), 0);
}

TEST_F(CudaHandOffTest, UnclaimedHandleIsFreedAfterTheTimeoutAndThenNotFound) {
  auto prefill = StartPrefill("timeout", {"--export-timeout-seconds", "1"});
  auto decode = StartDecode("timeout", "cuda:0");
  ASSERT_NE(prefill, nullptr);
  ASSERT_NE(decode, nullptr);
  PrefillClient client(*prefill);
  const std::vector<int32_t> prompt = Prompt(20, 1);
  v1::PrefillResponse prefilled;
  ASSERT_TRUE(client.Prefill(PrefillRequest("t", prompt), &prefilled).ok());
  EXPECT_TRUE(Eventually([&] { return client.Status().exports() == 0; }));
  EXPECT_EQ(client.Status().exports_expired(), 1);
  const Generation late = Admit(*decode, HandOff("t", prompt, prefilled));
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::NOT_FOUND) << late.status.error_message();
  EXPECT_EQ(prefill->Terminate(), 0);
  EXPECT_EQ(decode->Terminate(), 0);
}

TEST_F(CudaHandOffTest, HandleOfAPrefillWorkerThatDiedIsNotFound) {
  auto prefill = StartPrefill("dead");
  auto decode = StartDecode("dead", "cuda:0");
  ASSERT_NE(prefill, nullptr);
  ASSERT_NE(decode, nullptr);
  PrefillClient client(*prefill);
  const std::vector<int32_t> prompt = Prompt(20, 2);
  v1::PrefillResponse prefilled;
  ASSERT_TRUE(client.Prefill(PrefillRequest("d", prompt), &prefilled).ok());
  ASSERT_TRUE(prefill->child().Signal(SIGKILL).ok());
  ASSERT_TRUE(prefill->child().Wait(std::chrono::seconds(10)).ok());
  const Generation g = Admit(*decode, HandOff("d", prompt, prefilled));
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::NOT_FOUND) << g.status.error_message();
  // The decode worker serves on.
  dv1::AdmitRequest alone = testing::AdmitRequest("alone", prompt);
  const Generation ok = Admit(*decode, alone);
  EXPECT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(ok.tokens.size(), static_cast<size_t>(kTokens));
  EXPECT_EQ(decode->Terminate(), 0);
}

}  // namespace
}  // namespace hmoe::prefill
