// ShmCollective with real processes: every rank is a forked child (tests/comm/fork_ranks.h) that
// joins the group, runs collectives on data only it can compute, and checks what it received;
// its exit code tells the test what happened. Failure tests kill, stop or remove a rank and check
// that the others fail with the documented status within a bounded time.

#include "common/comm/shm_collective.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include <gtest/gtest.h>

#include "tests/comm/fork_ranks.h"

namespace hmoe {
namespace {

using ::hmoe::testing::ForkedChild;
using ::hmoe::testing::ForkRanks;
using ::hmoe::testing::RankExit;

// In a child: print and return `code` from the body when `cond` fails.
#define CHILD_EXPECT(cond, code, ...)                                                        \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "rank check failed at %s:%d: %s %s\n", __FILE__, __LINE__, #cond, \
                   absl::StrCat(__VA_ARGS__).c_str());                                       \
      return code;                                                                           \
    }                                                                                        \
  } while (false)

std::string UniqueGroup(const char* what) {
  static int counter = 0;
  return absl::StrCat("test-", what, "-", ::getpid(), "-", counter++);
}

ShmCollectiveOptions Options(const std::string& group, int rank, int world) {
  ShmCollectiveOptions o;
  o.group_name = group;
  o.rank = rank;
  o.world_size = world;
  o.channel_bytes = 4096;  // small: every test message wraps the rings many times
  o.join_timeout = absl::Seconds(20);
  o.peer_timeout = absl::Seconds(3);
  o.poll_interval = absl::Milliseconds(10);
  return o;
}

// The byte every rank can compute: data of `rank` at index i for message `tag`.
uint8_t Pattern(int rank, size_t i, int tag) {
  return static_cast<uint8_t>((rank * 131 + i * 7 + tag * 29 + (i >> 8)) & 0xff);
}

bool ObjectExists(const std::string& group) {
  struct stat st;
  return ::stat(absl::StrCat("/dev/shm", ShmGroupObjectName(group)).c_str(), &st) == 0;
}

bool HeaderPublished(const std::string& group) {
  std::ifstream in(absl::StrCat("/dev/shm", ShmGroupObjectName(group)), std::ios::binary);
  char magic[8] = {};
  return in.read(magic, sizeof(magic)) && std::string(magic, sizeof(magic)) == "MOECOMM1";
}

void ExpectAllOk(const std::vector<RankExit>& exits) {
  for (size_t r = 0; r < exits.size(); ++r) {
    EXPECT_TRUE(exits[r].ok()) << "rank " << r << ": " << exits[r].ToString();
  }
}

class ShmCollectiveWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(ShmCollectiveWorldTest, AllGatherVDeliversEveryRanksBytes) {
  const int world = GetParam();
  const std::string group = UniqueGroup("allgather");
  // Uneven sizes, one empty contribution, and sizes larger than a channel ring.
  std::vector<size_t> counts(world), offsets(world);
  size_t total = 0;
  for (int p = 0; p < world; ++p) {
    counts[p] = p == 1 ? 0 : 10000 + 3 * p;
    offsets[p] = total;
    total += counts[p];
  }
  auto exits = ForkRanks(world, [&](int rank) -> int {
    auto c = ShmCollective::Create(Options(group, rank, world));
    CHILD_EXPECT(c.ok(), 2, c.status().ToString());
    std::vector<uint8_t> send(counts[rank]);
    for (size_t i = 0; i < send.size(); ++i) send[i] = Pattern(rank, i, 1);
    std::vector<uint8_t> recv(total, 0xee);
    absl::Status s = (*c)->AllGatherV(send.data(), recv.data(), counts, offsets);
    CHILD_EXPECT(s.ok(), 3, s.ToString());
    for (int p = 0; p < world; ++p) {
      for (size_t i = 0; i < counts[p]; ++i) {
        CHILD_EXPECT(recv[offsets[p] + i] == Pattern(p, i, 1), 4, "from ", p, " byte ", i);
      }
    }
    // Counters: own contribution to every peer, theirs from each.
    const CommCounters k = (*c)->counters();
    for (int p = 0; p < world; ++p) {
      const uint64_t sent = p == rank ? 0 : counts[rank];
      const uint64_t received = p == rank ? 0 : counts[p];
      CHILD_EXPECT(k.bytes_sent[p] == sent, 5, "sent to ", p, ": ", k.bytes_sent[p]);
      CHILD_EXPECT(k.bytes_received[p] == received, 6, "received from ", p);
    }
    CHILD_EXPECT(k.num_ops == 1, 7);
    return 0;
  });
  ExpectAllOk(exits);
  EXPECT_FALSE(ObjectExists(group)) << "the name is unlinked once the group has formed";
}

