// common/shm: identity hashing, manifest format, layout planning, SysV data segments, the control
// segment, and WeightStore's checks (the end-to-end load/attach path is in tests/weightd).

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include <gtest/gtest.h>

#include "common/shm/control_segment.h"
#include "common/shm/data_segment.h"
#include "common/shm/hugepages.h"
#include "common/shm/layout.h"
#include "common/shm/manifest.h"
#include "common/shm/model_identity.h"
#include "common/shm/shm_names.h"
#include "common/shm/weight_store.h"

namespace hmoe::shm {
namespace {

std::string Instance(const std::string& what) {
  static int counter = 0;
  return absl::StrCat("shmtest-", what, "-", ::getpid(), "-", ++counter);
}

std::span<const std::byte> AsBytes(std::string_view s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

// Runs `fn` in a forked child; returns the signal that killed it, or 0 if it exited normally.
template <typename Fn>
int SignalOfChild(Fn fn) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::signal(SIGSEGV, SIG_DFL);  // Sanitizers install their own handler; we want the signal.
    fn();
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFSIGNALED(status) ? WTERMSIG(status) : 0;
}

TEST(Fnv1a128Test, MatchesPublishedVectors) {
  Fnv1a128 empty;
  EXPECT_EQ((ModelIdentity{empty.hi(), empty.lo()}).ToString(), "6c62272e07bb014262b821756295c58d");
  Fnv1a128 a;
  a.Update(std::string_view("a"));
  EXPECT_EQ((ModelIdentity{a.hi(), a.lo()}).ToString(), "d228cb696f1a8caf78912b704e4a8964");
  Fnv1a128 foobar;
  foobar.Update(std::string_view("foo"));
  foobar.Update(std::string_view("bar"));  // Streaming equals one call.
  EXPECT_EQ((ModelIdentity{foobar.hi(), foobar.lo()}).ToString(),
            "343e1662793c64bf6f0d3597ba446f18");
}

TEST(Checksum64Test, ChangesWithAnyByteAndLength) {
  std::string s(1000, 'x');
  const uint64_t base = Checksum64(AsBytes(s));
  for (size_t i : {size_t{0}, size_t{7}, size_t{8}, size_t{999}}) {
    std::string t = s;
    t[i] = 'y';
    EXPECT_NE(Checksum64(AsBytes(t)), base) << i;
  }
  EXPECT_NE(Checksum64(AsBytes(s + std::string(1, '\0'))), base);
}

std::vector<TensorIndexEntry> SmallIndex() {
  return {
      {"model.embed_tokens.weight", DType::kBF16, {64, 256}, 64 * 256 * 2},
      {"model.layers.1.mlp.experts.0.down_proj.weight", DType::kF8E4M3, {256, 384}, 256 * 384},
      {"model.layers.1.mlp.experts.0.down_proj.weight_scale_inv", DType::kF32, {2, 3}, 24},
      {"model.layers.1.mlp.experts.0.up_proj.weight", DType::kF8E4M3, {384, 256}, 384 * 256},
      {"model.layers.1.mlp.experts.0.up_proj.weight_scale_inv", DType::kF32, {3, 2}, 24},
      {"model.layers.1.mlp.shared_experts.up_proj.weight", DType::kF8E4M3, {384, 256}, 384 * 256},
      {"model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv", DType::kF32, {3, 2}, 24},
      {"model.norm.weight", DType::kBF16, {256}, 512},
  };
}

TEST(ModelIdentityTest, DependsOnConfigAndIndexButNotOrder) {
  const std::vector<TensorIndexEntry> index = SmallIndex();
  std::vector<TensorIndexEntry> reversed(index.rbegin(), index.rend());
  const ModelIdentity id = ComputeModelIdentity("{}", index);
  EXPECT_EQ(ComputeModelIdentity("{}", reversed), id);
  EXPECT_NE(ComputeModelIdentity("{ }", index), id);
  std::vector<TensorIndexEntry> changed = index;
  changed[0].shape = {128, 128};  // Same byte size, different shape.
  EXPECT_NE(ComputeModelIdentity("{}", changed), id);
  changed = index;
  changed[7].dtype = DType::kF16;
  EXPECT_NE(ComputeModelIdentity("{}", changed), id);
  changed = index;
  changed[7].name = "model.norm.weighs";
  EXPECT_NE(ComputeModelIdentity("{}", changed), id);
}

TEST(LayoutTest, ClassifiesRoutedExpertsOnly) {
  EXPECT_EQ(ClassifyExpertTensor("model.layers.3.mlp.experts.17.gate_proj.weight"),
            ExpertMatrix::kGateUp);
  EXPECT_EQ(ClassifyExpertTensor("model.layers.3.mlp.experts.17.up_proj.weight_scale_inv"),
            ExpertMatrix::kGateUp);
  EXPECT_EQ(ClassifyExpertTensor("model.layers.60.mlp.experts.255.down_proj.weight"),
            ExpertMatrix::kDown);
  EXPECT_EQ(ClassifyExpertTensor("model.layers.3.mlp.shared_experts.down_proj.weight"),
            ExpertMatrix::kNone);
  EXPECT_EQ(ClassifyExpertTensor("model.layers.3.mlp.gate.weight"), ExpertMatrix::kNone);
  EXPECT_EQ(ClassifyExpertTensor("model.layers.0.mlp.down_proj.weight"), ExpertMatrix::kNone);
  EXPECT_EQ(ClassifyExpertTensor("model.layers.x.mlp.experts.1.down_proj.weight"),
            ExpertMatrix::kNone);
}

TEST(LayoutTest, SliceRangesFollowBlockBoundaries) {
  using R = std::pair<int64_t, int64_t>;
  EXPECT_EQ(SliceRange(2048, 128, 2, 0), R(0, 1024));
  EXPECT_EQ(SliceRange(2048, 128, 2, 1), R(1024, 2048));
  EXPECT_EQ(SliceRange(384, 128, 2, 0), R(0, 128));
  EXPECT_EQ(SliceRange(384, 128, 2, 1), R(128, 384));
  EXPECT_EQ(SliceRange(300, 128, 3, 2), R(256, 300));  // Partial last block.
  EXPECT_EQ(SliceRange(100, 128, 2, 0), R(0, 0));      // Fewer blocks than slices.
  EXPECT_EQ(SliceRange(100, 128, 2, 1), R(0, 100));
  EXPECT_EQ(SliceRange(16, 1, 4, 3), R(12, 16));  // Scale blocks.
  EXPECT_EQ(SliceRange(2048, 128, 1, 0), R(0, 2048));
}

TEST(LayoutTest, SlicesExpertsAndKeepsPartsInsideTheirSegments) {
  LayoutOptions o;
  o.num_slices = 2;
  o.slice_nodes = {0, 1};
  o.dense_node = -1;
  absl::StatusOr<Manifest> m = PlanLayout(SmallIndex(), o);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->segments.size(), 3u);
  EXPECT_EQ(m->segments[0].role, SegmentRole::kDense);
  EXPECT_EQ(m->segments[1].numa_node, 0);
  EXPECT_EQ(m->segments[2].numa_node, 1);

