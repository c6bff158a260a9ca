#include "common/model/safetensors.h"

#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/base/mapped_file.h"
#include "tests/model/test_util.h"

namespace hmoe {
namespace {

using ::hmoe::testing::RandomBytes;
using ::hmoe::testing::TempDir;
using ::testing::HasSubstr;

// A safetensors image: 8-byte little-endian `header_len` (default: the header's size), the
// header text, then `data`.
std::string Image(const std::string& header, const std::string& data,
                  std::optional<uint64_t> header_len = std::nullopt) {
  const uint64_t n = header_len.value_or(header.size());
  std::string out;
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return out + header + data;
}

std::span<const std::byte> Bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> Load(const std::string& image) {
  return SafetensorsFile::FromBytes("test.safetensors", Bytes(image));
}

// A few tensors of assorted dtypes and shapes (defined below).
std::vector<TensorToWrite> SampleTensors();

// The InvalidArgument message of loading `image`; fails the test on success.
std::string LoadError(const std::string& image) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = Load(image);
  EXPECT_FALSE(f.ok());
  if (f.ok()) return "";
  EXPECT_TRUE(absl::IsInvalidArgument(f.status())) << f.status();
  const std::string msg(f.status().message());
  EXPECT_THAT(msg, HasSubstr("test.safetensors"));  // every error names the file
  return msg;
}

TEST(SafetensorsReadTest, ValidFile) {
  const std::string header = R"({"__metadata__":{"format":"pt","note":"x"},)"
                             R"("a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
                             R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]}})";
  const std::string data = RandomBytes(22, 1);
  const std::string image = Image(header, data);
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = Load(image);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->path(), "test.safetensors");
  EXPECT_EQ((*f)->file_size(), image.size());
  EXPECT_EQ((*f)->data_start(), 8 + header.size());
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  EXPECT_EQ((*f)->metadata().at("note"), "x");
  ASSERT_EQ((*f)->entries().size(), 2u);
  const SafetensorsFile::Entry* a = (*f)->Find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->view.name, "a");
  EXPECT_EQ(a->view.dtype, DType::kF32);
  EXPECT_EQ(a->view.shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(a->view.size_bytes, 16u);
  EXPECT_EQ(a->file_offset, 8 + header.size());
  // Zero copies: the view points into the image.
  EXPECT_EQ(a->view.data, Bytes(image).data() + a->file_offset);
  const SafetensorsFile::Entry* b = (*f)->Find("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->view.dtype, DType::kBF16);
  EXPECT_EQ(std::memcmp(b->view.data, data.data() + 16, 6), 0);
  EXPECT_EQ((*f)->Find("c"), nullptr);
}

TEST(SafetensorsReadTest, EmptyHeaderObjectAndZeroSizeTensors) {
  EXPECT_TRUE(Load(Image("{}", "")).ok());
  // Zero-size tensors own no bytes, so they may share offsets with anything.
  const std::string header = R"({"e":{"dtype":"F32","shape":[0,4],"data_offsets":[4,4]},)"
                             R"("f":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
                             R"("g":{"dtype":"I8","shape":[0],"data_offsets":[4,4]}})";
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = Load(Image(header, "abcd"));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->Find("f")->view.num_elements(), 1);  // scalar
  EXPECT_EQ((*f)->Find("e")->view.size_bytes, 0u);
}

TEST(SafetensorsReadTest, HeaderPaddedWithSpacesIsAccepted) {
  const std::string header = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})"
                             "     ";
  EXPECT_TRUE(Load(Image(header, "z")).ok());
}

TEST(SafetensorsCorruptTest, FileShorterThanLengthPrefix) {
  EXPECT_THAT(LoadError("abc"), HasSubstr("too small for a safetensors header"));
}

TEST(SafetensorsCorruptTest, HeaderLengthTooSmall) {
  EXPECT_THAT(LoadError(Image("{", "", 1)), HasSubstr("header length 1 is too small"));
  EXPECT_THAT(LoadError(Image("", "", 0)), HasSubstr("header length 0 is too small"));
}