TEST_P(ShmCollectiveWorldTest, AllToAllVRoutesEachPairsBytes) {
  const int world = GetParam();
  const std::string group = UniqueGroup("alltoall");
  // Rank s sends (s + 1) * 1000 + 17 * d bytes to d (0 when s == d + 1 to cover empty pairs).
  auto size = [](int s, int d) -> size_t { return s == d + 1 ? 0 : (s + 1) * 1000 + 17 * d; };
  auto exits = ForkRanks(world, [&](int rank) -> int {
    auto c = ShmCollective::Create(Options(group, rank, world));
    CHILD_EXPECT(c.ok(), 2, c.status().ToString());
    std::vector<size_t> sc(world), so(world), rc(world), ro(world);
    size_t st = 0, rt = 0;
    for (int p = 0; p < world; ++p) {
      sc[p] = size(rank, p);
      so[p] = st;
      st += sc[p];
      rc[p] = size(p, rank);
      ro[p] = rt;
      rt += rc[p];
    }
    std::vector<uint8_t> send(st), recv(rt, 0xee);
    for (int p = 0; p < world; ++p) {
      for (size_t i = 0; i < sc[p]; ++i) send[so[p] + i] = Pattern(rank, i, 10 + p);
    }
    absl::Status s = (*c)->AllToAllV(send.data(), sc, so, recv.data(), rc, ro);
    CHILD_EXPECT(s.ok(), 3, s.ToString());
    for (int p = 0; p < world; ++p) {
      for (size_t i = 0; i < rc[p]; ++i) {
        CHILD_EXPECT(recv[ro[p] + i] == Pattern(p, i, 10 + rank), 4, "from ", p, " byte ", i);
      }
      const uint64_t sent = p == rank ? 0 : sc[p];
      CHILD_EXPECT((*c)->counters().bytes_sent[p] == sent, 5, "to ", p);
    }
    return 0;
  });
  ExpectAllOk(exits);
}

TEST_P(ShmCollectiveWorldTest, RingStepsBringEveryRanksChunkAround) {
  const int world = GetParam();
  const std::string group = UniqueGroup("ring");
  auto chunk = [](int owner) -> size_t { return 5000 + 11 * owner; };  // differing sizes
  auto exits = ForkRanks(world, [&](int rank) -> int {
    auto c = ShmCollective::Create(Options(group, rank, world));
    CHILD_EXPECT(c.ok(), 2, c.status().ToString());
    // Pass-KV: after step j a rank holds the chunk of rank (rank - j) mod S.
    std::vector<uint8_t> held(chunk(rank));
    for (size_t i = 0; i < held.size(); ++i) held[i] = Pattern(rank, i, 3);
    for (int step = 1; step < world; ++step) {
      const int from = (rank - step + world) % world;
      std::vector<uint8_t> next(chunk(from));
      absl::Status s = (*c)->RingSendRecv(held.data(), held.size(), next.data(), next.size());
      CHILD_EXPECT(s.ok(), 3, s.ToString());
      for (size_t i = 0; i < next.size(); ++i) {
        CHILD_EXPECT(next[i] == Pattern(from, i, 3), 4, "step ", step, " byte ", i);
      }
      held.swap(next);
    }
    return 0;
  });
  ExpectAllOk(exits);
}

TEST_P(ShmCollectiveWorldTest, AllReduceSumGivesEveryRankTheSameBits) {
  const int world = GetParam();
  const std::string group = UniqueGroup("allreduce");
  const size_t n = 3000;
  auto value = [](int rank, size_t i) { return 0.1f * static_cast<float>(rank + 1) + 1e-3f * i; };
  auto exits = ForkRanks(world, [&](int rank) -> int {
    auto c = ShmCollective::Create(Options(group, rank, world));
    CHILD_EXPECT(c.ok(), 2, c.status().ToString());
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = value(rank, i);
    absl::Status s = (*c)->AllReduceSum(v.data(), v.data(), n);  // in place
    CHILD_EXPECT(s.ok(), 3, s.ToString());
    for (size_t i = 0; i < n; ++i) {
      float expected = value(0, i);
      for (int p = 1; p < world; ++p) expected += value(p, i);  // rank order
      CHILD_EXPECT(std::memcmp(&v[i], &expected, sizeof(float)) == 0, 4, "element ", i);
    }
    CHILD_EXPECT((*c)->Barrier().ok(), 5);
    return 0;
  });
  ExpectAllOk(exits);
}