  const TensorEntry* down = m->Find("model.layers.1.mlp.experts.0.down_proj.weight");
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->placement, Placement::kSliced);
  EXPECT_FALSE(down->contiguous);
  EXPECT_EQ(down->scale_name, "model.layers.1.mlp.experts.0.down_proj.weight_scale_inv");
  ASSERT_EQ(down->parts.size(), 2u);
  EXPECT_EQ(down->parts[0].shape, (std::vector<int64_t>{256, 128}));
  EXPECT_EQ(down->parts[1].shape, (std::vector<int64_t>{256, 256}));
  EXPECT_EQ(down->parts[1].split_dim, 1);
  const TensorEntry* up_scale = m->Find("model.layers.1.mlp.experts.0.up_proj.weight_scale_inv");
  ASSERT_NE(up_scale, nullptr);
  EXPECT_EQ(up_scale->parts[0].shape, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(up_scale->parts[1].shape, (std::vector<int64_t>{2, 2}));
  const TensorEntry* shared = m->Find("model.layers.1.mlp.shared_experts.up_proj.weight");
  ASSERT_NE(shared, nullptr);
  EXPECT_EQ(shared->placement, Placement::kDense);
  EXPECT_TRUE(shared->contiguous);

  // No two parts overlap; every part is aligned; the segments cover them.
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> ranges(m->segments.size());
  for (const TensorEntry& t : m->tensors) {
    for (const TensorPart& p : t.parts) {
      EXPECT_EQ(p.offset % PlacementAlignment(p.size_bytes), 0u) << t.name;
      EXPECT_LE(p.offset + p.size_bytes, m->segments[p.segment].used_bytes) << t.name;
      ranges[p.segment].push_back({p.offset, p.offset + p.size_bytes});
    }
  }
  for (auto& r : ranges) {
    std::sort(r.begin(), r.end());
    for (size_t i = 1; i < r.size(); ++i) EXPECT_LE(r[i - 1].second, r[i].first);
  }
}

TEST(LayoutTest, ScaleThatDoesNotMatchItsWeightIsRejected) {
  std::vector<TensorIndexEntry> index = SmallIndex();
  index[2].shape = {2, 4};  // down_proj [256, 384] has 3 column blocks, not 4.
  index[2].size_bytes = 32;
  LayoutOptions o;
  o.num_slices = 2;
  o.slice_nodes = {-1, -1};
  absl::StatusOr<Manifest> m = PlanLayout(index, o);
  EXPECT_TRUE(absl::IsInvalidArgument(m.status())) << m.status();
}

TEST(ManifestTest, SerializeParseRoundTrips) {
  LayoutOptions o;
  o.num_slices = 2;
  o.slice_nodes = {0, 0};
  o.dense_policy = DensePolicy::kReplicate;
  o.replica_nodes = {0, 0};
  absl::StatusOr<Manifest> m = PlanLayout(SmallIndex(), o);
  ASSERT_TRUE(m.ok());
  m->identity = {1, 2};
  m->generation = 7;
  m->model_dir = "/models/x";
  m->config_json = "{\"a\": 1}";
  const std::string bytes = m->Serialize();
  absl::StatusOr<Manifest> parsed = Manifest::Parse(AsBytes(bytes));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, *m);
}

