// WeightDaemon in-process: load, attach, NUMA slicing, adoption, reloads and bad input.

#include "weightd/weight_daemon.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/model/checkpoint.h"
#include "common/model/gguf_source.h"
#include "common/model/tensor_map.h"
#include "common/shm/control_segment.h"
#include "common/shm/layout.h"
#include "common/shm/weight_store.h"
#include "tests/weightd/test_checkpoint.h"
#include "tools/gguf_model_writer.h"
#include "tools/model_writer.h"

namespace hmoe::weightd {
namespace {

using ::hmoe::testing::TempDir;
using ::hmoe::testing::UniqueInstanceName;
using ::hmoe::testing::WriteTestCheckpoint;

std::span<const std::byte> Bytes(const TensorView& v) { return {v.data, v.size_bytes}; }

bool SameBytes(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0);
}

// The slice [begin, end) of dimension `dim` of a 2-D row-major tensor, computed plainly.
std::vector<std::byte> Slice2D(const TensorView& t, int dim, int64_t begin, int64_t end) {
  const size_t esize = DTypeSize(t.dtype);
  const int64_t rows = t.shape[0], cols = t.shape[1];
  std::vector<std::byte> out;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const bool in = dim == 0 ? (r >= begin && r < end) : (c >= begin && c < end);
      if (!in) continue;
      const std::byte* p = t.data + (r * cols + c) * esize;
      out.insert(out.end(), p, p + esize);
    }
  }
  return out;
}

class WeightDaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    model_ = dir_.File("model");
    ASSERT_TRUE(WriteTestCheckpoint(model_).ok());
    instance_ = UniqueInstanceName("wdtest");
    // Lock files go to a private runtime dir that the temp dir removes.
    const std::string run = dir_.File("run");
    ASSERT_EQ(::mkdir(run.c_str(), 0700), 0);
    ASSERT_EQ(::setenv("HMOE_RUNTIME_DIR", run.c_str(), 1), 0);
  }
  void TearDown() override {
    absl::Status s = shm::RemoveInstance(instance_);
    EXPECT_TRUE(s.ok() || absl::IsNotFound(s)) << s;
  }

  DaemonOptions Options() const {
    DaemonOptions o;
    o.model_dir = model_;
    o.instance = instance_;
    o.load_threads = 2;
    o.load_chunk_bytes = 64 << 10;  // Many jobs even for a tiny model.
    return o;
  }

  std::unique_ptr<WeightDaemon> StartDaemon(const DaemonOptions& o) {
    absl::StatusOr<std::unique_ptr<WeightDaemon>> d = WeightDaemon::Create(o);
    EXPECT_TRUE(d.ok()) << d.status();
    if (!d.ok()) return nullptr;
    absl::Status s = (*d)->LoadOrAdopt();
    EXPECT_TRUE(s.ok()) << s;
    return *std::move(d);
  }

  TempDir dir_;
  std::string model_;
  std::string instance_;
};

TEST_F(WeightDaemonTest, LoadThenAttachSeesEveryTensorByteEqual) {
  std::unique_ptr<WeightDaemon> daemon = StartDaemon(Options());
  ASSERT_NE(daemon, nullptr);
  const DaemonStatus st = daemon->status();
  EXPECT_EQ(st.state, DaemonState::kReady);
  EXPECT_FALSE(st.adopted);
  EXPECT_EQ(st.generation, 1u);

  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(model_);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(st.bytes_read_from_checkpoint, (*ckpt)->total_tensor_bytes());
  EXPECT_EQ(st.bytes_loaded, (*ckpt)->total_tensor_bytes());

  absl::StatusOr<std::unique_ptr<shm::WeightStore>> store = shm::WeightStore::Attach(instance_);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->identity(), shm::ComputeModelIdentity(**ckpt));
  EXPECT_EQ((*store)->TensorNames(), (*ckpt)->TensorNames());
  for (const std::string& name : (*ckpt)->TensorNames()) {
    absl::StatusOr<TensorView> want = (*ckpt)->GetTensor(name);
    absl::StatusOr<TensorView> got = (*store)->GetTensor(name);
    ASSERT_TRUE(want.ok() && got.ok()) << name;
    EXPECT_EQ(got->dtype, want->dtype) << name;
    EXPECT_EQ(got->shape, want->shape) << name;
    EXPECT_TRUE(SameBytes(Bytes(*got), Bytes(*want))) << name;
  }
  // FP8 weights come with their block scales through the WeightSource interface.
  const std::string expert = "model.layers.1.mlp.experts.3.down_proj.weight";
  absl::StatusOr<Weight> w = (*store)->GetWeight(expert);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(w->has_scale);
  EXPECT_EQ(w->scale_inv.name, expert + "_scale_inv");
  EXPECT_EQ((*store)->manifest().Find(expert)->scale_name, expert + "_scale_inv");
  ASSERT_TRUE(daemon->Shutdown(/*remove_segments=*/true).ok());
  EXPECT_TRUE(absl::IsNotFound(shm::ControlSegment::OpenReadOnly(instance_).status()));
  // The attached store keeps valid mappings after removal.
  absl::StatusOr<TensorView> still = (*store)->GetTensor(expert);
  ASSERT_TRUE(still.ok());
  EXPECT_TRUE(SameBytes(Bytes(*still), Bytes(*(*ckpt)->GetTensor(expert))));
}