INSTANTIATE_TEST_SUITE_P(Worlds, ShmCollectiveWorldTest, ::testing::Values(1, 2, 3));

TEST(ShmCollectiveTest, MismatchedSizesFailWithInternalOnTheReceiver) {
  const std::string group = UniqueGroup("mismatch");
  auto exits = ForkRanks(2, [&](int rank) -> int {
    auto c = ShmCollective::Create(Options(group, rank, 2));
    CHILD_EXPECT(c.ok(), 2, c.status().ToString());
    std::vector<uint8_t> send(rank == 0 ? 100 : 200), recv(100);
    // Rank 0 expects 100 bytes from rank 1, which sends 200.
    absl::Status s = (*c)->RingSendRecv(send.data(), send.size(), recv.data(), 100);
    if (rank == 0) {
      CHILD_EXPECT(s.code() == absl::StatusCode::kInternal, 3, s.ToString());
      CHILD_EXPECT(absl::StrContains(s.message(), "mismatch"), 4, s.ToString());
    }
    // The group is failed for everyone afterwards.
    absl::Status b = (*c)->Barrier();
    CHILD_EXPECT(!b.ok(), 5, "barrier after a mismatch");
    CHILD_EXPECT((*c)->failed(), 6);
    return 0;
  });
  ExpectAllOk(exits);
}

// Rank `victim` meets its end (per `how`) after the group formed; the others enter a collective
// that needs it and must fail with Unavailable naming it, within the bound.
enum class Death { kExit, kSigkill, kSigstop, kLeave };

void RunPeerFailure(int world, int victim, Death how) {
  const std::string group = UniqueGroup("death");
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  std::vector<ForkedChild> children;
  for (int r = 0; r < world; ++r) {
    children.push_back(ForkedChild::Start([&, r]() -> int {
      ::close(pipe_fds[0]);
      auto c = ShmCollective::Create(Options(group, r, world));
      CHILD_EXPECT(c.ok(), 2, c.status().ToString());
      CHILD_EXPECT((*c)->Barrier().ok(), 3);
      if (r == victim) {
        const char ready = 'r';
        CHILD_EXPECT(::write(pipe_fds[1], &ready, 1) == 1, 4);
        switch (how) {
          case Death::kExit:
            ::_exit(0);  // no destructor: the slot still says attached
          case Death::kSigkill:
            ::raise(SIGKILL);
            break;
          case Death::kSigstop:
            ::raise(SIGSTOP);  // alive but silent: the heartbeat goes stale
            break;
          case Death::kLeave:
            c->reset();
            ::pause();  // stays alive; only its slot says departed
            break;
        }
        return 0;
      }
      const absl::Time start = absl::Now();
      std::vector<uint8_t> big(100000), recv(100000 * world);
      std::vector<size_t> counts(world, big.size()), offsets(world);
      for (int p = 0; p < world; ++p) offsets[p] = p * big.size();
      absl::Status s = (*c)->AllGatherV(big.data(), recv.data(), counts, offsets);
      const absl::Duration took = absl::Now() - start;
      CHILD_EXPECT(s.code() == absl::StatusCode::kUnavailable, 5, s.ToString());
      CHILD_EXPECT(absl::StrContains(s.message(), absl::StrCat("rank ", victim)), 6, s.ToString());
      CHILD_EXPECT(took < absl::Seconds(10), 7, absl::FormatDuration(took));
      // Sticky: later collectives fail at once.
      CHILD_EXPECT((*c)->Barrier().code() == absl::StatusCode::kUnavailable, 8);
      std::fprintf(stderr, "rank %d: %s after %s\n", r, s.ToString().c_str(),
                   absl::FormatDuration(took).c_str());
      return 0;
    }));
  }
  ::close(pipe_fds[1]);
  char ready = 0;
  ASSERT_EQ(::read(pipe_fds[0], &ready, 1), 1);
  ::close(pipe_fds[0]);
  for (int r = 0; r < world; ++r) {
    if (r == victim) continue;
    const RankExit e = children[r].Wait(std::chrono::seconds(30));
    EXPECT_TRUE(e.ok()) << "rank " << r << ": " << e.ToString();
  }
  // The victim: reaped (or killed) by the ForkedChild destructor.
}

TEST(ShmCollectiveTest, ExitedPeerFailsTheCollectiveWithUnavailable) {
  RunPeerFailure(3, 2, Death::kExit);  // a zombie until the test reaps it
}