TEST(ManifestTest, EveryTruncationIsDataLoss) {
  absl::StatusOr<Manifest> m = PlanLayout(SmallIndex(), LayoutOptions{});
  ASSERT_TRUE(m.ok());
  const std::string bytes = m->Serialize();
  for (size_t n = 0; n < bytes.size(); ++n) {
    absl::StatusOr<Manifest> parsed =
        Manifest::Parse(AsBytes(std::string_view(bytes).substr(0, n)));
    ASSERT_TRUE(absl::IsDataLoss(parsed.status())) << n << ": " << parsed.status();
  }
  EXPECT_TRUE(absl::IsDataLoss(Manifest::Parse(AsBytes(bytes + "x")).status()));
  std::string bad_magic = bytes;
  bad_magic[0] ^= 1;
  EXPECT_TRUE(absl::IsDataLoss(Manifest::Parse(AsBytes(bad_magic)).status()));
}

TEST(ManifestTest, PartOutsideItsSegmentIsDataLoss) {
  absl::StatusOr<Manifest> m = PlanLayout(SmallIndex(), LayoutOptions{});
  ASSERT_TRUE(m.ok());
  m->segments[0].used_bytes = 10;
  absl::StatusOr<Manifest> parsed = Manifest::Parse(AsBytes(m->Serialize()));
  EXPECT_TRUE(absl::IsDataLoss(parsed.status())) << parsed.status();
}

TEST(HugePagesTest, ParsesModes) {
  EXPECT_EQ(*ParseHugePageMode("2m"), HugePageMode::k2M);
  EXPECT_EQ(*ParseHugePageMode("off"), HugePageMode::kOff);
  EXPECT_TRUE(absl::IsInvalidArgument(ParseHugePageMode("4m").status()));
  EXPECT_TRUE(ShmemThpAdviceEffective("advise"));
  EXPECT_FALSE(ShmemThpAdviceEffective("never"));
}

