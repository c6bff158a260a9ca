// hmoe_weightd_attach_probe: a minimal weight-store client for memory measurements. It attaches
// to a weightd instance (common/shm only: no gRPC, no engine), reads every byte of every segment
// (so every weight page is mapped into this process), prints "holding" and waits for
// SIGTERM/SIGINT. Used by tests/weightd/measure_weightd.sh to measure the proportional set size
// of weightd plus attached processes: with it, whatever exceeds the checkpoint bytes is process
// overhead that real workers have too, not a second copy of the weights.
//
//   hmoe_weightd_attach_probe INSTANCE
//
// Exit code 0 after a signal, 1 when attaching fails, 2 on bad arguments.

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "common/shm/weight_store.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s INSTANCE\n", argv[0]);
    return 2;
  }
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  auto store = hmoe::shm::WeightStore::Attach(argv[1]);
  if (!store.ok()) {
    std::fprintf(stderr, "attach %s: %s\n", argv[1], store.status().ToString().c_str());
    return 1;
  }
  uint64_t sum = 0;
  for (const hmoe::shm::WeightStore::Segment& segment : (*store)->segments()) {
    // Only the used part: reading an untouched shmem page would allocate it.
    const uint64_t used = std::min<uint64_t>(segment.bytes.size(), segment.layout.used_bytes);
    const volatile uint8_t* p = reinterpret_cast<const volatile uint8_t*>(segment.bytes.data());
    for (uint64_t i = 0; i < used; i += 64) sum += p[i];
  }
  std::printf("holding (pid %d, checksum %llu); SIGTERM to release\n", ::getpid(),
              static_cast<unsigned long long>(sum));
  std::fflush(stdout);
  int sig = 0;
  sigwait(&signals, &sig);
  return 0;
}
