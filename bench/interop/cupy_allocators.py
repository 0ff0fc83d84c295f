#!/usr/bin/env python3
"""CuPy's own memory pool beside gpupool as CuPy's allocator (and plain cudaMalloc), on one GPU in
one run. Each (workload, allocator) pair runs in a fresh process, on a non-blocking stream, timed
per step between stream synchronizations; ms per step is the median after the warm-up steps.

Workloads (--workload, both by default):

  knn         a brute-force kNN over batches of queries (matmul, norms, argpartition: many
              temporaries of many sizes); the neighbours must be identical across allocators.
  fft-matmul  per step, with sizes drawn from a fixed-seed schedule: a batch of complex 1-D FFTs
              (fft, spectral whitening, ifft) of a length among powers of two, smooth and prime
              lengths (2^14..2^22 elements), a real 2-D FFT low-pass (rfft2, irfft2) of a shape
              among 2^14..2^22 elements, and two float32 matrix products (256..4096 a side) with
              elementwise work around them. The checksum of a step is the sum of |x| over its
              outputs, reduced in float64 and fetched to the host; the checksums must agree across
              allocators within CHECKSUM_TOLERANCE (bit-identical is expected: same GPU, same plans,
              one stream). cuFFT plans take their work areas from the allocator and CuPy's plan
              cache (16 plans) holds them, so the peaks include them; the cache is cleared after
              the run.

Memory held: CuPy's pool, its total_bytes() sampled after every step, the largest kept (it
returns nothing to the device by itself); gpupool, its peak_reserved_bytes; cudaMalloc holds only
live buffers and is not measured. The driver prints gpupool / CuPy pool ratios of both.

    python3 bench/interop/cupy_allocators.py [--workload knn|fft-matmul|all] [--warmup 3]
        [--base 200000] [--queries 256] [--batches 40] [--k 10]      (knn)
        [--steps 40] [--seed 0]                                      (fft-matmul)
    python3 bench/interop/cupy_allocators.py --workload W --allocator cupy|gpupool|cudamalloc
                                                                     (one run, this process)
"""
import argparse
import collections
import hashlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

ALLOCATORS = ("cupy", "gpupool", "cudamalloc")

# Integer options: (name, default, help). The driver passes all of them on to each run.
OPTIONS = (
    ("--base", 200_000, "knn: base vectors, 128 floats each"),
    ("--queries", 256, "knn: queries per batch"),
    ("--batches", 40, "knn: batches (steps), warm-up included"),
    ("--k", 10, "knn: neighbours per query"),
    ("--steps", 40, "fft-matmul: steps, warm-up included"),
    ("--seed", 0, "seed of the data and of fft-matmul's size schedule"),
    ("--warmup", 3, "steps left out of the median"),
)

# ---- fft-matmul: the size schedule (pure Python: the same on every run and testable without a GPU)

# 1-D lengths: powers of two, 3- and 5-smooth lengths, 10^6, and a prime (Bluestein in cuFFT).
FFT_LENGTHS = (1 << 14, 3 << 13, 65_537, 5 ** 7, 1 << 17, 3 ** 11, 3 << 18, 1_000_000, 1 << 20,
               3 << 20, 1 << 22)
FFT_BATCH_ELEMENTS = 1 << 22  # a batch of 1-D transforms holds at most this many elements
# Sides of the 2-D transforms (any pair is 2^14..2^22 elements; odd ones take cuFFT's other paths).
IMAGE_SIDES = (128, 243, 256, 400, 512, 625, 1000, 1024, 2048)
MATMUL_SIDES = (256, 384, 500, 512, 768, 1000, 1024, 1536, 2048, 3000, 4096)

FftMatmulStep = collections.namedtuple("FftMatmulStep", "length batch image m k n")


