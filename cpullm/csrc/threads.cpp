// Pinning torch's intra-op threads to CPUs.
#include "ops.h"

#include <ATen/Parallel.h>
#include <sched.h>

namespace cpullm {

// Pin torch's intra-op threads one per CPU: thread i of the pool runs on cpus[i]. With as
// many items as threads, at::parallel_for hands item i to thread i.
std::vector<int64_t> bind_threads(std::vector<int64_t> cpus) {
  const int64_t n = static_cast<int64_t>(cpus.size());
  at::set_num_threads(static_cast<int>(n));
  std::vector<int64_t> result(n, -1);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpus[i]), &set);
      if (sched_setaffinity(0, sizeof(set), &set) == 0) result[i] = cpus[i];
    }
  });
  return result;  // the CPU each thread got, -1 where the kernel refused
}

}  // namespace cpullm
