#!/usr/bin/env python3
"""`gpupool knn` at scale, with a plain torch loop beside it on the same files in the same run.

Jobs (files are written to --workdir once and reused while their size matches):
  u8   BigANN-like base: --rows-u8 x 128 uint8 as TEXMEX .bvecs (13.2 GB for 10^8 rows), clustered
       (1024 uint8 centres + integer noise in [-12, 12]); --queries queries of the same distribution
  f32  --rows-f32 x 128 float32 as .fvecs (15.5 GB for 3*10^7 rows), clustered (N(0,1) centres +
       0.5 N(0,1) noise); --queries fp32 queries
Blocks are generated on the GPU with torch when CUDA is there (numpy otherwise), flushed to disk,
and each base is read through once before the runs (page-cache read rate printed). For each job:
the wall time of the whole `gpu-bin/gpupool knn ... --json --quiet` process, the median of --repeat
runs, and that run's JSON summary; torch (one run): memmap, 500k-row chunks
uploaded and converted to float32 on the GPU, addmm distances, topk, running top-k merged on the GPU,
TF32 off, reading included; recall@k of torch's ids against gpupool's; u8: gpupool's distances of
20 random queries against exact int64 numpy; f32: against fp64 numpy, and its ids against an fp64
top-k over the whole base (torch float64 on the GPU, chunked). Every figure goes to WORKDIR/knn_scale.json.

  python3 bench/knn_scale.py --workdir /tmp/knnscale [--rows-u8 100000000] [--rows-f32 30000000]
      [--queries 10000] [--k 100] [--only u8|f32] [--repeat 3] [--skip-torch] [--gpupool-args "..."]
Exits 0 with a message when numpy, PyTorch or a CUDA device is missing (unless --skip-torch).
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time

try:
    import numpy as np
except ImportError:
    print("knn_scale: numpy is not installed; nothing measured")
    sys.exit(0)
try:
    import torch
    CUDA = torch.cuda.is_available()
except ImportError:
    torch, CUDA = None, False

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIM, CENTRES, BLOCK, CHUNK, CHECKS = 128, 1024, 2_000_000, 500_000, 20


def centres(kind):
    rng = np.random.default_rng(11)  # the same centres for base and queries, torch or numpy
    if kind == "u8":
        return rng.integers(16, 240, size=(CENTRES, DIM), dtype=np.int16)
    return rng.standard_normal((CENTRES, DIM), dtype=np.float32)


def sample(kind, n, seed):
    """n clustered rows (uint8 or float32), drawn on the GPU when there is one."""
    c = centres(kind)
    if CUDA:
        g = torch.Generator(device="cuda").manual_seed(seed)
        ct = torch.from_numpy(c).cuda()
        rows = ct[torch.randint(0, CENTRES, (n,), device="cuda", generator=g)]
        if kind == "u8":
            noise = torch.randint(-12, 13, (n, DIM), device="cuda", generator=g, dtype=torch.int16)
            return (rows + noise).clamp_(0, 255).to(torch.uint8).cpu().numpy()
        return (rows + 0.5 * torch.randn((n, DIM), device="cuda", generator=g)).cpu().numpy()
    rng = np.random.default_rng(seed)
    rows = c[rng.integers(0, CENTRES, size=n)]
    if kind == "u8":
        return np.clip(rows + rng.integers(-12, 13, size=(n, DIM), dtype=np.int16), 0, 255).astype(np.uint8)
    return rows + np.float32(0.5) * rng.standard_normal((n, DIM), dtype=np.float32)


def records(x):
    """TEXMEX records: int32 little-endian dimension, then the row (uint8 -> .bvecs, float32 -> .fvecs)."""
    head = np.array([x.shape[1]], dtype="<i4").view(x.dtype)
    out = np.empty((x.shape[0], len(head) + x.shape[1]), dtype=x.dtype)
    out[:, :len(head)] = head
    out[:, len(head):] = x
    return out


def write_vecs(path, kind, n, seed):
    start = time.perf_counter()
    with open(path + ".part", "wb") as f:
        for first in range(0, n, BLOCK):
            records(sample(kind, min(BLOCK, n - first), seed + first)).tofile(f)
    os.replace(path + ".part", path)
    return time.perf_counter() - start


def vecs_memmap(path):
    """Rows of a .bvecs (uint8) or .fvecs (float32) file, without the headers, through a memmap."""
    dim = int(np.fromfile(path, dtype="<i4", count=1)[0])
    if path.endswith(".bvecs"):
        return np.memmap(path, dtype=np.uint8, mode="r").reshape(-1, dim + 4)[:, 4:]
    return np.memmap(path, dtype=np.float32, mode="r").reshape(-1, dim + 1)[:, 1:]


def warm(path):
    """Read the file through once (page cache); returns GB/s."""
    buf, total, start = bytearray(64 << 20), 0, time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while (got := f.readinto(buf)):
            total += got
    return total / 1e9 / (time.perf_counter() - start)


def run_gpupool(args, base, query, out):
    cmd = [args.gpupool, "knn", "--base", base, "--query", query, "--k", str(args.k), "--out", out,
           "--json", "--quiet"] + shlex.split(args.gpupool_args)
    if CUDA:
        torch.cuda.empty_cache()  # leave the GPU's memory to gpupool
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        return time.perf_counter() - start, None, str(e)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        return seconds, None, f"exit {done.returncode}: {done.stderr.strip()}"
    try:
        return seconds, json.loads(done.stdout), None
    except ValueError:
        return seconds, None, f"stdout is not JSON: {done.stdout[:2000]!r}; stderr: {done.stderr.strip()}"


def merge(best_d, best_i, d, first, k):
    """Running top-k on the GPU: the chunk's top-k appended to the running one, top-k again."""
    cd, ci = torch.topk(d, min(k, d.shape[1]), dim=1, largest=False)
    best_d, order = torch.topk(torch.cat([best_d, cd], 1), k, dim=1, largest=False)
    return best_d, torch.gather(torch.cat([best_i, ci + first], 1), 1, order)


