// The CUDA IPC form of the KV hand-off (common/kv_handoff/cuda_ipc_import.h) without a GPU: the
// import logic runs against a fake CUDA runtime whose "GPU memory" is host memory, so every route
// (same GPU, peer GPU, through the host), every refusal, and the closing of the mapping on every
// path are checked here. The real runtime is checked on a GPU machine (label gpu).

#include "common/kv_handoff/cuda_ipc_import.h"

#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include <gtest/gtest.h>

#include "common/kernels/cuda/cuda_backend.h"
#include "common/kv_handoff/kv_handoff.h"

namespace hmoe {
namespace {

KvHandoffShape Shape() {
  KvHandoffShape s;
  s.num_layers = 2;
  s.kv_lora_rank = 8;
  s.rope_dim = 4;
  return s;
}

// What the fake runtime knows and records; owned by the test.
struct FakeGpus {
  struct Buffer {
    std::vector<std::byte> bytes;
    int device = 0;
  };
  std::map<std::string, int> bus_ids;     // visible GPUs: PCI bus id -> ordinal
  std::set<std::pair<int, int>> peers;    // (device, peer) pairs with peer access
  std::map<std::string, Buffer> buffers;  // live exports by handle bytes
  bool size_known = true;
  // Records.
  std::map<const void*, int> open;  // mapping -> device it was opened on
  std::vector<int> opened_on;
  int closes = 0;
  std::vector<int> copies_on;
};

class FakeRuntime final : public CudaIpcRuntime {
 public:
  explicit FakeRuntime(FakeGpus* gpus) : gpus_(gpus) {}

  absl::StatusOr<int> DeviceByPciBusId(const std::string& id) override {
    auto it = gpus_->bus_ids.find(id);
    if (it == gpus_->bus_ids.end()) return absl::NotFoundError("no visible GPU has " + id);
    return it->second;
  }
  bool CanAccessPeer(int device, int peer) override {
    return gpus_->peers.contains({device, peer});
  }
  absl::StatusOr<void*> OpenMemHandle(std::string_view handle, int device) override {
    auto it = gpus_->buffers.find(std::string(handle));
    if (it == gpus_->buffers.end()) {
      return absl::NotFoundError("cudaIpcOpenMemHandle: cudaErrorInvalidResourceHandle");
    }
    if (it->second.device != device && !gpus_->peers.contains({device, it->second.device})) {
      return absl::FailedPreconditionError("cudaIpcOpenMemHandle: cudaErrorPeerAccessUnsupported");
    }
    void* p = it->second.bytes.data();
    gpus_->open[p] = device;
    gpus_->opened_on.push_back(device);
    return p;
  }
  absl::Status CloseMemHandle(void* p, int device) override {
    auto it = gpus_->open.find(p);
    if (it == gpus_->open.end() || it->second != device) {
      return absl::InternalError("close of a mapping that is not open on this device");
    }
    gpus_->open.erase(it);
    ++gpus_->closes;
    return absl::OkStatus();
  }
  absl::StatusOr<size_t> AllocationBytes(const void* p, int) override {
    if (!gpus_->size_known) return absl::UnimplementedError("cuMemGetAddressRange: not offered");
    for (const auto& [h, b] : gpus_->buffers) {
      if (b.bytes.data() == p) return b.bytes.size();
    }
    return absl::InvalidArgumentError("not an allocation");
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes, int device) override {
    gpus_->copies_on.push_back(device);
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }

 private:
  FakeGpus* gpus_;
};

constexpr char kGpu0[] = "0000:01:00.0";
constexpr char kGpu1[] = "0000:41:00.0";

class CudaIpcImportTest : public ::testing::Test {
 protected:
  void SetUp() override { gpus_.bus_ids = {{kGpu0, 0}, {kGpu1, 1}}; }