TEST(DataSegmentTest, SealedSegmentIsReadOnlyEverywhere) {
  const std::string name = Instance("seg");
  absl::StatusOr<DataSegment> seg =
      DataSegment::Create(100000, HugePageMode::kOff, NumaBinding{}, name, nullptr);
  ASSERT_TRUE(seg.ok()) << seg.status();
  EXPECT_EQ(seg->backing(), PageBacking::kShmem);
  EXPECT_EQ(seg->size_bytes(), 102400u);  // Rounded up to 4 KiB pages.
  EXPECT_EQ(seg->handle().kind, SegmentKind::kShmFile);
  EXPECT_EQ(seg->handle().ToString(), "/dev/shm/" + name);
  EXPECT_TRUE(absl::IsAlreadyExists(
      DataSegment::Create(4096, HugePageMode::kOff, NumaBinding{}, name, nullptr).status()));
  const SegmentHandle id = seg->handle();
  std::span<std::byte> w = seg->mutable_bytes();
  ASSERT_EQ(w.size(), seg->size_bytes());
  // Half through the mapping, half through the fd: both land in the same file.
  for (size_t i = 0; i < w.size() / 2; ++i) w[i] = static_cast<std::byte>(i * 7);
  std::vector<std::byte> rest(w.size() - w.size() / 2);
  for (size_t i = 0; i < rest.size(); ++i) rest[i] = static_cast<std::byte>((i + w.size() / 2) * 7);
  ASSERT_EQ(::pwrite(seg->write_fd(), rest.data(), rest.size(), w.size() / 2),
            static_cast<ssize_t>(rest.size()));
  EXPECT_EQ(DataSegment::StatSegment(id)->mode, 0600u);
  ASSERT_TRUE(seg->Seal().ok());
  EXPECT_TRUE(seg->mutable_bytes().empty());
  EXPECT_EQ(seg->write_fd(), -1);
  EXPECT_EQ(DataSegment::StatSegment(id)->mode, 0400u);
  EXPECT_EQ(DataSegment::StatSegment(id)->instance_id, seg->instance_id());

  absl::StatusOr<DataSegment> ro =
      DataSegment::AttachReadOnly(id, seg->size_bytes(), PageBacking::kShmem);
  ASSERT_TRUE(ro.ok()) << ro.status();
  bool same = true;
  for (size_t i = 0; i < ro->bytes().size(); ++i) {
    same = same && ro->bytes()[i] == static_cast<std::byte>(i * 7);
  }
  EXPECT_TRUE(same);
  std::byte* reader = const_cast<std::byte*>(ro->bytes().data());
  std::byte* writer = const_cast<std::byte*>(seg->bytes().data());
  EXPECT_EQ(SignalOfChild([reader] { reader[5] = std::byte{1}; }), SIGSEGV);
  EXPECT_EQ(SignalOfChild([writer] { writer[5] = std::byte{1}; }), SIGSEGV);
  EXPECT_EQ(SignalOfChild([reader] {
              volatile std::byte b = reader[5];
              (void)b;
            }),
            0);

  EXPECT_TRUE(
      absl::IsDataLoss(DataSegment::AttachReadOnly(id, 4096, PageBacking::kShmem).status()));
  ASSERT_TRUE(DataSegment::Remove(id).ok());
  EXPECT_EQ(ro->bytes()[9], static_cast<std::byte>(63));  // Mappings outlive removal.
  EXPECT_TRUE(absl::IsNotFound(DataSegment::StatSegment(id).status()));
  EXPECT_TRUE(absl::IsNotFound(
      DataSegment::AttachReadOnly(id, seg->size_bytes(), PageBacking::kShmem).status()));
}