def gpu_topk(base, queries, k, dtype):
    """Chunked exact top-k with torch: ||q||^2 + ||x||^2 - 2 q.x via addmm; (ids, distances)."""
    q = torch.from_numpy(np.ascontiguousarray(queries)).cuda().to(dtype)
    q_norms = (q * q).sum(1, keepdim=True)
    best_d = torch.full((q.shape[0], k), float("inf"), dtype=dtype, device="cuda")
    best_i = torch.full((q.shape[0], k), -1, dtype=torch.int64, device="cuda")
    for first in range(0, base.shape[0], CHUNK):
        x = torch.from_numpy(np.ascontiguousarray(base[first:first + CHUNK])).cuda(non_blocking=True).to(dtype)
        d = torch.addmm(q_norms + (x * x).sum(1)[None, :], q, x.T, beta=1, alpha=-2).clamp_min_(0)
        best_d, best_i = merge(best_d, best_i, d, first, k)
        del d, x
    torch.cuda.synchronize()
    return best_i.cpu().numpy(), best_d.cpu().numpy()


def exact_topk64(base, queries, k):
    """fp64 top-k over the whole base for a few queries (torch float64 on the GPU; numpy without one)."""
    if CUDA:
        return gpu_topk(base, queries, k, torch.float64)[0]
    q = queries.astype(np.float64)
    cand_d, cand_i = [], []
    for first in range(0, base.shape[0], CHUNK):
        x = np.asarray(base[first:first + CHUNK], dtype=np.float64)
        d = (q * q).sum(1)[:, None] + (x * x).sum(1)[None, :] - 2 * q @ x.T
        part = np.argpartition(d, min(k, d.shape[1]) - 1, axis=1)[:, :k]
        cand_d.append(np.take_along_axis(d, part, 1))
        cand_i.append(part + first)
    d, i = np.concatenate(cand_d, 1), np.concatenate(cand_i, 1)
    return np.take_along_axis(i, np.argsort(d, 1)[:, :k], 1)


def read_vecs_out(path, dtype):
    raw = np.fromfile(path, dtype=dtype)
    k = int(raw[:1].view("<i4")[0])
    return raw.reshape(-1, k + 1)[:, 1:]


def recall(truth, result, k):
    hits = sum(len(set(t[:k].tolist()) & set(r[:k].tolist())) for t, r in zip(truth, result))
    return hits / (len(truth) * k)