  // Exports a buffer of `num_tokens` tokens (header + payload with values 0.25 * i) on `device`;
  // returns its handle.
  KvHandleSpec Export(int device, int64_t num_tokens, const std::string& tag = "a") {
    const KvHandoffHeader header = MakeKvHandoffHeader(Shape(), num_tokens);
    FakeGpus::Buffer b;
    b.device = device;
    b.bytes.resize(header.header_bytes + header.payload_bytes);
    std::memcpy(b.bytes.data(), &header, sizeof(header));
    auto* values = reinterpret_cast<float*>(b.bytes.data() + header.header_bytes);
    for (size_t i = 0; i < header.payload_bytes / sizeof(float); ++i) values[i] = 0.25f * i;
    KvHandleSpec spec;
    spec.kind = KvHandleSpec::Kind::kCudaIpc;
    spec.cuda_ipc_handle = std::string(kKvCudaIpcHandleBytes, tag[0]);
    spec.cuda_device = device == 0 ? kGpu0 : kGpu1;
    spec.num_tokens = num_tokens;
    spec.layout_version = kKvHandoffLayoutVersion;
    gpus_.buffers[spec.cuda_ipc_handle] = std::move(b);
    return spec;
  }
  FakeGpus::Buffer& BufferOf(const KvHandleSpec& spec) {
    return gpus_.buffers.at(spec.cuda_ipc_handle);
  }

  std::unique_ptr<KvImporter> Importer(int cuda_device) {
    return NewCudaIpcKvImporter(KvImportTarget{cuda_device}, std::make_unique<FakeRuntime>(&gpus_));
  }

  // The payload matches what Export wrote.
  static void ExpectPayload(const KvImportSource& source, int64_t num_tokens) {
    ASSERT_EQ(source.payload().size(), Shape().PayloadBytes(num_tokens));
    const auto* values = reinterpret_cast<const float*>(source.payload().data());
    for (size_t i = 0; i < source.payload().size() / sizeof(float); ++i) {
      ASSERT_EQ(values[i], 0.25f * i) << i;
    }
  }

