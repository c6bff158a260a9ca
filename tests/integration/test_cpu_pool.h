#pragma once

// The CPU worker pool the engine, device and DSLP tests share: one node, 2 unpinned threads
// (the machines here have 2 cores), created on first use and kept for the process's life (a
// pool's threads must outlive every device and engine that uses it, and those live in
// function-local statics of the tests too).

#include "common/base/logging.h"
#include "common/ops/cpu/cpu_worker_pool.h"

namespace hmoe::testing {

inline CpuWorkerPool& TestCpuPool() {
  static CpuWorkerPool* const pool = [] {
    CpuWorkerPoolOptions options;
    options.num_nodes = 1;
    options.threads_per_node = 2;
    options.pin_threads = false;
    auto p = CpuWorkerPool::Create(options);
    HMOE_CHECK_OK(p.status());
    return p->release();
  }();
  return *pool;
}

}  // namespace hmoe::testing