def run_job(args, kind):
    rows = args.rows_u8 if kind == "u8" else args.rows_f32
    ext, rec = (".bvecs", DIM + 4) if kind == "u8" else (".fvecs", (DIM + 1) * 4)
    base = os.path.join(args.workdir, f"base_{kind}_{rows}{ext}")
    query = os.path.join(args.workdir, f"query_{kind}_{args.queries}{ext}")
    res = {"job": kind, "rows": rows, "queries": args.queries, "k": args.k, "base": base}
    if os.path.exists(base) and os.path.getsize(base) == rows * rec:
        print(f"knn_scale {kind}: reusing {base}")
    else:
        res["generate_seconds"] = write_vecs(base, kind, rows, seed=1)
        print(f"knn_scale {kind}: wrote {rows} x {DIM} ({rows * rec / 1e9:.2f} GB) in "
              f"{res['generate_seconds']:.1f} s ({'torch on the GPU' if CUDA else 'numpy'})")
    write_vecs(query, kind, args.queries, seed=10**12)
    os.sync()  # written pages still going to disk would slow the timed reads
    res["page_cache_gbps"] = warm(base)
    print(f"knn_scale {kind}: page-cache read {res['page_cache_gbps']:.2f} GB/s")

    out = os.path.join(args.workdir, kind)
    runs = []
    for _ in range(args.repeat):
        gp_seconds, summary, error = run_gpupool(args, base, query, out)
        if error:
            res.update(gpupool_seconds=gp_seconds, summary=summary, error=error)
            print(f"knn_scale {kind}: gpupool knn failed after {gp_seconds:.2f} s: {error}")
            return res
        runs.append((gp_seconds, summary))
    # The median run stands for gpupool (every run's whole-process seconds are kept).
    gp_seconds, summary = sorted(runs, key=lambda run: run[0])[len(runs) // 2]
    res.update(gpupool_seconds=gp_seconds, gpupool_runs=[run[0] for run in runs], summary=summary,
               error=None)
    print(f"knn_scale {kind}: gpupool knn {gp_seconds:.2f} s whole process; summary:\n"
          + json.dumps(summary, indent=1))
    gp_ids = read_vecs_out(out + ".neighbors.ivecs", "<i4")
    gp_d = read_vecs_out(out + ".distances.fvecs", "<f4")
    base_rows, q_rows = vecs_memmap(base), np.array(vecs_memmap(query))

    pick = np.random.default_rng(5).choice(len(q_rows), size=min(CHECKS, len(q_rows)), replace=False)
    if kind == "u8":
        got = base_rows[gp_ids[pick].ravel()].astype(np.int64).reshape(len(pick), args.k, DIM)
        exact = ((got - q_rows[pick, None, :].astype(np.int64)) ** 2).sum(2)
        res["distance_mismatches"] = int((exact != gp_d[pick]).sum())
        print(f"knn_scale {kind}: {len(pick)} queries: {res['distance_mismatches']} of "
              f"{exact.size} distances differ from exact int64")
    else:
        got = base_rows[gp_ids[pick].ravel()].astype(np.float64).reshape(len(pick), args.k, DIM)
        exact = ((got - q_rows[pick, None, :].astype(np.float64)) ** 2).sum(2)
        res["distance_max_abs_diff_fp64"] = float(np.abs(exact - gp_d[pick]).max())
        start = time.perf_counter()
        ref = exact_topk64(base_rows, q_rows[pick], args.k)
        res["id_mismatches_fp64"] = int(sum(args.k - len(set(a.tolist()) & set(b.tolist()))
                                            for a, b in zip(ref, gp_ids[pick])))
        print(f"knn_scale {kind}: {len(pick)} queries: max |distance - fp64| "
              f"{res['distance_max_abs_diff_fp64']:.3g}; {res['id_mismatches_fp64']} of "
              f"{ref.size} ids not in the fp64 top-{args.k} ({time.perf_counter() - start:.1f} s)")

    torch_text = "torch skipped"
    if not args.skip_torch:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.cuda.synchronize()
        start = time.perf_counter()
        t_ids, t_d = gpu_topk(base_rows, q_rows, args.k, torch.float32)
        res["torch_seconds"] = t_s = time.perf_counter() - start
        res["recall"] = recall(gp_ids, t_ids, args.k)
        res["sorted_distance_max_abs_diff"] = float(np.abs(np.sort(t_d, 1) - np.sort(gp_d, 1)).max())
        torch.cuda.empty_cache()
        torch_text = (f"torch {t_s:.2f} s, ratio torch/gpupool {t_s / gp_seconds:.2f}x, recall@{args.k} "
                      f"{res['recall']:.6f} (sorted distances max diff {res['sorted_distance_max_abs_diff']:.3g})")
    print(f"knn_scale {kind}: gpupool {gp_seconds:.2f} s (median of {len(runs)}: "
          f"{', '.join(f'{r[0]:.2f}' for r in runs)}; job {summary.get('seconds', float('nan')):.2f} s), "
          f"{torch_text}")
    return res


def run_jobs(args, results, run_job, name):
    """Each job of --only (u8 and f32 by default) into results["jobs"], the whole of results written to
    WORKDIR/<name>.json after each job."""
    path = os.path.join(args.workdir, f"{name}.json")
    for kind in [args.only] if args.only else ["u8", "f32"]:
        results["jobs"].append(run_job(args, kind))
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    print(f"{name}: figures in {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/knnscale")
    parser.add_argument("--rows-u8", type=int, default=100_000_000)
    parser.add_argument("--rows-f32", type=int, default=30_000_000)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--only", choices=["u8", "f32"])
    parser.add_argument("--repeat", type=int, default=3, help="gpupool runs per job (the median is reported)")
    parser.add_argument("--skip-torch", action="store_true", help="no torch loop (gpupool and checks only)")
    parser.add_argument("--gpupool", default=os.path.join(ROOT, "gpu-bin", "gpupool"))
    parser.add_argument("--gpupool-args", default="", help="extra arguments for gpupool knn (one string)")
    args = parser.parse_args()
    if not CUDA and not args.skip_torch:
        print("knn_scale: " + ("no CUDA device" if torch else "PyTorch is not installed") + "; nothing measured")
        return 0
    os.makedirs(args.workdir, exist_ok=True)
    run_jobs(args, {"args": vars(args), "jobs": []}, run_job, "knn_scale")
    return 0


if __name__ == "__main__":
    sys.exit(main())