TEST(ShmCollectiveTest, KilledPeerFailsTheCollectiveWithUnavailable) {
  RunPeerFailure(2, 0, Death::kSigkill);
}

TEST(ShmCollectiveTest, StoppedPeerFailsAfterTheHeartbeatTimeout) {
  RunPeerFailure(2, 1, Death::kSigstop);
}

TEST(ShmCollectiveTest, PeerThatLeftFailsTheCollectiveWithUnavailable) {
  RunPeerFailure(3, 1, Death::kLeave);
}

TEST(ShmCollectiveTest, GroupReformsUnderANewNameAfterAFailure) {
  const std::string first = UniqueGroup("reform-a");
  const std::string second = UniqueGroup("reform-b");
  auto exits = ForkRanks(3, [&](int rank) -> int {
    {
      auto c = ShmCollective::Create(Options(first, rank, 3));
      CHILD_EXPECT(c.ok(), 2, c.status().ToString());
      if (rank == 2) return 0;  // leaves: the others' next collective fails
      absl::Status s = (*c)->Barrier();
      CHILD_EXPECT(s.code() == absl::StatusCode::kUnavailable, 3, s.ToString());
    }
    if (rank == 2) return 0;
    // The survivors re-form as a group of two and serve the next request.
    auto c = ShmCollective::Create(Options(second, rank, 2));
    CHILD_EXPECT(c.ok(), 4, c.status().ToString());
    float v = 1.0f + rank;
    CHILD_EXPECT((*c)->AllReduceSum(&v, &v, 1).ok(), 5);
    CHILD_EXPECT(v == 3.0f, 6, v);
    return 0;
  });
  ExpectAllOk(exits);
}

TEST(ShmCollectiveTest, JoinTimesOutWhenARankNeverComesAndLeavesNoObject) {
  const std::string group = UniqueGroup("join");
  ShmCollectiveOptions o = Options(group, 0, 2);
  o.join_timeout = absl::Milliseconds(300);
  const absl::Time start = absl::Now();
  auto c = ShmCollective::Create(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded) << c.status();
  EXPECT_TRUE(absl::StrContains(c.status().message(), "{1}")) << c.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_FALSE(ObjectExists(group));
  // Rank 1 alone times out waiting for rank 0 to create the object.
  o.rank = 1;
  c = ShmCollective::Create(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded) << c.status();
}

TEST(ShmCollectiveTest, RefusesAnObjectOthersCanAccess) {
  const std::string group = UniqueGroup("perm");
  const std::string name = ShmGroupObjectName(group);
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::fchmod(fd, 0644), 0);
  ASSERT_EQ(::ftruncate(fd, 1 << 20), 0);
  ::close(fd);
  ShmCollectiveOptions o = Options(group, 1, 2);
  o.join_timeout = absl::Seconds(2);
  auto c = ShmCollective::Create(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kPermissionDenied) << c.status();
  ::shm_unlink(name.c_str());
}

TEST(ShmCollectiveTest, RankZeroReplacesAStaleObjectAndTheGroupForms) {
  const std::string group = UniqueGroup("stale");
  const std::string name = ShmGroupObjectName(group);
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 4096), 0);  // garbage left by a "crashed" group
  ::close(fd);
  auto exits = ForkRanks(2, [&](int rank) -> int {
    auto c = ShmCollective::Create(Options(group, rank, 2));
    CHILD_EXPECT(c.ok(), 2, c.status().ToString());
    CHILD_EXPECT((*c)->Barrier().ok(), 3);
    return 0;
  });
  ExpectAllOk(exits);
  EXPECT_FALSE(ObjectExists(group));
}