TEST_F(WeightDaemonTest, TwoSlicesReassembleToTheOriginalTensorsExactly) {
  DaemonOptions o = Options();
  o.numa_slices = 2;
  o.dense_policy = shm::DensePolicy::kReplicate;
  std::unique_ptr<WeightDaemon> daemon = StartDaemon(o);
  ASSERT_NE(daemon, nullptr);
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(model_);
  ASSERT_TRUE(ckpt.ok());
  absl::StatusOr<std::unique_ptr<shm::WeightStore>> store = shm::WeightStore::Attach(instance_);
  ASSERT_TRUE(store.ok()) << store.status();
  const shm::Manifest& m = (*store)->manifest();
  EXPECT_EQ(m.num_slices, 2u);
  // Two dense replicas, then two expert slices.
  ASSERT_EQ(m.segments.size(), 4u);
  EXPECT_EQ(m.segments[2].role, shm::SegmentRole::kExpertSlice);

  int sliced = 0;
  for (const std::string& name : (*ckpt)->TensorNames()) {
    const TensorView want = *(*ckpt)->GetTensor(name);
    const shm::TensorEntry* e = m.Find(name);
    ASSERT_NE(e, nullptr) << name;
    absl::StatusOr<std::vector<shm::TensorPartView>> parts = (*store)->GetParts(name);
    ASSERT_TRUE(parts.ok());
    ASSERT_EQ(parts->size(), 2u) << name;
    if (e->placement == shm::Placement::kSliced) {
      ++sliced;
      EXPECT_FALSE(e->contiguous);
      const bool is_scale = name.ends_with("_scale_inv");
      const int dim = name.find("down_proj") != std::string::npos ? 1 : 0;
      for (const shm::TensorPartView& p : *parts) {
        EXPECT_EQ(p.part.split_dim, dim) << name;
        EXPECT_EQ(p.part.segment, 2 + p.part.slice) << name;
        // Slices start at FP8 block boundaries: 384 = [0, 128) + [128, 384); scales [0,1) + [1,3).
        const int64_t unit = is_scale ? 1 : 128;
        EXPECT_EQ(p.part.begin, p.part.slice == 0 ? 0 : unit) << name;
        EXPECT_TRUE(SameBytes(Bytes(p.view), Slice2D(want, dim, p.part.begin, p.part.end)))
            << name << " slice " << p.part.slice;
      }
      std::vector<std::byte> assembled(e->size_bytes);
      ASSERT_TRUE(shm::AssembleFromParts(*e, *parts, assembled).ok());
      EXPECT_TRUE(SameBytes(assembled, Bytes(want))) << name;
    } else {
      EXPECT_EQ(e->placement, shm::Placement::kReplicated) << name;
      for (const shm::TensorPartView& p : *parts) {
        EXPECT_TRUE(SameBytes(Bytes(p.view), Bytes(want))) << name << " replica " << p.part.slice;
      }
    }
    // GetTensor (the WeightSource view) returns the whole tensor either way.
    absl::StatusOr<TensorView> got = (*store)->GetTensor(name);
    ASSERT_TRUE(got.ok());
    EXPECT_TRUE(SameBytes(Bytes(*got), Bytes(want))) << name;
  }
  // 1 MoE layer x 4 experts x 3 matrices x (weight + scale).
  EXPECT_EQ(sliced, 24);
  EXPECT_TRUE(daemon->Shutdown(true).ok());
}

