// pool_bench: the pool benchmark of bench/pool_benchmark.cpp as a program of its own.
#include "pool_benchmark.hpp"

int main(int argc, char** argv) { return gpupool::bench::run_pool_bench(argc, argv); }
