#!/usr/bin/env python3
"""CuPy's own memory pool beside gpupool as CuPy's allocator (and plain cudaMalloc), on one GPU in
one run: a brute-force kNN over batches (matmul, norms, argpartition: many temporaries of many
sizes) on a non-default stream, timed per batch; results compared exactly across allocators.

    python3 bench/interop/cupy_allocators.py [--base 200000] [--queries 256] [--batches 40]
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))


def workload(cupy, base, queries_per_batch, batches, k):
    stream = cupy.cuda.Stream(non_blocking=True)
    times, answers = [], []
    with stream:
        rng = cupy.random.default_rng(0)
        data = rng.standard_normal((base, 128), dtype=cupy.float32)
        norms = (data * data).sum(axis=1)
        for batch in range(batches):
            stream.synchronize()
            start = time.perf_counter()
            queries = rng.standard_normal((queries_per_batch, data.shape[1]), dtype=cupy.float32)
            distances = norms[None, :] - 2 * queries @ data.T + (queries * queries).sum(axis=1)[:, None]
            nearest = cupy.argpartition(distances, k, axis=1)[:, :k]
            chosen = cupy.take_along_axis(distances, nearest, axis=1)
            order = cupy.argsort(chosen, axis=1)
            answer = cupy.take_along_axis(nearest, order, axis=1)
            stream.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
            answers.append(cupy.asnumpy(answer))
    return times[3:], answers


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", type=int, default=200_000)
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--allocator", choices=["cupy", "gpupool", "cudamalloc"])
    args = parser.parse_args()
    if args.allocator is None:  # the driver: each allocator in a fresh process
        import subprocess
        results = {}
        for allocator in ("cupy", "gpupool", "cudamalloc"):
            done = subprocess.run([sys.executable, __file__, "--allocator", allocator, "--base", str(args.base),
                                   "--queries", str(args.queries), "--batches", str(args.batches)],
                                  capture_output=True, text=True, timeout=400)
            if done.returncode:
                sys.exit(f"{allocator} failed:\n{done.stderr[-3000:]}")
            results[allocator] = done.stdout.strip().splitlines()
            print(results[allocator][0])
        same = len({r[1] for r in results.values()}) == 1
        print("answers identical across allocators" if same else "answers DIFFER")
        sys.exit(0 if same else 1)

    import cupy
    if args.allocator == "gpupool":
        import gpupool.cupy
        pool = gpupool.cupy.install()
    elif args.allocator == "cudamalloc":
        cupy.cuda.set_allocator(None)
    times, answers = workload(cupy, args.base, args.queries, args.batches, args.k)
    import hashlib
    digest = hashlib.sha256(b"".join(a.tobytes() for a in answers)).hexdigest()[:16]
    extra = ""
    if args.allocator == "gpupool":
        stats = pool.stats(cupy.cuda.Device().id)
        extra = (f", gpupool peak reserved {stats.peak_reserved_bytes / 2**20:.0f} MiB, "
                 f"{stats.allocations} allocations, {stats.cache_hits} hits")
    elif args.allocator == "cupy":
        extra = f", CuPy pool total {cupy.get_default_memory_pool().total_bytes() / 2**20:.0f} MiB"
    print(f"{args.allocator:10} {statistics.median(times):8.3f} ms/batch (median of {len(times)}){extra}")
    print(digest)


if __name__ == "__main__":
    main()