// Issue 18: a GGUF is served in its GGUF encoding (block-type tensors byte for byte as the file
// holds them; kv_b_proj dequantized), the GGUF's config as the store's config.json, in two NUMA
// slices (whole experts per slice), and adopted on restart.
TEST_F(WeightDaemonTest, AGgufIsServedInItsGgufEncodingAndAdopted) {
  absl::StatusOr<ModelPreset> preset = GetPreset("tiny");
  ASSERT_TRUE(preset.ok());
  ASSERT_TRUE(WriteGgufModel(*preset, dir_.File("gguf"), GgufWriteOptions{}).ok());
  DaemonOptions o = Options();
  o.model_dir = dir_.File("gguf/model.gguf");
  o.numa_slices = 2;
  std::unique_ptr<WeightDaemon> daemon = StartDaemon(o);
  ASSERT_NE(daemon, nullptr);
  absl::StatusOr<std::unique_ptr<GgufCheckpoint>> gguf = GgufCheckpoint::Open(o.model_dir);
  ASSERT_TRUE(gguf.ok()) << gguf.status();
  EXPECT_EQ(daemon->status().bytes_loaded, (*gguf)->total_tensor_bytes());
  absl::StatusOr<std::unique_ptr<shm::WeightStore>> store = shm::WeightStore::Attach(instance_);
  ASSERT_TRUE(store.ok()) << store.status();
  EXPECT_EQ((*store)->manifest().config_json, (*gguf)->config_json());
  EXPECT_EQ((*store)->TensorNames(), (*gguf)->TensorNames());
  int block_tensors = 0;
  for (const std::string& name : (*gguf)->TensorNames()) {
    absl::StatusOr<TensorView> want = (*gguf)->GetTensor(name);
    absl::StatusOr<TensorView> got = (*store)->GetTensor(name);
    ASSERT_TRUE(want.ok() && got.ok()) << name;
    EXPECT_EQ(got->dtype, want->dtype) << name;
    EXPECT_EQ(got->shape, want->shape) << name;
    EXPECT_TRUE(SameBytes(Bytes(*got), Bytes(*want))) << name;
    block_tensors += IsBlockDType(got->dtype) ? 1 : 0;
  }
  EXPECT_GT(block_tensors, 100);
  // Experts 0 and 1 of a layer lie whole in the two slices.
  const shm::TensorEntry* e0 = (*store)->manifest().Find(ExpertTensorName(1, 0, kGateProj));
  const shm::TensorEntry* e1 = (*store)->manifest().Find(ExpertTensorName(1, 1, kGateProj));
  ASSERT_TRUE(e0 != nullptr && e1 != nullptr);
  ASSERT_EQ(e0->parts.size(), 1u);
  EXPECT_NE(e0->parts[0].segment, e1->parts[0].segment);
  daemon.reset();  // dies without Shutdown
  std::unique_ptr<WeightDaemon> second = StartDaemon(o);
  ASSERT_NE(second, nullptr);
  EXPECT_TRUE(second->status().adopted);
  EXPECT_EQ(second->status().bytes_read_from_checkpoint, 0u);
  EXPECT_TRUE(second->Shutdown(true).ok());
}

TEST_F(WeightDaemonTest, RestartAdoptsWithoutReadingTheCheckpoint) {
  std::unique_ptr<WeightDaemon> first = StartDaemon(Options());
  ASSERT_NE(first, nullptr);
  absl::StatusOr<std::unique_ptr<shm::WeightStore>> worker = shm::WeightStore::Attach(instance_);
  ASSERT_TRUE(worker.ok());
  const std::string name = "model.embed_tokens.weight";
  const std::vector<std::byte> before(Bytes(*(*worker)->GetTensor(name)).begin(),
                                      Bytes(*(*worker)->GetTensor(name)).end());
  first.reset();  // Dies without Shutdown (as after kill -9, the lock is released).

  std::unique_ptr<WeightDaemon> second = StartDaemon(Options());
  ASSERT_NE(second, nullptr);
  const DaemonStatus st = second->status();
  EXPECT_EQ(st.state, DaemonState::kReady);
  EXPECT_TRUE(st.adopted);
  EXPECT_EQ(st.adopt_count, 1u);
  EXPECT_EQ(st.generation, 1u);
  EXPECT_EQ(st.bytes_read_from_checkpoint, 0u);
  EXPECT_EQ((*worker)->control_header().owner_pid, ::getpid());
  EXPECT_EQ((*worker)->control_header().adopt_count, 1u);
  EXPECT_TRUE(SameBytes(Bytes(*(*worker)->GetTensor(name)), before));
  absl::StatusOr<std::unique_ptr<shm::WeightStore>> again = shm::WeightStore::Attach(instance_);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->generation(), 1u);
  EXPECT_TRUE(second->Shutdown(true).ok());
}