TEST(SafetensorsCorruptTest, HeaderLengthBeyondFile) {
  EXPECT_THAT(LoadError(Image("{}", "", 3)), HasSubstr("header length 3 exceeds the file size"));
  EXPECT_THAT(LoadError(Image("{}", "", ~uint64_t{0})), HasSubstr("header length"));
}

TEST(SafetensorsCorruptTest, HeaderLengthOverLimit) {
  EXPECT_THAT(LoadError(Image("{}", "", 200'000'000)), HasSubstr("exceeds the limit"));
}

TEST(SafetensorsCorruptTest, HeaderNotJson) {
  EXPECT_THAT(LoadError(Image("{\"a\": ", "")), HasSubstr("bad header: json:"));
  EXPECT_THAT(LoadError(Image("\x01\x02garbage", "")), HasSubstr("bad header"));
}

TEST(SafetensorsCorruptTest, HeaderNotObject) {
  EXPECT_THAT(LoadError(Image("[1, 2]", "")), HasSubstr("header is a JSON array, not an object"));
}

TEST(SafetensorsCorruptTest, EntryNotObject) {
  EXPECT_THAT(LoadError(Image(R"({"a": 5})", "")),
              HasSubstr("tensor \"a\": entry is a number, not an object"));
}

TEST(SafetensorsCorruptTest, UnknownDtype) {
  EXPECT_THAT(LoadError(Image(R"({"w":{"dtype":"Q4_K","shape":[1],"data_offsets":[0,1]}})", "x")),
              HasSubstr("tensor \"w\": unknown dtype \"Q4_K\""));
}

TEST(SafetensorsCorruptTest, MissingDtype) {
  EXPECT_THAT(LoadError(Image(R"({"w":{"shape":[1],"data_offsets":[0,1]}})", "x")),
              HasSubstr("tensor \"w\": missing or non-string \"dtype\""));
}

TEST(SafetensorsCorruptTest, MissingShape) {
  EXPECT_THAT(LoadError(Image(R"({"w":{"dtype":"U8","data_offsets":[0,1]}})", "x")),
              HasSubstr("tensor \"w\": missing or non-array \"shape\""));
}

TEST(SafetensorsCorruptTest, ShapeSizeMismatch) {
  EXPECT_THAT(
      LoadError(Image(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "xxxxxxxx")),
      HasSubstr("tensor \"w\": shape [2] of dtype F32 needs 8 bytes, but data_offsets [0, 4] "
                "span 4"));
}

TEST(SafetensorsCorruptTest, NegativeDimension) {
  EXPECT_THAT(
      LoadError(Image(R"({"w":{"dtype":"F32","shape":[-1,4],"data_offsets":[0,4]}})", "xxxx")),
      HasSubstr("tensor \"w\": negative dimension"));
}

TEST(SafetensorsCorruptTest, NonIntegerDimension) {
  EXPECT_THAT(
      LoadError(Image(R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", "xxxx")),
      HasSubstr("tensor \"w\": shape has a dimension that is not a non-negative integer"));
}

TEST(SafetensorsCorruptTest, ShapeProductOverflows) {
  EXPECT_THAT(LoadError(Image(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],)"
                              R"("data_offsets":[0,0]}})",
                              "")),
              HasSubstr("tensor \"w\": size of shape [4294967296, 4294967296] of dtype F32 "
                        "overflows"));
  // prod(shape) fits, prod(shape) * 8 does not.
  EXPECT_THAT(LoadError(Image(R"({"w":{"dtype":"F64","shape":[2305843009213693952],)"
                              R"("data_offsets":[0,0]}})",
                              "")),
              HasSubstr("overflows"));
}

TEST(SafetensorsCorruptTest, OffsetsOutOfRange) {
  EXPECT_THAT(
      LoadError(Image(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", "xxxx")),
      HasSubstr("tensor \"w\": data_offsets [2, 6] out of range: the data buffer has 4 bytes"));
}

TEST(SafetensorsCorruptTest, BeginAfterEnd) {
  EXPECT_THAT(LoadError(Image(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[3,1]}})", "xxxx")),
              HasSubstr("tensor \"w\": data_offsets begin 3 > end 1"));
}

TEST(SafetensorsCorruptTest, NegativeOffsets) {
  EXPECT_THAT(LoadError(Image(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}})", "xxxx")),
              HasSubstr("tensor \"w\": negative data_offsets"));
}