// ShmCollectiveOptions::cancelled: a rank waiting to join, or waiting for a peer inside a
// collective, gives up with Cancelled once it returns true, and its peers' collectives fail with
// Unavailable naming it.
TEST(ShmCollectiveTest, CancelledWhileJoiningOrWaitingGivesUpAndFailsThePeers) {
  // Joining: rank 0 alone, cancelled after 100 ms; the object it created is removed.
  {
    const std::string group = UniqueGroup("cancel-join");
    ShmCollectiveOptions o = Options(group, 0, 2);
    const absl::Time start = absl::Now();
    o.cancelled = [start] { return absl::Now() - start > absl::Milliseconds(100); };
    auto c = ShmCollective::Create(o);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kCancelled) << c.status();
    EXPECT_LT(absl::Now() - start, absl::Seconds(2));
    EXPECT_FALSE(ObjectExists(group));
    o.rank = 1;  // waiting for rank 0 to create the object
    c = ShmCollective::Create(o);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kCancelled) << c.status();
  }
  // Inside a collective: rank 0 waits for rank 1 (alive, busy for 2 s) and gives up after 200 ms.
  const std::string group = UniqueGroup("cancel-op");
  auto exits = ForkRanks(2, [&](int rank) -> int {
    ShmCollectiveOptions o = Options(group, rank, 2);
    absl::Time armed = absl::InfiniteFuture();
    if (rank == 0) o.cancelled = [&armed] { return absl::Now() > armed; };
    auto c = ShmCollective::Create(o);
    CHILD_EXPECT(c.ok(), 2, c.status().ToString());
    CHILD_EXPECT((*c)->Barrier().ok(), 3);
    if (rank == 0) {
      armed = absl::Now() + absl::Milliseconds(200);
      const absl::Time start = absl::Now();
      const absl::Status s = (*c)->Barrier();
      CHILD_EXPECT(s.code() == absl::StatusCode::kCancelled, 4, s.ToString());
      CHILD_EXPECT(absl::Now() - start < absl::Seconds(1), 5);
      return 0;
    }
    absl::SleepFor(absl::Seconds(2));
    const absl::Status s = (*c)->Barrier();
    CHILD_EXPECT(s.code() == absl::StatusCode::kUnavailable, 6, s.ToString());
    CHILD_EXPECT(absl::StrContains(s.message(), "rank 0 gave up (cancelled)"), 7, s.ToString());
    return 0;
  });
  ExpectAllOk(exits);
}

// Objects of groups whose creator died before the group formed are garbage: RemoveStaleShmGroups
// removes them and keeps those of live creators; RemoveShmGroup removes one by name.
TEST(ShmCollectiveTest, StaleObjectsOfDeadCreatorsAreRemoved) {
  const std::string dead = UniqueGroup("stale-dead");
  const std::string live = UniqueGroup("stale-live");
  auto start_rank0 = [](const std::string& group) {
    return ForkedChild::Start([group] {
      ShmCollectiveOptions o = Options(group, 0, 2);
      o.join_timeout = absl::Seconds(30);
      (void)ShmCollective::Create(o);  // waits for rank 1, who never comes
      return 0;
    });
  };
  ForkedChild dying = start_rank0(dead);
  ForkedChild waiting = start_rank0(live);
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while ((!ObjectExists(dead) || !ObjectExists(live)) && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(ObjectExists(dead) && ObjectExists(live));
  // Both publish their headers (the magic, "MOECOMM1", is the first field and is stored last):
  // an object without one is only stale after a minute.
  while ((!HeaderPublished(dead) || !HeaderPublished(live)) && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(HeaderPublished(dead) && HeaderPublished(live));
  ::kill(dying.pid(), SIGKILL);
  EXPECT_EQ(dying.Wait(std::chrono::seconds(5)).signal, SIGKILL);
  auto removed = RemoveStaleShmGroups();
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_GE(*removed, 1);
  EXPECT_FALSE(ObjectExists(dead));
  EXPECT_TRUE(ObjectExists(live));
  auto by_name = RemoveShmGroup(live);
  ASSERT_TRUE(by_name.ok()) << by_name.status();
  EXPECT_TRUE(*by_name);
  EXPECT_FALSE(ObjectExists(live));
  by_name = RemoveShmGroup(live);
  ASSERT_TRUE(by_name.ok());
  EXPECT_FALSE(*by_name);
  EXPECT_EQ(RemoveShmGroup("../etc").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ShmCollectiveTest, RejectsBadOptions) {
  ShmCollectiveOptions o = Options("bad/name", 0, 1);
  EXPECT_EQ(ShmCollective::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options(UniqueGroup("opts"), 2, 2);
  EXPECT_EQ(ShmCollective::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options(UniqueGroup("opts"), 0, 1);
  o.channel_bytes = 100;
  EXPECT_EQ(ShmCollective::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ShmCollectiveTest, WorldOfOneCopiesLocally) {
  auto c = ShmCollective::Create(Options(UniqueGroup("one"), 0, 1));
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<int> a = {1, 2, 3}, b(3);
  ASSERT_TRUE((*c)->RingSendRecv(a.data(), 12, b.data(), 12).ok());
  EXPECT_EQ(a, b);
  EXPECT_TRUE((*c)->Barrier().ok());
  EXPECT_EQ((*c)->counters().total_sent(), 0u);
}

}  // namespace
}  // namespace hmoe