TEST_F(WeightDaemonTest, ReloadsWhenTheModelChanges) {
  std::unique_ptr<WeightDaemon> first = StartDaemon(Options());
  ASSERT_NE(first, nullptr);
  absl::StatusOr<std::unique_ptr<shm::WeightStore>> old_worker =
      shm::WeightStore::Attach(instance_);
  ASSERT_TRUE(old_worker.ok());
  const shm::ModelIdentity old_identity = (*old_worker)->identity();
  first.reset();

  // Same tensors, different config.json: a different model identity.
  hmoe::testing::TestCheckpointOptions other;
  other.config_json = absl::StrReplaceAll(other.config_json,
                                          {{"\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": 1e-05"}});
  ASSERT_NE(other.config_json, hmoe::testing::kWeightdTestConfigJson);
  ASSERT_TRUE(WriteTestCheckpoint(model_, other).ok());
  std::unique_ptr<WeightDaemon> second = StartDaemon(Options());
  ASSERT_NE(second, nullptr);
  EXPECT_FALSE(second->status().adopted);
  EXPECT_EQ(second->status().generation, 2u);
  EXPECT_GT(second->status().bytes_read_from_checkpoint, 0u);
  absl::StatusOr<std::unique_ptr<shm::WeightStore>> worker = shm::WeightStore::Attach(instance_);
  ASSERT_TRUE(worker.ok());
  EXPECT_NE((*worker)->identity(), old_identity);
  // A worker attached to the old store still reads it.
  EXPECT_TRUE((*old_worker)->GetTensor("model.norm.weight").ok());
  EXPECT_TRUE(second->Shutdown(true).ok());
}

TEST_F(WeightDaemonTest, ReloadsWhenTheLayoutChanges) {
  std::unique_ptr<WeightDaemon> first = StartDaemon(Options());
  ASSERT_NE(first, nullptr);
  first.reset();
  DaemonOptions o = Options();
  o.numa_slices = 2;
  std::unique_ptr<WeightDaemon> second = StartDaemon(o);
  ASSERT_NE(second, nullptr);
  EXPECT_FALSE(second->status().adopted);
  EXPECT_EQ(second->status().num_slices, 2u);
  EXPECT_TRUE(second->Shutdown(true).ok());
}

TEST_F(WeightDaemonTest, SecondDaemonForTheSameInstanceIsRefused) {
  absl::StatusOr<std::unique_ptr<WeightDaemon>> first = WeightDaemon::Create(Options());
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::unique_ptr<WeightDaemon>> second = WeightDaemon::Create(Options());
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(second.status())) << second.status();
  EXPECT_NE(second.status().message().find("already served by weightd pid"), std::string::npos)
      << second.status();
}

TEST_F(WeightDaemonTest, OrphanedSegmentFilesAreReplaced) {
  // A weightd that died between creating a file and recording it leaves an orphan by this name.
  const std::string orphan = shm::DataSegmentFileName(instance_, 1, 0);
  const int fd = ::shm_open(orphan.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ::close(fd);
  std::unique_ptr<WeightDaemon> daemon = StartDaemon(Options());
  ASSERT_NE(daemon, nullptr);
  EXPECT_TRUE(shm::WeightStore::Attach(instance_).ok());
  EXPECT_TRUE(daemon->Shutdown(true).ok());
  EXPECT_FALSE(std::filesystem::exists("/dev/shm/" + orphan));
}

TEST_F(WeightDaemonTest, CancelledLoadLeavesNothingBehind) {
  absl::StatusOr<std::unique_ptr<WeightDaemon>> d = WeightDaemon::Create(Options());
  ASSERT_TRUE(d.ok());
  std::atomic<bool> cancel{true};
  absl::Status s = (*d)->LoadOrAdopt(&cancel);
  EXPECT_TRUE(absl::IsCancelled(s)) << s;
  EXPECT_EQ((*d)->status().state, DaemonState::kFailed);
  EXPECT_TRUE(absl::IsNotFound(shm::ControlSegment::OpenReadOnly(instance_).status()));
}

// Files of the instance in /dev/shm (control and data segments).
std::vector<std::string> ShmFilesOf(const std::string& instance) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    const std::string name = e.path().filename().string();
    if (name.starts_with(absl::StrCat("hmoe.", instance, "."))) out.push_back(name);
  }
  return out;
}

// Issue #16, resource exhaustion: a /dev/shm (and hugepage pools) too small for the weights. The
// room is injected (resizing a tmpfs needs root); what runs is the daemon's real load path with
// the real check, before any segment exists.
TEST_F(WeightDaemonTest, SharedMemoryTooSmallIsAClearErrorAndLeavesNoStore) {
  DaemonOptions o = Options();
  o.hugepages = shm::HugePageMode::kAuto;
  o.shared_memory_room = shm::SharedMemoryRoom{
      .shm_free_bytes = 1 << 20, .hugetlb_2m_free_bytes = 2 << 20, .hugetlb_1g_free_bytes = 0};
  absl::StatusOr<std::unique_ptr<WeightDaemon>> d = WeightDaemon::Create(o);
  ASSERT_TRUE(d.ok()) << d.status();
  const absl::Status s = (*d)->LoadOrAdopt();
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  // The test checkpoint's segments round up to at least 2 x 2 MiB; 1 MiB of /dev/shm + 2 MiB of
  // hugepages are named as what there is.
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("the store needs "));
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("/dev/shm has 1.0 MiB free"));
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("2.0 MiB (2 MiB pages)"));
  EXPECT_EQ((*d)->status().state, DaemonState::kFailed);
  EXPECT_TRUE(absl::IsNotFound(shm::ControlSegment::OpenReadOnly(instance_).status()));
  EXPECT_THAT(ShmFilesOf(instance_), ::testing::IsEmpty());

  // Enough room: the same daemon options load.
  d->reset();  // Releases the instance lock.
  o.shared_memory_room->shm_free_bytes = uint64_t{1} << 40;
  EXPECT_NE(StartDaemon(o), nullptr);
}