TEST(SafetensorsCorruptTest, OffsetsNotTwoIntegers) {
  for (const char* offsets : {"[0]", "[0,1,2]", "[0,\"1\"]", "5", "[0,1.0]"}) {
    EXPECT_THAT(
        LoadError(Image(
            absl::StrCat(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":)", offsets, "}}"), "x")),
        HasSubstr("tensor \"w\": \"data_offsets\" is not an array of two integers"))
        << offsets;
  }
}

TEST(SafetensorsCorruptTest, OverlappingTensors) {
  const std::string header = R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                             R"("b":{"dtype":"U8","shape":[4],"data_offsets":[3,7]}})";
  EXPECT_THAT(LoadError(Image(header, "xxxxxxxx")),
              HasSubstr("tensor \"b\": data_offsets [3, 7] overlap tensor \"a\" [0, 4]"));
  // Identical ranges overlap too.
  const std::string same = R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                           R"("b":{"dtype":"I8","shape":[4],"data_offsets":[0,4]}})";
  EXPECT_THAT(LoadError(Image(same, "xxxx")), HasSubstr("overlap tensor"));
}

TEST(SafetensorsCorruptTest, DuplicateTensorName) {
  const std::string header = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                             R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})";
  EXPECT_THAT(LoadError(Image(header, "xx")), HasSubstr("duplicate key \"a\""));
}

TEST(SafetensorsCorruptTest, NonStringMetadata) {
  EXPECT_THAT(LoadError(Image(R"({"__metadata__":{"format":1}})", "")),
              HasSubstr("\"__metadata__\" value of \"format\" is a number, not a string"));
}

TEST(SafetensorsCorruptTest, NonObjectMetadata) {
  EXPECT_THAT(LoadError(Image(R"({"__metadata__":"pt"})", "")),
              HasSubstr("\"__metadata__\" is a string, not an object"));
}

TEST(SafetensorsCorruptTest, RandomCorruptionNeverCrashes) {
  // Random byte flips and truncations of a valid image: every result is OK or InvalidArgument
  // (run under ASan/UBSan in CI), and an accepted file's views stay inside the image.
  TempDir dir;
  const std::string path = dir.File("ok.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, SampleTensors()).ok());
  const std::string valid = *ReadFileToString(path);
  std::mt19937 rng(123);
  for (int iter = 0; iter < 3000; ++iter) {
    std::string image = valid;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) image[rng() % image.size()] = static_cast<char>(rng() & 0xff);
    if (rng() % 4 == 0) image.resize(rng() % image.size());
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = Load(image);
    if (!f.ok()) {
      ASSERT_TRUE(absl::IsInvalidArgument(f.status())) << f.status();
      continue;
    }
    const std::byte* begin = Bytes(image).data();
    for (const auto& [name, e] : (*f)->entries()) {
      ASSERT_GE(e.view.data, begin);
      ASSERT_LE(e.view.data + e.view.size_bytes, begin + image.size());
    }
  }
}

TEST(SafetensorsOpenTest, MissingFileIsNotFound) {
  TempDir dir;
  EXPECT_TRUE(absl::IsNotFound(SafetensorsFile::Open(dir.File("absent.safetensors")).status()));
}

TEST(SafetensorsOpenTest, CorruptFileOnDiskNamesPath) {
  TempDir dir;
  const std::string path = dir.File("bad.safetensors");
  ASSERT_TRUE(WriteFileAtomically(path, Image("[]", "")).ok());
  const absl::Status s = SafetensorsFile::Open(path).status();
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(), HasSubstr(path));
}

std::vector<TensorToWrite> SampleTensors() {
  return {
      {"z.first", DType::kF32, {3, 5}, RandomBytes(60, 1)},
      {"a.second", DType::kBF16, {7}, RandomBytes(14, 2)},
      {"m.fp8", DType::kF8E4M3, {2, 3}, RandomBytes(6, 3)},
      {"empty", DType::kF32, {0}, ""},
      {"scalar", DType::kI64, {}, RandomBytes(8, 4)},
  };
}

