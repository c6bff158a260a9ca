// The KV hand-off buffer (common/kv_handoff/kv_handoff.h): a producer's segment read back by the
// importer, and every way an importer refuses a buffer.

#include "common/kv_handoff/kv_handoff.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include <gtest/gtest.h>

namespace hmoe {
namespace {

KvHandoffShape Shape() {
  KvHandoffShape s;
  s.num_layers = 3;
  s.kv_lora_rank = 8;
  s.rope_dim = 4;
  return s;
}

KvHandleSpec Spec(const std::string& name, int64_t num_tokens) {
  KvHandleSpec spec;
  spec.shm_name = name;
  spec.num_tokens = num_tokens;
  spec.layout_version = kKvHandoffLayoutVersion;
  return spec;
}

class KvHandoffTest : public ::testing::Test {
 protected:
  std::string Name(const std::string& tag) {
    std::string n = absl::StrCat("hmoe-test-handoff-", ::getpid(), "-", tag);
    names_.push_back(n);
    return n;
  }
  void TearDown() override {
    for (const std::string& n : names_) (void)KvHandoffSegment::Remove(n);
  }
  std::vector<std::string> names_;
};

TEST_F(KvHandoffTest, ImporterReadsWhatTheProducerWrote) {
  const std::string name = Name("roundtrip");
  absl::StatusOr<KvHandoffSegment> seg = KvHandoffSegment::Create(name, Shape(), 5);
  ASSERT_TRUE(seg.ok()) << seg.status();
  ASSERT_EQ(seg->payload().size(), 5u * 3 * 12 * sizeof(float));
  auto* values = reinterpret_cast<float*>(seg->payload().data());
  for (size_t i = 0; i < seg->payload().size() / sizeof(float); ++i) values[i] = 0.5f * i;

  std::unique_ptr<KvImporter> importer = NewShmKvImporter();
  absl::StatusOr<std::unique_ptr<KvImportSource>> src = importer->Open(Spec(name, 5), Shape());
  ASSERT_TRUE(src.ok()) << src.status();
  EXPECT_EQ((*src)->header().num_tokens, 5u);
  EXPECT_FALSE((*src)->payload_on_device());
  ASSERT_EQ((*src)->payload().size(), seg->payload().size());
  EXPECT_EQ(std::memcmp((*src)->payload().data(), seg->payload().data(), seg->payload().size()), 0);
  EXPECT_NE((*src)->description().find(name), std::string::npos);

  // Removing the name keeps existing mappings readable (the prefill side frees after the ack).
  ASSERT_TRUE(KvHandoffSegment::Remove(name).ok());
  EXPECT_EQ(reinterpret_cast<const float*>((*src)->payload().data())[7], 3.5f);
  EXPECT_TRUE(absl::IsNotFound(importer->Open(Spec(name, 5), Shape()).status()));
}

TEST_F(KvHandoffTest, CreateTwiceIsAlreadyExists) {
  const std::string name = Name("twice");
  ASSERT_TRUE(KvHandoffSegment::Create(name, Shape(), 1).ok());
  EXPECT_TRUE(absl::IsAlreadyExists(KvHandoffSegment::Create(name, Shape(), 1).status()));
}

TEST_F(KvHandoffTest, MismatchesAreInvalidArgumentNamingTheField) {
  const std::string name = Name("mismatch");
  ASSERT_TRUE(KvHandoffSegment::Create(name, Shape(), 4).ok());
  std::unique_ptr<KvImporter> importer = NewShmKvImporter();

  KvHandoffShape other = Shape();
  other.kv_lora_rank = 16;
  absl::Status s = importer->Open(Spec(name, 4), other).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("kv_lora_rank 8, expected 16"), std::string::npos) << s;

  other = Shape();
  other.num_layers = 2;
  s = importer->Open(Spec(name, 4), other).status();
  EXPECT_NE(s.message().find("num_layers"), std::string::npos) << s;

  s = importer->Open(Spec(name, 5), Shape()).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_NE(s.message().find("num_tokens 4, expected 5"), std::string::npos) << s;

  KvHandleSpec bad_layout = Spec(name, 4);
  bad_layout.layout_version = 99;
  s = importer->Open(bad_layout, Shape()).status();
  EXPECT_NE(s.message().find("layout_version"), std::string::npos) << s;

  s = importer->Open(Spec(name, 0), Shape()).status();
  EXPECT_NE(s.message().find("num_tokens"), std::string::npos) << s;
}

TEST_F(KvHandoffTest, BadNamesAndCudaHandlesAreRefused) {
  std::unique_ptr<KvImporter> importer = NewShmKvImporter();
  for (const std::string& bad :
       {std::string(""), std::string("a/b"), std::string(".."), std::string(300, 'x')}) {
    absl::Status s = importer->Open(Spec(bad, 1), Shape()).status();
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << bad << ": " << s;
  }
  KvHandleSpec cuda;
  cuda.kind = KvHandleSpec::Kind::kCudaIpc;
  cuda.cuda_ipc_handle = std::string(64, '\0');
  cuda.num_tokens = 1;
  cuda.layout_version = kKvHandoffLayoutVersion;
  EXPECT_TRUE(absl::IsUnavailable(importer->Open(cuda, Shape()).status()));
}

TEST_F(KvHandoffTest, ForeignOrCorruptSegmentsAreRefused) {
  std::unique_ptr<KvImporter> importer = NewShmKvImporter();
  // Group-readable: refused (another user could have written it).
  const std::string open_name = Name("mode");
  ASSERT_TRUE(KvHandoffSegment::Create(open_name, Shape(), 2).ok());
  ASSERT_EQ(::chmod(absl::StrCat("/dev/shm/", open_name).c_str(), 0644), 0);
  EXPECT_TRUE(absl::IsPermissionDenied(importer->Open(Spec(open_name, 2), Shape()).status()));

  // Not a hand-off buffer: bad magic.
  const std::string junk = Name("junk");
  const int fd = ::shm_open(("/" + junk).c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 4096), 0);
  ::close(fd);
  absl::Status s = importer->Open(Spec(junk, 2), Shape()).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("magic"), std::string::npos) << s;

  // Truncated: the header promises more payload than the segment holds.
  const std::string cut = Name("cut");
  {
    absl::StatusOr<KvHandoffSegment> seg = KvHandoffSegment::Create(cut, Shape(), 8);
    ASSERT_TRUE(seg.ok());
  }
  const int cfd = ::shm_open(("/" + cut).c_str(), O_RDWR, 0);
  ASSERT_GE(cfd, 0);
  ASSERT_EQ(::ftruncate(cfd, 100), 0);
  ::close(cfd);
  s = importer->Open(Spec(cut, 8), Shape()).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_NE(s.message().find("shorter"), std::string::npos) << s;
}

TEST(KvHandoffHeaderTest, PayloadBytesFollowTheShape) {
  const KvHandoffHeader h = MakeKvHandoffHeader(Shape(), 10);
  EXPECT_EQ(h.payload_bytes, 10u * 3 * (8 + 4) * 4);
  EXPECT_EQ(h.header_bytes, 64u);
  EXPECT_TRUE(ValidateKvHandoffHeader(h, Shape(), 10, 64 + h.payload_bytes).ok());
  EXPECT_FALSE(ValidateKvHandoffHeader(h, Shape(), 10, 63 + h.payload_bytes).ok());
}

}  // namespace
}  // namespace hmoe