TEST(DataSegmentTest, HugepagesFallBackWhenThePoolIsShort) {
  constexpr uint64_t kSize = 8 << 20;
  absl::StatusOr<HugePagePool> pool = ReadHugePagePool(k2MiB);
  std::string why;
  absl::StatusOr<DataSegment> seg =
      DataSegment::Create(kSize, HugePageMode::k2M, NumaBinding{}, Instance("huge"), &why);
  ASSERT_TRUE(seg.ok()) << seg.status();
  if (pool.ok() && pool->available() >= 4) {
    EXPECT_EQ(seg->backing(), PageBacking::kHugetlb2M) << why;
    EXPECT_EQ(seg->handle().kind, SegmentKind::kSysvHugetlb);
    // Sealing works the same way for SysV segments.
    seg->mutable_bytes()[0] = std::byte{42};
    ASSERT_TRUE(seg->Seal().ok());
    EXPECT_EQ(DataSegment::StatSegment(seg->handle())->mode, 0400u);
    absl::StatusOr<DataSegment> ro =
        DataSegment::AttachReadOnly(seg->handle(), seg->size_bytes(), seg->backing());
    ASSERT_TRUE(ro.ok()) << ro.status();
    EXPECT_EQ(ro->bytes()[0], std::byte{42});
    std::byte* reader = const_cast<std::byte*>(ro->bytes().data());
    EXPECT_EQ(SignalOfChild([reader] { reader[1] = std::byte{1}; }), SIGSEGV);
  } else {
    EXPECT_NE(seg->backing(), PageBacking::kHugetlb2M) << why;
    EXPECT_NE(why.find("not hugetlb-2m"), std::string::npos) << why;
  }
  EXPECT_EQ(seg->size_bytes() % k2MiB, 0u);
  EXPECT_TRUE(DataSegment::Remove(seg->handle()).ok());
}

// Issue #16: the room check weightd runs before it creates a store.
TEST(SharedMemoryRoomTest, AStoreFitsInShmPlusTheHugepagePoolsItMayUse) {
  const std::vector<uint64_t> segments = {3 << 20, 1};  // rounded: 4 MiB + 2 MiB with advice
  EXPECT_EQ(ShmemBytesFor(segments, HugePageMode::kAuto), uint64_t{6} << 20);
  EXPECT_EQ(ShmemBytesFor(segments, HugePageMode::kOff), (uint64_t{3} << 20) + 4096);
  SharedMemoryRoom room{.shm_free_bytes = uint64_t{6} << 20};
  EXPECT_TRUE(CheckRoomForSegments(segments, HugePageMode::kAuto, room).ok());  // exactly
  room.shm_free_bytes = (uint64_t{6} << 20) - 1;
  absl::Status s = CheckRoomForSegments(segments, HugePageMode::kAuto, room);
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("the store needs 6.0 MiB (6291456 bytes in 2 segment(s))"),
            std::string::npos)
      << s;
  EXPECT_NE(s.message().find("/dev/shm has 6.0 MiB free"), std::string::npos) << s;
  // Hugepages make up the difference for the modes that may use them, not for thp/off.
  room.hugetlb_2m_free_bytes = uint64_t{2} << 20;
  EXPECT_TRUE(CheckRoomForSegments(segments, HugePageMode::k2M, room).ok());
  s = CheckRoomForSegments(segments, HugePageMode::kThp, room);
  EXPECT_TRUE(absl::IsResourceExhausted(s)) << s;
  EXPECT_NE(s.message().find("hugetlb pools not used with --hugepages thp"), std::string::npos)
      << s;
  // --hugepages off rounds to 4 KiB pages: 3 MiB + 4 KiB fit in just under 6 MiB.
  EXPECT_TRUE(CheckRoomForSegments(segments, HugePageMode::kOff, room).ok());
}