TEST(SafetensorsWriteTest, WriteThenReadBack) {
  TempDir dir;
  const std::string path = dir.File("model.safetensors");
  const std::vector<TensorToWrite> tensors = SampleTensors();
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->data_start() % 8, 0u);
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  ASSERT_EQ((*f)->entries().size(), tensors.size());
  for (const TensorToWrite& t : tensors) {
    const SafetensorsFile::Entry* e = (*f)->Find(t.name);
    ASSERT_NE(e, nullptr) << t.name;
    EXPECT_EQ(e->view.dtype, t.dtype);
    EXPECT_EQ(e->view.shape, t.shape);
    ASSERT_EQ(e->view.size_bytes, t.data.size());
    EXPECT_EQ(std::memcmp(e->view.data, t.data.data(), t.data.size()), 0) << t.name;
  }
  // Data is laid out in the given order, back to back.
  EXPECT_EQ((*f)->Find("z.first")->file_offset, (*f)->data_start());
  EXPECT_EQ((*f)->Find("a.second")->file_offset, (*f)->data_start() + 60);
  EXPECT_EQ((*f)->file_size(), (*f)->data_start() + 60 + 14 + 6 + 8);
  // The padding is spaces.
  absl::StatusOr<std::string> raw = ReadFileToString(path);
  ASSERT_TRUE(raw.ok());
  const char last = (*raw)[(*f)->data_start() - 1];
  EXPECT_TRUE(last == ' ' || last == '}') << last;
}

TEST(SafetensorsWriteTest, RejectsWrongDataSize) {
  TempDir dir;
  const absl::Status s =
      WriteSafetensors(dir.File("x.safetensors"), {{"t", DType::kF32, {2}, "abc"}});
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(), HasSubstr("tensor \"t\": 3 bytes of data, but shape [2] of dtype F32 "
                                     "needs 8"));
  struct stat st {};
  EXPECT_NE(::stat(dir.File("x.safetensors").c_str(), &st), 0);
}

TEST(SafetensorsWriteTest, RejectsBadSpecs) {
  EXPECT_THAT(
      SafetensorsHeader({{"a", DType::kF32, {1}}, {"a", DType::kF32, {1}}}).status().message(),
      HasSubstr("duplicate tensor \"a\""));
  EXPECT_THAT(SafetensorsHeader({{"__metadata__", DType::kF32, {1}}}).status().message(),
              HasSubstr("invalid tensor name"));
  EXPECT_THAT(SafetensorsHeader({{"", DType::kF32, {1}}}).status().message(),
              HasSubstr("invalid tensor name"));
  EXPECT_THAT(SafetensorsHeader({{"n", DType::kF32, {-2}}}).status().message(),
              HasSubstr("tensor \"n\": invalid shape [-2]"));
}

TEST(SafetensorsWriteTest, HeaderIsAlignedForEveryLength) {
  // Names of every length mod 8 give every header length mod 8 before padding.
  for (int len = 1; len <= 16; ++len) {
    absl::StatusOr<std::string> h = SafetensorsHeader({{std::string(len, 'n'), DType::kU8, {1}}});
    ASSERT_TRUE(h.ok());
    EXPECT_EQ(h->size() % 8, 0u) << len;
    const std::string image = *h + "q";
    ASSERT_TRUE(Load(image).ok()) << len;
  }
}

