#pragma once

// What one DSLP rank process (dslp_rank_main.cc) reports to the test that started it: the status
// of each prefill it ran, rank 0's logits and KV export, and the rank's stats. One binary file per
// rank, written at the end.

#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#include "common/dslp/dslp.h"

namespace hmoe::dslp_test {

// The prompt every rank and the reference use: `length` tokens drawn with `seed`.
inline std::vector<int32_t> MakePrompt(int64_t length, uint32_t seed, int64_t vocab) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> dist(0, vocab - 1);
  std::vector<int32_t> t(length);
  for (int32_t& x : t) x = static_cast<int32_t>(dist(rng));
  return t;
}

struct PrefillRecord {
  int32_t status_code = 0;  // absl::StatusCode
  std::string status_message;
  std::vector<float> logits;  // rank 0
  std::vector<uint8_t> kv;    // rank 0: the KV cache in the hand-off format
  std::vector<DslpLayerStats> layers;
  std::vector<uint64_t> bytes_sent, bytes_received;
  std::vector<uint64_t> ring_sent, dispatch_sent, combine_sent, meta_sent;
  // The router's choice as this rank saw it: [layer][position][top_k] expert ids, -1 where the
  // rank did not see the token (standard EP: other ranks' tokens) or the layer is dense.
  std::vector<int32_t> routing;
  int64_t local_tokens = 0;
  double total_s = 0;
};

struct RankOutput {
  int32_t rank = 0;
  int32_t world_size = 0;
  std::vector<PrefillRecord> prefills;
};

namespace internal {
template <typename T>
void Put(std::ofstream& f, const T& v) {
  f.write(reinterpret_cast<const char*>(&v), sizeof(T));
}
template <typename T>
void PutVec(std::ofstream& f, const std::vector<T>& v) {
  Put<uint64_t>(f, v.size());
  f.write(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}
template <typename T>
bool Get(std::ifstream& f, T* v) {
  return static_cast<bool>(f.read(reinterpret_cast<char*>(v), sizeof(T)));
}
template <typename T>
bool GetVec(std::ifstream& f, std::vector<T>* v) {
  uint64_t n = 0;
  if (!Get(f, &n) || n > (uint64_t{1} << 34)) return false;
  v->resize(n);
  return static_cast<bool>(f.read(reinterpret_cast<char*>(v->data()), n * sizeof(T)));
}
}  // namespace internal

inline constexpr uint64_t kRankOutputMagic = 0x54554f4b4e4152ull;

inline absl::Status WriteRankOutput(const std::string& path, const RankOutput& out) {
  using internal::Put;
  using internal::PutVec;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  Put(f, kRankOutputMagic);
  Put(f, out.rank);
  Put(f, out.world_size);
  Put<uint64_t>(f, out.prefills.size());
  for (const PrefillRecord& p : out.prefills) {
    Put(f, p.status_code);
    std::vector<char> msg(p.status_message.begin(), p.status_message.end());
    PutVec(f, msg);
    PutVec(f, p.logits);
    PutVec(f, p.kv);
    PutVec(f, p.layers);
    PutVec(f, p.bytes_sent);
    PutVec(f, p.bytes_received);
    PutVec(f, p.ring_sent);
    PutVec(f, p.dispatch_sent);
    PutVec(f, p.combine_sent);
    PutVec(f, p.meta_sent);
    PutVec(f, p.routing);
    Put(f, p.local_tokens);
    Put(f, p.total_s);
  }
  f.close();
  if (!f) return absl::InternalError(absl::StrCat("write ", path));
  return absl::OkStatus();
}

inline absl::StatusOr<RankOutput> ReadRankOutput(const std::string& path) {
  using internal::Get;
  using internal::GetVec;
  std::ifstream f(path, std::ios::binary);
  uint64_t magic = 0, count = 0;
  RankOutput out;
  if (!Get(f, &magic) || magic != kRankOutputMagic || !Get(f, &out.rank) ||
      !Get(f, &out.world_size) || !Get(f, &count) || count > 16) {
    return absl::DataLossError(absl::StrCat("bad rank output ", path));
  }
  out.prefills.resize(count);
  for (PrefillRecord& p : out.prefills) {
    std::vector<char> msg;
    if (!Get(f, &p.status_code) || !GetVec(f, &msg) || !GetVec(f, &p.logits) || !GetVec(f, &p.kv) ||
        !GetVec(f, &p.layers) || !GetVec(f, &p.bytes_sent) || !GetVec(f, &p.bytes_received) ||
        !GetVec(f, &p.ring_sent) || !GetVec(f, &p.dispatch_sent) || !GetVec(f, &p.combine_sent) ||
        !GetVec(f, &p.meta_sent) || !GetVec(f, &p.routing) || !Get(f, &p.local_tokens) ||
        !Get(f, &p.total_s)) {
      return absl::DataLossError(absl::StrCat("truncated rank output ", path));
    }
    p.status_message.assign(msg.begin(), msg.end());
  }
  return out;
}

}  // namespace hmoe::dslp_test
