// The pool benchmark as a function, so that both the pool_bench executable and the `gpupool
// bench` command run it (bench/pool_benchmark.cpp says what it measures).
#pragma once

namespace gpupool::bench {

// argv as pool_bench takes it: [--quick] [--json FILE] [--threads 1,2,4,8,16] [--only BENCH]. Returns the exit
// status: 0 done, 1 no device, 2 bad usage.
int run_pool_bench(int argc, char** argv);

}  // namespace gpupool::bench
