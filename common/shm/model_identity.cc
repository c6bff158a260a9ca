#include "common/shm/model_identity.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_format.h"

#include "common/base/logging.h"
#include "common/model/checkpoint.h"

namespace hmoe::shm {
namespace {

constexpr unsigned __int128 kFnv128Prime =
    (static_cast<unsigned __int128>(1) << 88) + (1u << 8) + 0x3b;
constexpr uint64_t kFnv64Offset = 0xcbf29ce484222325ULL;
constexpr uint64_t kFnv64Prime = 0x100000001b3ULL;

}  // namespace

void Fnv1a128::Update(std::span<const std::byte> bytes) {
  unsigned __int128 h = state_;
  for (std::byte b : bytes) {
    h ^= static_cast<uint8_t>(b);
    h *= kFnv128Prime;
  }
  state_ = h;
}

void Fnv1a128::UpdateU64(uint64_t v) {
  std::byte buf[8];
  for (int i = 0; i < 8; ++i) buf[i] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
  Update(std::span<const std::byte>(buf, 8));
}

void Fnv1a128::UpdateString(std::string_view s) {
  UpdateU64(s.size());
  Update(s);
}

uint64_t Checksum64(std::span<const std::byte> bytes) {
  uint64_t h = kFnv64Offset;
  size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, bytes.data() + i, 8);  // Little-endian host (x86-64).
    h ^= w;
    h *= kFnv64Prime;
  }
  for (; i < bytes.size(); ++i) {
    h ^= static_cast<uint8_t>(bytes[i]);
    h *= kFnv64Prime;
  }
  h ^= bytes.size();
  h *= kFnv64Prime;
  return h;
}

std::string ModelIdentity::ToString() const { return absl::StrFormat("%016x%016x", hi, lo); }

ModelIdentity ComputeModelIdentity(std::string_view config_json,
                                   std::vector<TensorIndexEntry> index) {
  std::sort(index.begin(), index.end(),
            [](const TensorIndexEntry& a, const TensorIndexEntry& b) { return a.name < b.name; });
  Fnv1a128 h;
  h.UpdateString("hmoe-model-identity-v1");
  h.UpdateString(config_json);
  h.UpdateU64(index.size());
  for (const TensorIndexEntry& e : index) {
    h.UpdateString(e.name);
    h.UpdateString(DTypeName(e.dtype));
    h.UpdateU64(e.shape.size());
    for (int64_t d : e.shape) h.UpdateU64(static_cast<uint64_t>(d));
    h.UpdateU64(e.size_bytes);
  }
  return ModelIdentity{h.hi(), h.lo()};
}

std::vector<TensorIndexEntry> TensorIndexOf(const Checkpoint& checkpoint) {
  std::vector<TensorIndexEntry> index;
  for (const std::string& name : checkpoint.TensorNames()) {
    absl::StatusOr<TensorView> view = checkpoint.GetTensor(name);
    HMOE_CHECK(view.ok()) << "listed tensor " << name << " not found: " << view.status();
    index.push_back(
        TensorIndexEntry{name, view->dtype, view->shape, static_cast<uint64_t>(view->size_bytes)});
  }
  std::sort(index.begin(), index.end(),
            [](const TensorIndexEntry& a, const TensorIndexEntry& b) { return a.name < b.name; });
  return index;
}

ModelIdentity ComputeModelIdentity(const Checkpoint& checkpoint) {
  return ComputeModelIdentity(checkpoint.config_json(), TensorIndexOf(checkpoint));
}

}  // namespace hmoe::shm
