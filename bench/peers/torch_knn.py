#!/usr/bin/env python3
"""torch peers of kernel_bench: L2 matrix and kNN in PyTorch on the same shapes.

Methods per dtype (fp32, fp32 with TF32 allowed, fp16, bf16; int8: gemm and gemm+topk only, the
GEMM as torch._int_mm on per-row quantised rows, scales applied after):
  cdist      torch.cdist(q, x) ** 2 (the squared L2 matrix; cdist itself returns the root)
  gemm       ||q||^2 + ||x||^2 - 2 q.x^T through torch.addmm, clamped at 0 (the matrix, GEMM form)
  gemm+topk  the GEMM-form matrix, then torch.topk(k, largest=False), k = 10 and 100
Timing: 2 warm-ups, then --reps calls each between CUDA events; the median is printed, with
TFLOP/s (2 Q N D / time), queries/s and the fraction of the roofline floor (the same floor as
kernel_bench: max(FLOP / peak rate, bytes / copy bandwidth measured here)). Inputs are fresh
random numbers in [-1, -0.05] U [0.05, 1] (never zeros). Prints a table; --json FILE writes it too.
Exits 0 with a message when no CUDA device is present.
"""
import argparse
import json
import statistics
import sys

try:
    import torch
except ImportError:  # the peers run where PyTorch is installed; elsewhere there is nothing to do
    print("torch_knn: PyTorch is not installed; nothing measured")
    sys.exit(0)

SHAPES = [(1024, 1 << 20, 128), (1024, 1 << 20, 960), (10000, 100000, 128), (1, 1 << 20, 128),
          (8, 1 << 20, 128), (64, 1 << 20, 128)]
# Peak rates (FLOP/s) used by kernel_bench for the same precisions (see its kPeaks comment).
PEAKS = {"fp32": 67e12, "tf32": 494e12, "fp16": 790e12, "bf16": 790e12, "int8": 1979e12}
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
          "bf16": torch.bfloat16, "int8": torch.int8}


def median_ms(fn, reps):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def copy_bandwidth():
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").fill_(1)
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a), 5)
    return 2 * a.numel() / (ms * 1e-3)


def random_matrix(rows, dim, dtype):
    m = torch.rand(rows, dim, device="cuda") * 0.95 + 0.05
    m *= torch.where(torch.rand(rows, dim, device="cuda") < 0.5, -1.0, 1.0)
    return m.to(dtype)


def gemm_l2(q, x, qn, xn):
    # out = qn[:, None] + xn[None, :] - 2 q x^T, accumulated in the input dtype's GEMM
    out = torch.addmm(xn.unsqueeze(0).to(q.dtype), q, x.t(), beta=1, alpha=-2)
    out += qn.unsqueeze(1).to(q.dtype)
    return out.clamp_min_(0)


def quantize(m):
    # Per-row symmetric int8, as gpupool's convert: scale = max|x| / 127.
    scale = m.abs().amax(1) / 127
    return torch.round(m / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8), scale


def int8_methods(q, x):
    # torch._int_mm (exact int32 products) on x (N × D) and the queries padded to 8 columns (its
    # shape rule), then the rows' scales and norms, and topk over the corpus.
    (q8, qs), (x8, xs) = q, x
    pad = torch.zeros((q8.shape[0] + 7) // 8 * 8, q8.shape[1], dtype=torch.int8, device="cuda")
    pad[: q8.shape[0]] = q8
    nq = q8.shape[0]
    qn = (q8.float() ** 2).sum(1) * qs ** 2
    xn = (x8.float() ** 2).sum(1) * xs ** 2

    def l2():
        dot = torch._int_mm(x8, pad.t())[:, :nq].float() * xs.unsqueeze(1) * qs.unsqueeze(0)
        return (xn.unsqueeze(1) + qn.unsqueeze(0) - 2 * dot).clamp_min_(0)

    yield "gemm", None, l2
    for k in (10, 100):
        yield "gemm+topk", k, lambda k=k: torch.topk(l2(), k, dim=0, largest=False)


def methods(q, x):
    if isinstance(q, tuple):
        yield from int8_methods(q, x)
        return
    qn = (q.float() ** 2).sum(1)
    xn = (x.float() ** 2).sum(1)
    yield "cdist", None, lambda: torch.cdist(q, x) ** 2
    yield "gemm", None, lambda: gemm_l2(q, x, qn, xn)
    for k in (10, 100):
        yield "gemm+topk", k, lambda k=k: torch.topk(gemm_l2(q, x, qn, xn), k, dim=1,
                                                     largest=False)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--shape", action="append", default=[],
                        help="only this shape, QxNxD (repeatable; default: kernel_bench's four)")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shape] or SHAPES
    if not torch.cuda.is_available():
        print("torch_knn: no CUDA device; nothing measured")
        return 0
    bandwidth = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth "
          f"(read + write) {bandwidth / 1e12:.2f} TB/s; median of {args.reps} (CUDA events)\n")
    print(f"{'method':<13} {'prec':<5} {'Q x N x D':<20} {'ms':>10} {'floor ms':>9} "
          f"{'TFLOP/s':>8} {'queries/s':>13} {'floor/t':>7}")
    rows = []
    for (nq, n, d) in shapes:
        for name, dtype in DTYPES.items():
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            if dtype == torch.int8:
                q, x = quantize(random_matrix(nq, d, torch.float32)), quantize(random_matrix(n, d, torch.float32))
                esize = 1
            else:
                q, x = random_matrix(nq, d, dtype), random_matrix(n, d, dtype)
                esize = q.element_size()
            for method, k, fn in methods(q, x):
                label = f"{method} k={k}" if k else method
                shape = f"{nq}x{n}x{d}"
                try:
                    ms = median_ms(fn, args.reps)
                except RuntimeError as e:  # e.g. cdist without a kernel for this dtype
                    print(f"{label:<13} {name:<5} {shape:<20} ERROR {str(e).splitlines()[0]}")
                    torch.cuda.empty_cache()
                    continue
                flops = 2.0 * nq * n * d
                out_bytes = nq * k * 8 if k else nq * n * 4
                floor_ms = max(flops / PEAKS[name],
                               ((nq + n) * d * esize + out_bytes) / bandwidth) * 1e3
                row = {"method": method, "variant": name, "q": nq, "n": n, "d": d, "k": k or 0,
                       "ms": ms, "floor_ms": floor_ms, "tflops": flops / (ms * 1e-3) / 1e12,
                       "queries_per_s": nq / (ms * 1e-3), "floor_fraction": floor_ms / ms}
                rows.append(row)
                print(f"{label:<13} {name:<5} {shape:<20} {ms:>10.3f} {floor_ms:>9.3f} "
                      f"{row['tflops']:>8.1f} {row['queries_per_s']:>13.0f} "
                      f"{row['floor_fraction']:>7.3f}", flush=True)
            del q, x
            torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "copy_bandwidth_bytes_per_s": bandwidth, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