TEST(ControlSegmentTest, CreateIsOwnerOnlyAndExclusive) {
  const std::string instance = Instance("ctl");
  absl::StatusOr<ControlSegment> c = ControlSegment::Create(instance, 4096);
  ASSERT_TRUE(c.ok()) << c.status();
  struct stat st {};
  ASSERT_EQ(::stat(("/dev/shm/" + ControlSegmentName(instance)).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_TRUE(absl::IsAlreadyExists(ControlSegment::Create(instance, 4096).status()));
  absl::StatusOr<ControlSegment> ro = ControlSegment::OpenReadOnly(instance);
  ASSERT_TRUE(ro.ok()) << ro.status();
  EXPECT_EQ(ro->LoadState(), StoreState::kEmpty);
  EXPECT_TRUE(absl::IsFailedPrecondition(ro->ReadManifest().status()));
  ASSERT_TRUE(ControlSegment::Remove(instance).ok());
  EXPECT_TRUE(absl::IsNotFound(ControlSegment::OpenReadOnly(instance).status()));
  EXPECT_TRUE(absl::IsNotFound(ControlSegment::Remove(instance)));
  EXPECT_TRUE(absl::IsInvalidArgument(ControlSegment::OpenReadOnly("../etc").status()));
}

TEST(ControlSegmentTest, ManifestIsChecksummed) {
  const std::string instance = Instance("sum");
  absl::StatusOr<Manifest> m = PlanLayout(SmallIndex(), LayoutOptions{});
  ASSERT_TRUE(m.ok());
  m->identity = {3, 4};
  const std::string bytes = m->Serialize();
  absl::StatusOr<ControlSegment> c = ControlSegment::Create(instance, bytes.size());
  ASSERT_TRUE(c.ok());
  c->mutable_header().identity_hi = 3;
  c->mutable_header().identity_lo = 4;
  EXPECT_TRUE(absl::IsResourceExhausted(c->WriteManifest(bytes + "more")));
  ASSERT_TRUE(c->WriteManifest(bytes).ok());
  c->StoreStateRelease(StoreState::kReady);
  absl::StatusOr<ControlSegment> ro = ControlSegment::OpenReadOnly(instance);
  ASSERT_TRUE(ro.ok());
  absl::StatusOr<Manifest> read = ro->ReadManifest();
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(*read, *m);
  // A flipped byte in the manifest is caught.
  reinterpret_cast<char*>(&c->mutable_header())[sizeof(ControlHeader) + 20] ^= 1;
  EXPECT_TRUE(absl::IsDataLoss(ro->ReadManifest().status()));
  EXPECT_TRUE(RemoveInstance(instance).ok());
}

// A hand-built one-tensor store, for WeightStore's checks.
class FakeStore {
 public:
  explicit FakeStore(const std::string& instance, bool seal = true) {
    manifest_.identity = {5, 6};
    manifest_.generation = 3;
    manifest_.segments = {SegmentLayout{0, SegmentRole::kDense, -1, -1, 64}};
    TensorEntry t;
    t.name = "t";
    t.dtype = DType::kF32;
    t.shape = {4, 4};
    t.size_bytes = 64;
    t.parts = {TensorPart{0, -1, 0, 0, 64, {4, 4}, -1, 0, 0}};
    manifest_.tensors = {t};
    const std::string bytes = manifest_.Serialize();
    absl::StatusOr<ControlSegment> c = ControlSegment::Create(instance, bytes.size());
    EXPECT_TRUE(c.ok()) << c.status();
    absl::StatusOr<DataSegment> seg =
        DataSegment::Create(64, HugePageMode::kOff, {}, instance + ".g1.s0", nullptr);
    EXPECT_TRUE(seg.ok());
    for (int i = 0; i < 16; ++i) {
      const float f = static_cast<float>(i);
      std::memcpy(seg->mutable_bytes().data() + 4 * i, &f, 4);
    }
    if (seal) {
      EXPECT_TRUE(seg->Seal().ok());
    }
    ControlHeader& h = c->mutable_header();
    h.identity_hi = 5;
    h.identity_lo = 6;
    h.generation = 3;
    h.num_segments = 1;
    SetHandle(seg->handle(), h.segments[0]);
    h.segments[0].size_bytes = seg->size_bytes();
    h.segments[0].instance_id = seg->instance_id();
    EXPECT_TRUE(c->WriteManifest(bytes).ok());
    control_.emplace(*std::move(c));
    segment_.emplace(*std::move(seg));
  }
  ControlSegment& control() { return *control_; }

 private:
  Manifest manifest_;
  std::optional<ControlSegment> control_;
  std::optional<DataSegment> segment_;
};

TEST(WeightStoreTest, AttachesOnlyToAReadySealedStoreOfTheExpectedModel) {
  const std::string instance = Instance("ws");
  EXPECT_TRUE(absl::IsNotFound(WeightStore::Attach(instance).status()));
  FakeStore store(instance);
  absl::StatusOr<std::unique_ptr<WeightStore>> s = WeightStore::Attach(instance);
  EXPECT_TRUE(absl::IsFailedPrecondition(s.status())) << s.status();  // Still loading.
  store.control().StoreStateRelease(StoreState::kReady);
  s = WeightStore::Attach(instance);
  ASSERT_TRUE(s.ok()) << s.status();
  absl::StatusOr<TensorView> t = (*s)->GetTensor("t");
  ASSERT_TRUE(t.ok());
  float f = 0;
  std::memcpy(&f, t->data + 4 * 9, 4);
  EXPECT_EQ(f, 9.0f);
  EXPECT_TRUE(absl::IsNotFound((*s)->GetTensor("u").status()));
  EXPECT_EQ((*s)->generation(), 3u);
  AttachOptions other;
  other.expected_identity = ModelIdentity{5, 7};
  EXPECT_TRUE(absl::IsFailedPrecondition(WeightStore::Attach(instance, other).status()));
  other.expected_identity = ModelIdentity{5, 6};
  EXPECT_TRUE(WeightStore::Attach(instance, other).ok());
  EXPECT_TRUE(RemoveInstance(instance).ok());
}

TEST(WeightStoreTest, RefusesUnsealedSegments) {
  const std::string instance = Instance("unsealed");
  FakeStore store(instance, /*seal=*/false);
  store.control().StoreStateRelease(StoreState::kReady);
  absl::StatusOr<std::unique_ptr<WeightStore>> s = WeightStore::Attach(instance);
  EXPECT_TRUE(absl::IsFailedPrecondition(s.status())) << s.status();
  EXPECT_NE(s.status().message().find("not sealed"), std::string::npos) << s.status();
  EXPECT_TRUE(RemoveInstance(instance).ok());
}

TEST(AssembleFromPartsTest, RejectsPartsThatDoNotTile) {
  TensorEntry e;
  e.name = "w";
  e.dtype = DType::kU8;
  e.shape = {2, 4};
  e.size_bytes = 8;
  const std::byte a[4] = {std::byte{1}, std::byte{2}, std::byte{5}, std::byte{6}};
  const std::byte b[4] = {std::byte{3}, std::byte{4}, std::byte{7}, std::byte{8}};
  auto part = [&](uint32_t slice, int64_t begin, int64_t end, const std::byte* data) {
    TensorPartView p;
    p.part = TensorPart{
        slice, -1, 0, 0, static_cast<uint64_t>(2 * (end - begin)), {2, end - begin}, 1, begin, end};
    p.view.data = data;
    p.view.size_bytes = p.part.size_bytes;
    return p;
  };
  std::vector<std::byte> out(8);
  ASSERT_TRUE(AssembleFromParts(e, {part(0, 0, 2, a), part(1, 2, 4, b)}, out).ok());
  for (int i = 0; i < 8; ++i) EXPECT_EQ(out[i], static_cast<std::byte>(i + 1));
  EXPECT_TRUE(absl::IsInvalidArgument(AssembleFromParts(e, {part(0, 0, 2, a)}, out)));
  EXPECT_TRUE(
      absl::IsInvalidArgument(AssembleFromParts(e, {part(1, 2, 4, b), part(0, 0, 2, a)}, out)));
}

TEST(ShmNamesTest, ValidatesInstanceNames) {
  EXPECT_TRUE(ValidateInstanceName("default").ok());
  EXPECT_TRUE(ValidateInstanceName("a-b_C9").ok());
  EXPECT_FALSE(ValidateInstanceName("").ok());
  EXPECT_FALSE(ValidateInstanceName("a.b").ok());
  EXPECT_FALSE(ValidateInstanceName("a/b").ok());
  EXPECT_FALSE(ValidateInstanceName(std::string(49, 'a')).ok());
  EXPECT_EQ(ControlSegmentName("x"), "hmoe.x.control");
}

}  // namespace
}  // namespace hmoe::shm