  FakeGpus gpus_;
};

TEST(CudaIpcPlanTest, OpensOnTheImportersGpuWhenItCanReadTheBufferElseOnTheExporters) {
  const CudaIpcPlan same = PlanCudaIpcImport(1, 1, false);
  EXPECT_EQ(same.route, CudaIpcRoute::kSameDevice);
  EXPECT_EQ(same.open_device, 1);
  const CudaIpcPlan peer = PlanCudaIpcImport(0, 1, true);
  EXPECT_EQ(peer.route, CudaIpcRoute::kPeer);
  EXPECT_EQ(peer.open_device, 0);
  const CudaIpcPlan no_peer = PlanCudaIpcImport(0, 1, false);
  EXPECT_EQ(no_peer.route, CudaIpcRoute::kViaHost);
  EXPECT_EQ(no_peer.open_device, 1);
  const CudaIpcPlan cpu = PlanCudaIpcImport(-1, 1, true);  // no GPU of its own: peer is moot
  EXPECT_EQ(cpu.route, CudaIpcRoute::kViaHost);
  EXPECT_EQ(cpu.open_device, 1);
}

TEST_F(CudaIpcImportTest, SameGpuLeavesThePayloadOnTheDeviceUntilTheSourceIsDestroyed) {
  const KvHandleSpec spec = Export(1, 5);
  auto importer = Importer(1);
  absl::StatusOr<std::unique_ptr<KvImportSource>> src = importer->Open(spec, Shape());
  ASSERT_TRUE(src.ok()) << src.status();
  EXPECT_TRUE((*src)->payload_on_device());
  EXPECT_EQ((*src)->header().num_tokens, 5u);
  // The payload is the mapped buffer itself, past the header: nothing was copied.
  EXPECT_EQ((*src)->payload().data(), BufferOf(spec).bytes.data() + 64);
  ExpectPayload(**src, 5);
  EXPECT_EQ(gpus_.opened_on, std::vector<int>{1});
  EXPECT_EQ(gpus_.open.size(), 1u);
  EXPECT_NE((*src)->description().find(kGpu1), std::string::npos) << (*src)->description();
  src->reset();  // the decode worker destroys the source before acknowledging
  EXPECT_TRUE(gpus_.open.empty());
  EXPECT_EQ(gpus_.closes, 1);
}

TEST_F(CudaIpcImportTest, CpuAttentionCopiesThePayloadToHostAndClosesAtOnce) {
  const KvHandleSpec spec = Export(1, 3);
  absl::StatusOr<std::unique_ptr<KvImportSource>> src = Importer(-1)->Open(spec, Shape());
  ASSERT_TRUE(src.ok()) << src.status();
  EXPECT_FALSE((*src)->payload_on_device());
  EXPECT_EQ(gpus_.opened_on, std::vector<int>{1});  // opened on the GPU holding the buffer
  EXPECT_TRUE(gpus_.open.empty());                  // and closed before Open returned
  // A host copy: it survives the exporter freeing the buffer.
  gpus_.buffers.clear();
  ExpectPayload(**src, 3);
}

TEST_F(CudaIpcImportTest, AnotherGpuWithoutPeerAccessGoesThroughTheHost) {
  const KvHandleSpec spec = Export(1, 4);
  absl::StatusOr<std::unique_ptr<KvImportSource>> src = Importer(0)->Open(spec, Shape());
  ASSERT_TRUE(src.ok()) << src.status();
  EXPECT_FALSE((*src)->payload_on_device());
  EXPECT_EQ(gpus_.opened_on, std::vector<int>{1});
  EXPECT_EQ(gpus_.copies_on, (std::vector<int>{1, 1}));  // header, then payload, on GPU 1
  EXPECT_TRUE(gpus_.open.empty());
  ExpectPayload(**src, 4);
  EXPECT_NE((*src)->description().find("via host"), std::string::npos);
}

TEST_F(CudaIpcImportTest, APeerGpuMapsTheBufferIntoTheImportersContext) {
  gpus_.peers = {{0, 1}};
  const KvHandleSpec spec = Export(1, 4);
  absl::StatusOr<std::unique_ptr<KvImportSource>> src = Importer(0)->Open(spec, Shape());
  ASSERT_TRUE(src.ok()) << src.status();
  EXPECT_TRUE((*src)->payload_on_device());
  EXPECT_EQ(gpus_.opened_on, std::vector<int>{0});
  ExpectPayload(**src, 4);
  src->reset();
  EXPECT_TRUE(gpus_.open.empty());
}

TEST_F(CudaIpcImportTest, AGpuThisWorkerCannotSeeIsFailedPrecondition) {
  KvHandleSpec spec = Export(1, 2);
  spec.cuda_device = "0000:c1:00.0";
  absl::Status s = Importer(0)->Open(spec, Shape()).status();
  EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
  EXPECT_NE(s.message().find("kv_handle.cuda_device"), std::string::npos) << s;
  EXPECT_NE(s.message().find("not visible"), std::string::npos) << s;
  EXPECT_TRUE(gpus_.opened_on.empty());
}

TEST_F(CudaIpcImportTest, AHandleWhoseExporterIsGoneIsNotFoundAndLeavesNothingOpen) {
  const KvHandleSpec spec = Export(0, 2);
  gpus_.buffers.clear();  // the prefill worker exited (or freed the export after its timeout)
  absl::Status s = Importer(0)->Open(spec, Shape()).status();
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_NE(s.message().find("kv_handle.cuda_ipc_handle"), std::string::npos) << s;
  EXPECT_TRUE(gpus_.open.empty());
}

// The CUDA driver can still open the handle of a buffer its exporter freed (seen on an H100: an
// expired export opened and imported). The exporter clears the magic before it frees the buffer;
// a cleared or foreign magic is NotFound, like a handle the driver refuses.
TEST_F(CudaIpcImportTest, AFreedOrReusedBufferBehindALiveHandleIsNotFound) {
  const KvHandleSpec freed = Export(0, 2, "f");
  std::memcpy(BufferOf(freed).bytes.data(), &kKvHandoffFreedMagic, sizeof(kKvHandoffFreedMagic));
  absl::Status s = Importer(0)->Open(freed, Shape()).status();
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_NE(s.message().find("freed this hand-off"), std::string::npos) << s;

  const KvHandleSpec reused = Export(0, 2, "r");
  std::memset(BufferOf(reused).bytes.data(), 0x5a, 64);  // another allocation's bytes
  s = Importer(0)->Open(reused, Shape()).status();
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_NE(s.message().find("no live hand-off"), std::string::npos) << s;
  EXPECT_TRUE(gpus_.open.empty());
  EXPECT_EQ(gpus_.closes, 2);
}

TEST_F(CudaIpcImportTest, WrongSizesAndShapesAreInvalidArgumentAndCloseTheMapping) {
  auto importer = Importer(0);

  KvHandleSpec short_handle = Export(0, 2, "s");
  short_handle.cuda_ipc_handle.resize(10);
  absl::Status s = importer->Open(short_handle, Shape()).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("kv_handle.cuda_ipc_handle: 10 bytes, expected 64"), std::string::npos)
      << s;

