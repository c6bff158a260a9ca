// NcclCollective (common/comm/nccl_collective.h), in every build:
//   - without CUDA (the stub): every entry point is Unavailable;
//   - with CUDA: bad ranks and ids are InvalidArgument before anything touches a GPU, and on a
//     machine without a usable GPU joining fails with a status instead of crashing or hanging;
//   - with GPUs: one rank per visible GPU, each on its own thread, runs every collective and
//     checks the bytes against the Collective contract (collective.h). Skipped, with the reason,
//     where no GPU is visible — the development and CI machines have none, so this part has not
//     run yet.

#include "common/comm/nccl_collective.h"

#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include <gtest/gtest.h>

#include "common/device/device.h"

#ifndef HMOE_TEST_WITH_CUDA
#error "HMOE_TEST_WITH_CUDA must be 0 or 1"
#endif

namespace hmoe {
namespace {

constexpr bool kWithCuda = HMOE_TEST_WITH_CUDA != 0;

TEST(NcclCollectiveTest, WithoutCudaEveryEntryPointIsUnavailable) {
  if (kWithCuda) GTEST_SKIP() << "built with CUDA: the stub is not linked";
  EXPECT_EQ(NewNcclUniqueId().status().code(), absl::StatusCode::kUnavailable);
  NcclCollectiveOptions o;
  o.unique_id = std::string(128, '\0');
  EXPECT_EQ(NewNcclCollective(o).status().code(), absl::StatusCode::kUnavailable);
}

TEST(NcclCollectiveTest, BadRankSizeOrIdIsInvalidArgument) {
  if (!kWithCuda) GTEST_SKIP() << "built without CUDA: every call is Unavailable";
  NcclCollectiveOptions o;
  o.unique_id = std::string(128, '\0');
  for (auto [rank, world] : {std::pair{0, 0}, std::pair{-1, 2}, std::pair{2, 2}}) {
    o.rank = rank;
    o.world_size = world;
    const absl::Status s = NewNcclCollective(o).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << rank << "/" << world << ": " << s;
  }
  o.rank = 0;
  o.world_size = 1;
  o.unique_id = "short";
  const absl::Status s = NewNcclCollective(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

TEST(NcclCollectiveTest, WithoutAGpuJoiningFailsWithAStatus) {
  if (!kWithCuda) GTEST_SKIP() << "built without CUDA";
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is visible";
  NcclCollectiveOptions o;
  o.unique_id = std::string(128, '\0');  // never used: no device to join with
  o.peer_timeout = absl::Seconds(5);
  const absl::Status s = NewNcclCollective(o).status();
  EXPECT_FALSE(s.ok());
  EXPECT_FALSE(s.message().empty());
}

// Rank r's byte i of a message to rank p: a function of (r, p, i) that differs between them.
uint8_t Pattern(int from, int to, size_t i) {
  return static_cast<uint8_t>(31 * from + 17 * to + 7 * i + 1);
}

// What one rank checks; run on its own thread with its own CudaDevice.
void RunRank(int rank, int world, const std::string& id, std::vector<std::string>* failures) {
  auto fail = [&](const std::string& what) {
    failures->push_back(absl::StrCat("rank ", rank, ": ", what));
  };
  auto device = NewCudaDevice(rank);
  if (!device.ok()) return fail(device.status().ToString());
  auto stream = (*device)->CreateStream();
  if (!stream.ok()) return fail(stream.status().ToString());
  Stream& st = **stream;
  NcclCollectiveOptions o;
  o.rank = rank;
  o.world_size = world;
  o.unique_id = id;
  o.cuda_ordinal = rank;
  auto comm = NewNcclCollective(o);
  if (!comm.ok()) return fail(comm.status().ToString());
  Collective& c = **comm;

  // All-gather-v: rank p contributes 100 + 3p bytes.
  std::vector<size_t> counts(world), offsets(world);
  for (int p = 0; p < world; ++p) counts[p] = 100 + 3 * p;
  std::exclusive_scan(counts.begin(), counts.end(), offsets.begin(), size_t{0});
  const size_t total = offsets.back() + counts.back();
  std::vector<uint8_t> mine(counts[rank]);
  for (size_t i = 0; i < mine.size(); ++i) mine[i] = Pattern(rank, -1, i);
  auto send = (*device)->Allocate(std::max<size_t>(mine.size(), 1));
  auto recv = (*device)->Allocate(total);
  if (!send.ok() || !recv.ok()) return fail("allocate");
  absl::Status s = (*device)->CopyToDevice(st, send->data(), mine.data(), mine.size());
  if (s.ok()) s = c.AllGatherV(st, send->data(), recv->data(), counts, offsets);
  std::vector<uint8_t> gathered(total);
  if (s.ok()) s = (*device)->CopyToHost(st, gathered.data(), recv->data(), total);
  if (s.ok()) s = st.Synchronize();
  if (!s.ok()) return fail(absl::StrCat("all-gather: ", s.ToString()));
  for (int p = 0; p < world; ++p) {
    for (size_t i = 0; i < counts[p]; ++i) {
      if (gathered[offsets[p] + i] != Pattern(p, -1, i)) {
        return fail(absl::StrCat("all-gather: byte ", i, " of rank ", p));
      }
    }
  }

  // All-to-all-v: r sends 50 + r + 2p bytes to p (an empty message to itself when world > 1 and
  // r == 1, to cover empty parts).
  auto bytes = [world](int from, int to) -> size_t {
    return (world > 1 && from == 1 && to == 1) ? 0 : 50 + from + 2 * to;
  };
  std::vector<size_t> sc(world), so(world), rc(world), ro(world);
  for (int p = 0; p < world; ++p) {
    sc[p] = bytes(rank, p);
    rc[p] = bytes(p, rank);
  }
  std::exclusive_scan(sc.begin(), sc.end(), so.begin(), size_t{0});
  std::exclusive_scan(rc.begin(), rc.end(), ro.begin(), size_t{0});
  std::vector<uint8_t> out(so.back() + sc.back());
  for (int p = 0; p < world; ++p) {
    for (size_t i = 0; i < sc[p]; ++i) out[so[p] + i] = Pattern(rank, p, i);
  }
  const size_t in_bytes = ro.back() + rc.back();
  auto a2a_send = (*device)->Allocate(std::max<size_t>(out.size(), 1));
  auto a2a_recv = (*device)->Allocate(std::max<size_t>(in_bytes, 1));
  if (!a2a_send.ok() || !a2a_recv.ok()) return fail("allocate");
  s = (*device)->CopyToDevice(st, a2a_send->data(), out.data(), out.size());
  if (s.ok()) s = c.AllToAllV(st, a2a_send->data(), sc, so, a2a_recv->data(), rc, ro);
  std::vector<uint8_t> in(in_bytes);
  if (s.ok()) s = (*device)->CopyToHost(st, in.data(), a2a_recv->data(), in_bytes);
  if (s.ok()) s = st.Synchronize();
  if (!s.ok()) return fail(absl::StrCat("all-to-all: ", s.ToString()));
  for (int p = 0; p < world; ++p) {
    for (size_t i = 0; i < rc[p]; ++i) {
      if (in[ro[p] + i] != Pattern(p, rank, i)) {
        return fail(absl::StrCat("all-to-all: byte ", i, " from rank ", p));
      }
    }
  }

  // Ring step: r sends 64 + r bytes to r + 1.
  const int next = (rank + 1) % world;
  const int prev = (rank - 1 + world) % world;
  std::vector<uint8_t> ring_out(64 + rank);
  for (size_t i = 0; i < ring_out.size(); ++i) ring_out[i] = Pattern(rank, next, i);
  const size_t ring_in_bytes = 64 + prev;
  auto ring_send = (*device)->Allocate(ring_out.size());
  auto ring_recv = (*device)->Allocate(ring_in_bytes);
  if (!ring_send.ok() || !ring_recv.ok()) return fail("allocate");
  s = (*device)->CopyToDevice(st, ring_send->data(), ring_out.data(), ring_out.size());
  if (s.ok()) {
    s = c.RingSendRecv(st, ring_send->data(), ring_out.size(), ring_recv->data(), ring_in_bytes);
  }
  std::vector<uint8_t> ring_in(ring_in_bytes);
  if (s.ok()) s = (*device)->CopyToHost(st, ring_in.data(), ring_recv->data(), ring_in_bytes);
  if (s.ok()) s = st.Synchronize();
  if (!s.ok()) return fail(absl::StrCat("ring: ", s.ToString()));
  for (size_t i = 0; i < ring_in_bytes; ++i) {
    if (ring_in[i] != Pattern(prev, rank, i)) return fail(absl::StrCat("ring: byte ", i));
  }

  // All-reduce: small integers, so the F32 sum is exact in any order.
  constexpr size_t kCount = 1000;
  std::vector<float> values(kCount);
  for (size_t i = 0; i < kCount; ++i) values[i] = static_cast<float>((rank + 1) * (i % 7));
  auto reduce = (*device)->Allocate(kCount * sizeof(float));
  if (!reduce.ok()) return fail("allocate");
  float* d = static_cast<float*>(reduce->data());
  s = (*device)->CopyToDevice(st, d, values.data(), kCount * sizeof(float));
  if (s.ok()) s = c.AllReduceSum(st, d, d, kCount);
  if (s.ok()) s = (*device)->CopyToHost(st, values.data(), d, kCount * sizeof(float));
  if (s.ok()) s = st.Synchronize();
  if (!s.ok()) return fail(absl::StrCat("all-reduce: ", s.ToString()));
  const float ranks_sum = static_cast<float>(world * (world + 1) / 2);
  for (size_t i = 0; i < kCount; ++i) {
    if (values[i] != ranks_sum * static_cast<float>(i % 7)) {
      return fail(absl::StrCat("all-reduce: element ", i));
    }
  }
  if (absl::Status b = c.Barrier(); !b.ok()) return fail(absl::StrCat("barrier: ", b.ToString()));
  if (c.counters().total_sent() == 0 && world > 1) fail("no bytes counted as sent");
}

// NCCL does not run two ranks on one GPU (NVIDIA/nccl#1241): the group must fail to form with a
// status that says so, on every rank, and not hang (issue 20 asked for 2 ranks on 1 GPU; this is
// why DSLP over NCCL needs one GPU per rank).
TEST(NcclCollectiveTest, TwoRanksOnOneGpuFailWithAClearStatus) {
  if (!kWithCuda) GTEST_SKIP() << "built without CUDA";
  if (CudaDeviceCount() < 1) GTEST_SKIP() << "no GPU visible";
  auto id = NewNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<absl::Status> results(2);
  {
    std::vector<std::jthread> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.emplace_back([&, r] {
        NcclCollectiveOptions o;
        o.rank = r;
        o.world_size = 2;
        o.unique_id = *id;
        o.cuda_ordinal = 0;
        o.peer_timeout = absl::Seconds(30);
        results[r] = NewNcclCollective(o).status();
      });
    }
  }
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    EXPECT_FALSE(results[r].ok());
    EXPECT_TRUE(results[r].code() == absl::StatusCode::kInvalidArgument ||
                results[r].code() == absl::StatusCode::kUnavailable)
        << results[r];
  }
  // At least the rank that detected it names the cause.
  EXPECT_TRUE(absl::StrContains(results[0].message(), "one GPU") ||
              absl::StrContains(results[1].message(), "one GPU"))
      << results[0] << " / " << results[1];
}

TEST(NcclCollectiveTest, CollectivesMatchTheContractOnEveryVisibleGpu) {
  if (!kWithCuda) GTEST_SKIP() << "built without CUDA";
  const int world = CudaDeviceCount();
  if (world < 1) GTEST_SKIP() << "no GPU visible";
  auto id = NewNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<std::vector<std::string>> failures(world);
  {
    std::vector<std::jthread> ranks;
    for (int r = 0; r < world; ++r) {
      ranks.emplace_back([&, r] { RunRank(r, world, *id, &failures[r]); });
    }
  }
  for (int r = 0; r < world; ++r) {
    for (const std::string& f : failures[r]) ADD_FAILURE() << f;
  }
}

}  // namespace
}  // namespace hmoe
