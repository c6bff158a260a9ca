#pragma once

// The identity of a model as weightd serves it: a 128-bit FNV-1a hash of config.json's bytes and
// the sorted tensor index (name, dtype, shape, byte size of every tensor). Tensor *contents* are
// not hashed (that would mean reading the whole checkpoint, which adoption exists to avoid): two
// checkpoints with the same config and index but different values have the same identity.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/model/dtype.h"

namespace hmoe {
class Checkpoint;
}  // namespace hmoe

namespace hmoe::shm {

// FNV-1a with the 128-bit parameters (offset basis 0x6c62272e07bb014262b821756295c58d, prime
// 2^88 + 2^8 + 0x3b), one byte at a time. Not cryptographic. Thread-compatible.
class Fnv1a128 {
 public:
  void Update(std::span<const std::byte> bytes);
  void Update(std::string_view s) { Update(std::as_bytes(std::span(s.data(), s.size()))); }
  // Little-endian fixed-width integer.
  void UpdateU64(uint64_t v);
  // Length-prefixed string, so that ("ab","c") and ("a","bc") differ.
  void UpdateString(std::string_view s);

  uint64_t hi() const { return static_cast<uint64_t>(state_ >> 64); }
  uint64_t lo() const { return static_cast<uint64_t>(state_); }

 private:
  unsigned __int128 state_ =
      (static_cast<unsigned __int128>(0x6c62272e07bb0142ULL) << 64) | 0x62b821756295c58dULL;
};

// 64-bit checksum of a byte buffer (FNV-1a-64 over 8-byte little-endian words, then the tail
// bytes). Guards the manifest bytes in the control segment against torn or corrupted data.
uint64_t Checksum64(std::span<const std::byte> bytes);

struct ModelIdentity {
  uint64_t hi = 0;
  uint64_t lo = 0;

  bool operator==(const ModelIdentity&) const = default;
  bool empty() const { return hi == 0 && lo == 0; }
  // 32 lower-case hex digits.
  std::string ToString() const;
};

// One entry of the tensor index.
struct TensorIndexEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t size_bytes = 0;
};

// Identity of config text + index. The index order does not matter (entries are sorted by name).
ModelIdentity ComputeModelIdentity(std::string_view config_json,
                                   std::vector<TensorIndexEntry> index);

// The index of every tensor of an opened checkpoint, sorted by name.
std::vector<TensorIndexEntry> TensorIndexOf(const Checkpoint& checkpoint);

// ComputeModelIdentity(checkpoint.config_json(), TensorIndexOf(checkpoint)).
ModelIdentity ComputeModelIdentity(const Checkpoint& checkpoint);

}  // namespace hmoe::shm