// Bad input: each a clear error naming the problem, and nothing left in shared memory.
class BadCheckpointTest : public WeightDaemonTest {
 protected:
  absl::Status Load() {
    absl::StatusOr<std::unique_ptr<WeightDaemon>> d = WeightDaemon::Create(Options());
    if (!d.ok()) return d.status();
    absl::Status s = (*d)->LoadOrAdopt();
    EXPECT_TRUE(absl::IsNotFound(shm::ControlSegment::OpenReadOnly(instance_).status()));
    return s;
  }
  std::string Shard(int i) const {
    return absl::StrCat(model_, "/model-0000", i, "-of-00002.safetensors");
  }
  // Replaces every occurrence of `from` with `to` (same length) in the shard's JSON header.
  void PatchHeader(const std::string& path, const std::string& from, const std::string& to) {
    ASSERT_EQ(from.size(), to.size());
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    uint64_t n = 0;
    f.read(reinterpret_cast<char*>(&n), 8);
    std::string header(n, '\0');
    f.read(header.data(), static_cast<std::streamsize>(n));
    const std::string patched = absl::StrReplaceAll(header, {{from, to}});
    ASSERT_NE(patched, header) << "no " << from << " in " << path;
    f.seekp(8);
    f.write(patched.data(), static_cast<std::streamsize>(n));
  }
};

TEST_F(BadCheckpointTest, MissingDirectory) {
  model_ = dir_.File("nope");
  absl::Status s = Load();
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_NE(s.message().find("nope"), std::string::npos) << s;
}

TEST_F(BadCheckpointTest, MissingShard) {
  ASSERT_EQ(::unlink(Shard(2).c_str()), 0);
  absl::Status s = Load();
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_NE(s.message().find("model-00002-of-00002.safetensors"), std::string::npos) << s;
}

TEST_F(BadCheckpointTest, TruncatedShard) {
  const auto size = std::filesystem::file_size(Shard(1));
  std::filesystem::resize_file(Shard(1), size - 1000);
  absl::Status s = Load();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("model-00001-of-00002.safetensors"), std::string::npos) << s;
}

TEST_F(BadCheckpointTest, UnknownDTypeInHeader) {
  PatchHeader(Shard(1), "\"BF16\"", "\"XF16\"");
  absl::Status s = Load();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("XF16"), std::string::npos) << s;
}

TEST_F(BadCheckpointTest, WrongDTypeForTheTensor) {
  // Block scales must be F32; I32 has the same size, so only the tensor map notices.
  PatchHeader(Shard(1), "\"F32\"", "\"I32\"");
  absl::Status s = Load();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("does not match its config.json"), std::string::npos) << s;
}

TEST_F(BadCheckpointTest, ConfigDoesNotMatchTheTensors) {
  const std::string config =
      absl::StrReplaceAll(hmoe::testing::kWeightdTestConfigJson,
                          {{"\"intermediate_size\": 512", "\"intermediate_size\": 640"}});
  ASSERT_TRUE(WriteFileAtomically(model_ + "/config.json", config).ok());
  absl::Status s = Load();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("does not match its config.json"), std::string::npos) << s;
  EXPECT_NE(s.message().find("mlp.gate_proj.weight"), std::string::npos) << s;
}

}  // namespace
}  // namespace hmoe::weightd