TEST(SafetensorsStreamTest, ChunkedWritesMatchWholeFileWriter) {
  TempDir dir;
  const std::vector<TensorToWrite> tensors = SampleTensors();
  ASSERT_TRUE(WriteSafetensors(dir.File("whole.safetensors"), tensors).ok());
  std::vector<TensorSpec> specs;
  for (const TensorToWrite& t : tensors) specs.push_back({t.name, t.dtype, t.shape});
  const std::string path = dir.File("streamed.safetensors");
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> w = SafetensorsWriter::Create(path, specs);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ((*w)->next_tensor(), "z.first");
  // First tensor in three pieces, the rest whole; "empty" needs no call.
  ASSERT_TRUE((*w)->WriteTensorData("z.first", tensors[0].data.substr(0, 7)).ok());
  ASSERT_TRUE((*w)->WriteTensorData("z.first", tensors[0].data.substr(7, 0)).ok());
  ASSERT_TRUE((*w)->WriteTensorData("z.first", tensors[0].data.substr(7)).ok());
  ASSERT_TRUE((*w)->WriteTensorData("a.second", tensors[1].data).ok());
  ASSERT_TRUE((*w)->WriteTensorData("m.fp8", tensors[2].data).ok());
  EXPECT_EQ((*w)->next_tensor(), "scalar");
  ASSERT_TRUE((*w)->WriteTensorData("scalar", tensors[4].data).ok());
  EXPECT_EQ((*w)->next_tensor(), "");
  struct stat st {};
  EXPECT_NE(::stat(path.c_str(), &st), 0) << "visible before Finish";
  ASSERT_TRUE((*w)->Finish().ok());
  absl::StatusOr<std::string> whole = ReadFileToString(dir.File("whole.safetensors"));
  absl::StatusOr<std::string> streamed = ReadFileToString(path);
  ASSERT_TRUE(whole.ok() && streamed.ok());
  EXPECT_EQ(*streamed, *whole);
  EXPECT_TRUE(SafetensorsFile::Open(path).ok());
}

TEST(SafetensorsStreamTest, OutOfOrderWriteIsRejected) {
  TempDir dir;
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> w = SafetensorsWriter::Create(
      dir.File("x.safetensors"), {{"a", DType::kU8, {2}}, {"b", DType::kU8, {2}}});
  ASSERT_TRUE(w.ok());
  const absl::Status s = (*w)->WriteTensorData("b", std::string("xy"));
  EXPECT_TRUE(absl::IsFailedPrecondition(s));
  EXPECT_THAT(s.message(), HasSubstr("tensor \"b\" written out of order; expected \"a\""));
}

TEST(SafetensorsStreamTest, TooManyBytesIsRejected) {
  TempDir dir;
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> w =
      SafetensorsWriter::Create(dir.File("x.safetensors"), {{"a", DType::kF32, {1}}});
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->WriteTensorData("a", std::string("xyz")).ok());
  const absl::Status s = (*w)->WriteTensorData("a", std::string("uv"));
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(), HasSubstr("5 bytes written"));
  EXPECT_THAT(s.message(), HasSubstr("needs 4"));
}

TEST(SafetensorsStreamTest, FinishRequiresAllData) {
  TempDir dir;
  const std::string path = dir.File("x.safetensors");
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> w =
      SafetensorsWriter::Create(path, {{"a", DType::kU8, {4}}, {"b", DType::kU8, {1}}});
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->WriteTensorData("a", std::string("xy")).ok());
  const absl::Status s = (*w)->Finish();
  EXPECT_TRUE(absl::IsFailedPrecondition(s));
  EXPECT_THAT(s.message(), HasSubstr("tensor \"a\" has 2 of 4 bytes; 2 tensor(s) incomplete"));
  w->reset();  // an unfinished writer leaves nothing behind
  std::error_code ec;
  EXPECT_TRUE(std::filesystem::is_empty(dir.path(), ec));
}

TEST(SafetensorsStreamTest, WritesAfterFinishAreRejected) {
  TempDir dir;
  absl::StatusOr<std::unique_ptr<SafetensorsWriter>> w =
      SafetensorsWriter::Create(dir.File("x.safetensors"), {{"a", DType::kU8, {1}}});
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->WriteTensorData("a", std::string("x")).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition((*w)->WriteTensorData("a", std::string("x"))));
  ASSERT_TRUE((*w)->Finish().ok());
  EXPECT_TRUE(absl::IsFailedPrecondition((*w)->WriteTensorData("a", std::string("x"))));
  EXPECT_TRUE(absl::IsFailedPrecondition((*w)->Finish()));
  w->reset();  // a finished file stays
  EXPECT_TRUE(SafetensorsFile::Open(dir.File("x.safetensors")).ok());
}

TEST(SafetensorsStreamTest, CreateFailsInMissingDirectory) {
  TempDir dir;
  const absl::StatusOr<std::unique_ptr<SafetensorsWriter>> w =
      SafetensorsWriter::Create(dir.File("no/such/dir/x.safetensors"), {});
  EXPECT_TRUE(absl::IsNotFound(w.status())) << w.status();
}

}  // namespace
}  // namespace hmoe