  for (const std::string& bad : std::vector<std::string>{"", "cuda:0", std::string(80, '0')}) {
    KvHandleSpec no_device = Export(0, 2, "d");
    no_device.cuda_device = bad;
    s = importer->Open(no_device, Shape()).status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_NE(s.message().find("kv_handle.cuda_device"), std::string::npos) << s;
  }

  // The buffer is shorter than its header says.
  const KvHandleSpec cut = Export(0, 6, "c");
  BufferOf(cut).bytes.resize(100);
  s = importer->Open(cut, Shape()).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("shorter"), std::string::npos) << s;

  // Not even a header.
  const KvHandleSpec tiny = Export(0, 6, "t");
  BufferOf(tiny).bytes.resize(16);
  s = importer->Open(tiny, Shape()).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("less than its header"), std::string::npos) << s;

  // Another model's cache; another token count.
  const KvHandleSpec other = Export(0, 3, "o");
  KvHandoffShape wider = Shape();
  wider.kv_lora_rank = 16;
  s = importer->Open(other, wider).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("kv_lora_rank 8, expected 16"), std::string::npos) << s;
  KvHandleSpec more = other;
  more.num_tokens = 4;
  s = importer->Open(more, Shape()).status();
  EXPECT_NE(s.message().find("num_tokens 3, expected 4"), std::string::npos) << s;

  EXPECT_EQ(gpus_.opened_on.size(), 4u);  // the buffers that were opened ...
  EXPECT_TRUE(gpus_.open.empty());        // ... were all closed again
  EXPECT_EQ(gpus_.closes, 4);
}

TEST_F(CudaIpcImportTest, WithoutTheDriversSizeTheHeaderIsTrusted) {
  gpus_.size_known = false;
  const KvHandleSpec spec = Export(0, 2);
  absl::StatusOr<std::unique_ptr<KvImportSource>> src = Importer(0)->Open(spec, Shape());
  ASSERT_TRUE(src.ok()) << src.status();
  ExpectPayload(**src, 2);
}

TEST_F(CudaIpcImportTest, SharedMemoryHandlesAreNotThisImportersBusiness) {
  KvHandleSpec shm;
  shm.shm_name = "hmoe-kv-x";
  shm.num_tokens = 1;
  shm.layout_version = kKvHandoffLayoutVersion;
  EXPECT_TRUE(absl::IsInvalidArgument(Importer(0)->Open(shm, Shape()).status()));
}

// The importer the decode worker builds: shared memory as before; CUDA IPC handles reach the CUDA
// backend, which says Unavailable on a build or machine without a GPU.
TEST(KvImporterTest, TheWorkersImporterRoutesEachKindOfHandle) {
  const std::string name = absl::StrCat("hmoe-test-cudaipc-", ::getpid());
  {
    absl::StatusOr<KvHandoffSegment> seg = KvHandoffSegment::Create(name, Shape(), 2);
    ASSERT_TRUE(seg.ok()) << seg.status();
  }
  std::unique_ptr<KvImporter> importer = NewKvImporter(KvImportTarget{});
  KvHandleSpec shm;
  shm.shm_name = name;
  shm.num_tokens = 2;
  shm.layout_version = kKvHandoffLayoutVersion;
  absl::StatusOr<std::unique_ptr<KvImportSource>> src = importer->Open(shm, Shape());
  EXPECT_TRUE(src.ok()) << src.status();
  ASSERT_TRUE(KvHandoffSegment::Remove(name).ok());

  KvHandleSpec gpu;
  gpu.kind = KvHandleSpec::Kind::kCudaIpc;
  gpu.cuda_ipc_handle = std::string(kKvCudaIpcHandleBytes, '\0');
  gpu.cuda_device = "0000:01:00.0";
  gpu.num_tokens = 2;
  gpu.layout_version = kKvHandoffLayoutVersion;
  const absl::Status s = importer->Open(gpu, Shape()).status();
  if (cuda::DeviceCount() == 0) {
    EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  } else {
    EXPECT_FALSE(s.ok());  // no such GPU, or no such allocation
  }
}

}  // namespace
}  // namespace hmoe
