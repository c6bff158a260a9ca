#include "common/ops/cpu/cpu_worker_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include <immintrin.h>
#include <numa.h>

#include "common/base/logging.h"

namespace hmoe {
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
    }
  }
  return cpus;
}

// The CPUs this process may use on each NUMA node that has any; one pseudo-node holding every
// allowed CPU when libnuma reports no NUMA support.
std::vector<std::pair<int, std::vector<int>>> NodeCpus() {
  const std::vector<int> allowed = AllowedCpus();
  std::vector<std::pair<int, std::vector<int>>> nodes;
  if (numa_available() >= 0) {
    bitmask* mask = numa_allocate_cpumask();
    for (int node = 0; node <= numa_max_node(); ++node) {
      if (numa_node_to_cpus(node, mask) != 0) continue;
      std::vector<int> cpus;
      for (int c : allowed) {
        if (numa_bitmask_isbitset(mask, c)) cpus.push_back(c);
      }
      if (!cpus.empty()) nodes.emplace_back(node, std::move(cpus));
    }
    numa_free_cpumask(mask);
  }
  if (nodes.empty()) nodes.emplace_back(0, allowed);
  return nodes;
}

void Pause() { _mm_pause(); }

}  // namespace

absl::StatusOr<std::unique_ptr<CpuWorkerPool>> CpuWorkerPool::Create(
    const CpuWorkerPoolOptions& options) {
  if (options.num_nodes < 0 || options.threads_per_node < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cpu worker pool: negative size (nodes ",
                                                   options.num_nodes, ", threads per node ",
                                                   options.threads_per_node, ")"));
  }
  const std::vector<std::pair<int, std::vector<int>>> machine = NodeCpus();
  const int real_count = static_cast<int>(machine.size());
  const int num_nodes = options.num_nodes > 0 ? options.num_nodes : real_count;
  // Virtual nodes per real node (rounded up), which share that node's CPUs.
  const int sharing = (num_nodes + real_count - 1) / real_count;
  int threads_per_node = options.threads_per_node;
  if (threads_per_node == 0) {
    threads_per_node = std::max<int>(1, static_cast<int>(machine[0].second.size()) / sharing);
  }
  std::vector<int> real_nodes;
  for (const auto& [node, cpus] : machine) real_nodes.push_back(node);

  std::unique_ptr<CpuWorkerPool> pool(
      new CpuWorkerPool(num_nodes, threads_per_node, real_nodes, options.spin));
  pool->threads_.reserve(pool->num_threads());
  for (int t = 1; t < pool->num_threads(); ++t) {
    std::vector<int> pin;
    const int node = t / threads_per_node;
    const std::vector<int>& cpus = machine[node % real_count].second;
    if (options.pin_threads && !cpus.empty()) {
      // The k-th virtual node on a real node takes the k-th group of its CPUs.
      const int k = node / real_count;
      pin.push_back(cpus[(k * threads_per_node + t % threads_per_node) % cpus.size()]);
    }
    try {
      pool->threads_.emplace_back([p = pool.get(), t, pin = std::move(pin)]() mutable {
        p->WorkerLoop(t, std::move(pin));
      });
    } catch (const std::exception& e) {
      // The destructor stops the threads started so far.
      return absl::InternalError(absl::StrCat("cpu worker pool: start thread ", t, ": ", e.what()));
    }
  }
  HMOE_VLOG(1) << "cpu worker pool: " << num_nodes << " node(s) x " << threads_per_node
               << " thread(s), " << real_count << " NUMA node(s) on this machine";
  return pool;
}

CpuWorkerPool::CpuWorkerPool(int num_nodes, int threads_per_node, std::vector<int> real_nodes,
                             absl::Duration spin)
    : num_nodes_(num_nodes),
      threads_per_node_(threads_per_node),
      real_nodes_(std::move(real_nodes)),
      spin_ns_(absl::ToInt64Nanoseconds(spin)) {}

CpuWorkerPool::~CpuWorkerPool() {
  // Release: a worker that sees the new generation also sees stop_.
  stop_.store(true, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  threads_.clear();  // joins
}

void CpuWorkerPool::WorkerLoop(int thread, std::vector<int> cpus) {
  if (!cpus.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c : cpus) CPU_SET(c, &set);
    if (const int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set); rc != 0) {
      HMOE_LOG(WARNING) << "cpu worker pool: cannot pin thread " << thread << " to cpu " << cpus[0]
                        << " (error " << rc << ")";
    }
  }
  uint32_t seen = 0;
  while (true) {
    uint32_t current = generation_.load(std::memory_order_acquire);
    if (current == seen) {
      const int64_t deadline = NowNs() + spin_ns_;
      for (int i = 0; (current = generation_.load(std::memory_order_acquire)) == seen; ++i) {
        if ((i & 63) == 63 && NowNs() > deadline) {
          generation_.wait(seen, std::memory_order_acquire);
        } else {
          Pause();
        }
      }
    }
    seen = current;
    if (stop_.load(std::memory_order_relaxed)) return;
    (*job_)(thread);
    // acq_rel: publishes this job's writes to Run (which acquires pending_), and orders this
    // worker's next read of job_ after the caller's next write (made after it saw zero).
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_.notify_one();
  }
}

void CpuWorkerPool::Run(absl::FunctionRef<void(int)> job) {
  HMOE_CHECK(!running_.exchange(true, std::memory_order_acquire)) << "overlapping Run calls";
  job_ = &job;
  pending_.store(num_threads() - 1, std::memory_order_relaxed);
  // Release: workers that acquire the new generation see job_ and pending_.
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  job(0);
  const int64_t deadline = NowNs() + spin_ns_;
  for (int i = 0;; ++i) {
    // Acquire: the workers' writes made during the job are visible after this load sees zero.
    const int pending = pending_.load(std::memory_order_acquire);
    if (pending == 0) break;
    if ((i & 63) == 63 && NowNs() > deadline) {
      pending_.wait(pending, std::memory_order_acquire);
    } else {
      Pause();
    }
  }
  job_ = nullptr;
  running_.store(false, std::memory_order_release);
}

}  // namespace hmoe