def fft_matmul_schedule(steps, seed=0):
    """The sizes of each step: 1-D length and batch, 2-D shape, and matrix sides m, k, n."""
    chooser = random.Random(seed)
    schedule = []
    for _ in range(steps):
        length = chooser.choice(FFT_LENGTHS)
        image = (chooser.choice(IMAGE_SIDES), chooser.choice(IMAGE_SIDES))
        m, k, n = (chooser.choice(MATMUL_SIDES) for _ in range(3))
        schedule.append(FftMatmulStep(length, FFT_BATCH_ELEMENTS // length, image, m, k, n))
    return schedule


# ---- comparing results across allocators (pure Python)

# Relative difference allowed between two allocators' checksums of one step. Allocators change
# only addresses (all are 256-byte aligned), so cuFFT and cuBLAS should pick the same kernels and
# give identical bits; were one to pick another algorithm (float32, other summation order), a sum
# of |x| over 10^5..10^7 elements would move by far less than this.
CHECKSUM_TOLERANCE = 1e-6


def max_relative_difference(a, b):
    return max((abs(x - y) / max(abs(x), abs(y), 1e-300) for x, y in zip(a, b)), default=0.0)


def compare_digests(results):
    """knn: the digests of the neighbours, by allocator. Returns (same, verdict)."""
    same = len(set(results.values())) == 1
    return same, "answers identical across allocators" if same else "answers DIFFER"


def compare_checksums(results):
    """fft-matmul: the per-step checksums, by allocator. Returns (within tolerance, verdict)."""
    runs = list(results.values())
    if len({len(run) for run in runs}) != 1:
        return False, "checksums DIFFER (not as many steps)"
    if all(run == runs[0] for run in runs):
        return True, f"checksums identical across allocators ({len(runs[0])} steps)"
    difference = max(max_relative_difference(runs[0], run) for run in runs[1:])
    if difference <= CHECKSUM_TOLERANCE:
        return True, (f"checksums within {difference:.1e} relative across allocators, not bit-identical "
                      f"(tolerance {CHECKSUM_TOLERANCE:.0e})")
    return False, f"checksums DIFFER: {difference:.1e} relative (tolerance {CHECKSUM_TOLERANCE:.0e})"


# ---- one run: steps on the GPU

def time_steps(stream, count, step, record, after_step):
    """Runs step(index) count times on `stream` (the current one), each timed between two
    synchronizations; then record(its result) and after_step(), untimed. Returns ms per step."""
    times = []
    for index in range(count):
        stream.synchronize()
        start = time.perf_counter()
        result = step(index)
        stream.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        record(result)
        after_step()
    return times


def run_knn(cupy, stream, args, after_step):
    """The kNN batches; returns (ms per batch, digest of all neighbours)."""
    rng = cupy.random.default_rng(args.seed)
    data = rng.standard_normal((args.base, 128), dtype=cupy.float32)
    norms = (data * data).sum(axis=1)

    def batch(_):
        queries = rng.standard_normal((args.queries, data.shape[1]), dtype=cupy.float32)
        distances = norms[None, :] - 2 * queries @ data.T + (queries * queries).sum(axis=1)[:, None]
        nearest = cupy.argpartition(distances, args.k, axis=1)[:, :args.k]
        chosen = cupy.take_along_axis(distances, nearest, axis=1)
        order = cupy.argsort(chosen, axis=1)
        return cupy.take_along_axis(nearest, order, axis=1)

    answers = []
    times = time_steps(stream, args.batches, batch, lambda answer: answers.append(cupy.asnumpy(answer)),
                       after_step)
    return times, hashlib.sha256(b"".join(a.tobytes() for a in answers)).hexdigest()[:16]


def fft_matmul_outputs(cupy, rng, sizes):
    """One fft-matmul step of the given sizes: its three float32 / complex64 outputs."""
    shape = (sizes.batch, sizes.length)
    signal = (rng.standard_normal(shape, dtype=cupy.float32)
              + 1j * rng.standard_normal(shape, dtype=cupy.float32)).astype(cupy.complex64, copy=False)
    spectrum = cupy.fft.fft(signal)
    power = spectrum.real ** 2 + spectrum.imag ** 2
    whitened = cupy.fft.ifft(spectrum / (1 + power / power.mean(axis=-1, keepdims=True)))

    image = rng.standard_normal(sizes.image, dtype=cupy.float32)
    frequencies = cupy.fft.rfft2(image)
    frequencies[:, frequencies.shape[1] // 4:] = 0  # low-pass along the last axis
    detail = image - cupy.fft.irfft2(frequencies, s=sizes.image)

    a = rng.standard_normal((sizes.m, sizes.k), dtype=cupy.float32)
    b = rng.standard_normal((sizes.k, sizes.n), dtype=cupy.float32)
    hidden = cupy.tanh(cupy.matmul(a, b) * (1 / math.sqrt(sizes.k)))
    return whitened, detail, cupy.matmul(hidden.T, a)


def checksum(cupy, outputs):
    """The sum of |x| over all outputs, each reduced in float64 on the GPU and added on the host."""
    return sum(float(cupy.abs(x).sum(dtype=cupy.float64)) for x in outputs)


def run_fft_matmul(cupy, stream, args, after_step):
    """The fft-matmul steps; returns (ms per step, checksum per step)."""
    rng = cupy.random.default_rng(args.seed)
    schedule = fft_matmul_schedule(args.steps, args.seed)
    checksums = []
    times = time_steps(stream, len(schedule), lambda index: fft_matmul_outputs(cupy, rng, schedule[index]),
                       lambda outputs: checksums.append(checksum(cupy, outputs)), after_step)
    cupy.fft.config.get_plan_cache().clear()  # the plans' work areas go back to the allocator
    return times, checksums


# run(cupy, stream, args, after_step) -> (ms per step, result); steps: the option counting its steps.
Workload = collections.namedtuple("Workload", "run unit steps compare describe")

WORKLOADS = {
    "knn": Workload(run_knn, "batch", "batches", compare_digests,
                    lambda a: f"knn: {a.base:,} x 128 base, {a.queries} queries per batch, k {a.k}"),
    "fft-matmul": Workload(run_fft_matmul, "step", "steps", compare_checksums,
                           lambda a: f"fft-matmul: {a.steps} steps of FFTs (2^14..2^22 elements) and "
                                     f"float32 matmuls (256..4096), seed {a.seed}"),
}


def install(cupy, allocator):
    """Makes `allocator` CuPy's; returns the gpupool Pool for gpupool, else None."""
    if allocator == "gpupool":
        import gpupool.cupy
        return gpupool.cupy.install()
    if allocator == "cudamalloc":
        cupy.cuda.set_allocator(None)
    return None


def run_one(args):
    """One workload under one allocator, in this process: prints a line for people, then a JSON one."""
    import cupy
    pool = install(cupy, args.allocator)
    cupy_pool = cupy.get_default_memory_pool() if args.allocator == "cupy" else None
    held = [0]

    def after_step():
        if cupy_pool is not None:
            held[0] = max(held[0], cupy_pool.total_bytes())

    workload = WORKLOADS[args.workload]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        times, result = workload.run(cupy, stream, args, after_step)
    times = times[args.warmup:]
    summary = {"workload": args.workload, "allocator": args.allocator, "unit": workload.unit,
               "ms_median": statistics.median(times), "timed_steps": len(times),
               "peak_held_bytes": held[0] or None, "result": result}
    if pool is not None:
        stats = pool.stats(cupy.cuda.Device().id)
        summary.update(peak_held_bytes=stats.peak_reserved_bytes, allocations=stats.allocations,
                       cache_hits=stats.cache_hits)
    print(summary_line(summary))
    print(json.dumps(summary))


def summary_line(summary):
    """allocator, ms per step and what the allocator held, for people."""
    extra = ""
    if summary["allocator"] == "gpupool":
        extra = (f", gpupool peak reserved {summary['peak_held_bytes'] / 2**20:.0f} MiB, "
                 f"{summary['allocations']} allocations, {summary['cache_hits']} hits")
    elif summary["allocator"] == "cupy":
        extra = f", CuPy pool peak total {summary['peak_held_bytes'] / 2**20:.0f} MiB"
    return (f"{summary['allocator']:10} {summary['ms_median']:8.3f} ms/{summary['unit']} "
            f"(median of {summary['timed_steps']}){extra}")


# ---- the driver: every allocator in a fresh process, per workload

def child_command(args, workload, allocator):
    forwarded = [item for name, _, _ in OPTIONS for item in (name, str(getattr(args, name[2:])))]
    return [sys.executable, os.path.abspath(__file__), "--workload", workload, "--allocator", allocator,
            *forwarded]


def run_child(args, workload, allocator):
    done = subprocess.run(child_command(args, workload, allocator), capture_output=True, text=True,
                          timeout=400)
    if done.returncode:
        sys.exit(f"{workload} under {allocator} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratios_line(results):
    """gpupool / CuPy pool: time and memory held."""
    gpupool, cupy = results["gpupool"], results["cupy"]
    return (f"gpupool / CuPy pool: time {gpupool['ms_median'] / cupy['ms_median']:.3f}x, "
            f"peak held {gpupool['peak_held_bytes'] / cupy['peak_held_bytes']:.3f}x")


def drive(args, workload_name):
    """Runs one workload under every allocator; prints their lines and verdict; True when they agree."""
    workload = WORKLOADS[workload_name]
    print(workload.describe(args))
    results = {}
    for allocator in ALLOCATORS:
        results[allocator] = run_child(args, workload_name, allocator)
        print(summary_line(results[allocator]))
    print(ratios_line(results))
    same, verdict = workload.compare({name: r["result"] for name, r in results.items()})
    print(verdict)
    return same


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument("--allocator", choices=ALLOCATORS, help="run one allocator in this process")
    for name, default, text in OPTIONS:
        parser.add_argument(name, type=int, default=default, help=f"{text} (default {default})")
    args = parser.parse_args(argv)
    if args.allocator and args.workload == "all":
        parser.error("--allocator runs one --workload")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    for name in workload_names(args):
        if getattr(args, WORKLOADS[name].steps) <= args.warmup:
            parser.error(f"--{WORKLOADS[name].steps} must exceed --warmup")
    return args


def workload_names(args):
    return list(WORKLOADS) if args.workload == "all" else [args.workload]


def main():
    args = parse_args()
    if args.allocator:
        run_one(args)
        return
    agreed = [drive(args, name) for name in workload_names(args)]
    sys.exit(0 if all(agreed) else 1)


if __name__ == "__main__":
    main()
