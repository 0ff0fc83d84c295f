#!/usr/bin/env python3
"""The `gpupool knn` job on the GPU, with torch beside it on the same files (run by gpu-check.sh).

Jobs:
  fashion-mnist  the default job's data (10k test x 60k train x 784, k = 100), from
                 gpu-bin/data/ (tools/build-gpu-bin.sh copies the Debian package's files there)
  synthetic      N(0,1) base of --rows x 128 float32 written as .fvecs to --workdir (5.16 GB for
                 10M rows; streamed from disk by gpupool), 10,000 queries, k = 100
For each: the wall time of the whole `gpu-bin/gpupool knn ... --json` process (CUDA start-up and
file reading included) and the job time it reports, then torch: chunked addmm + topk over the same
rows (the synthetic file through a memmap, so its reading is timed; Fashion-MNIST decoded before
timing), 500k rows per chunk, TF32 off, running top-k merged on the GPU; and recall@k of torch's
ids against gpupool's (1.0 expected up to ties). Exits 0 with a message when PyTorch or a CUDA device is missing.
"""
import argparse
import gzip
import json
import os
import subprocess
import sys
import time

try:
    import numpy as np
    import torch
except ImportError:
    print("knn_job: numpy/PyTorch are not installed; nothing measured")
    sys.exit(0)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPUPOOL = os.path.join(ROOT, "gpu-bin", "gpupool")
DATA = os.path.join(ROOT, "gpu-bin", "data")


def write_fvecs(path, rows):
    dim = rows.shape[1]
    with open(path, "wb") as f:
        block = 1 << 18
        for start in range(0, rows.shape[0], block):
            chunk = rows[start:start + block]
            out = np.empty((chunk.shape[0], dim + 1), dtype=np.float32)
            out[:, 0] = np.frombuffer(np.int32(dim).tobytes(), dtype=np.float32)[0]
            out[:, 1:] = chunk
            out.tofile(f)


def fvecs_memmap(path):
    dim = int(np.fromfile(path, dtype=np.int32, count=1)[0])
    raw = np.memmap(path, dtype=np.float32, mode="r")
    return raw.reshape(-1, dim + 1)[:, 1:]


def idx_images(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    count, rows, cols = (int.from_bytes(data[i:i + 4], "big") for i in (4, 8, 12))
    return np.frombuffer(data, dtype=np.uint8, offset=16).reshape(count, rows * cols).astype(np.float32)


def read_ivecs(path):
    raw = np.fromfile(path, dtype=np.int32)
    k = int(raw[0])
    return raw.reshape(-1, k + 1)[:, 1:]


def run_gpupool(base, query, k, out):
    cmd = [GPUPOOL, "knn", "--base", base, "--query", query, "--k", str(k), "--out", out,
           "--json", "--quiet"]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"gpupool knn failed ({done.returncode}): {done.stderr.strip()}")
    summary = json.loads(done.stdout)
    return seconds, summary


def torch_knn(base_rows, queries, k, chunk_rows=500_000):
    torch.backends.cuda.matmul.allow_tf32 = False
    q = torch.from_numpy(np.ascontiguousarray(queries)).cuda()
    q_norms = (q * q).sum(1, keepdim=True)
    best_d = torch.full((q.shape[0], k), float("inf"), device="cuda")
    best_i = torch.full((q.shape[0], k), -1, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for first in range(0, base_rows.shape[0], chunk_rows):
        x = torch.from_numpy(np.ascontiguousarray(base_rows[first:first + chunk_rows])).cuda()
        d = torch.addmm(q_norms + (x * x).sum(1)[None, :], q, x.T, beta=1, alpha=-2).clamp_min_(0)
        kk = min(k, x.shape[0])
        cd, ci = torch.topk(d, kk, dim=1, largest=False)
        merged_d = torch.cat([best_d, cd], 1)
        merged_i = torch.cat([best_i, ci + first], 1)
        best_d, order = torch.topk(merged_d, k, dim=1, largest=False)
        best_i = torch.gather(merged_i, 1, order)
    torch.cuda.synchronize()
    return time.perf_counter() - start, best_i.cpu().numpy()


def recall(truth, result, k):
    hits = sum(len(set(t[:k]) & set(r[:k])) for t, r in zip(truth, result))
    return hits / (len(truth) * k)


def report(name, k, gp_seconds, summary, torch_seconds, torch_ids, gp_ids):
    r = recall(gp_ids, torch_ids, k)
    t = summary.get("times", {})
    print(f"{name}: gpupool job time: " + ", ".join(f"{v:.2f} s {key.replace('_', ' ')}"
                                                   for key, v in t.items()))
    print(f"{name}: gpupool knn {gp_seconds:.2f} s whole process, {summary.get('seconds', 0):.2f} s job "
          f"(chunks {summary.get('chunks')}, retries {summary.get('retries')}, query blocks "
          f"{summary.get('query_blocks')}, peak reserved "
          f"{summary.get('pool', {}).get('peak_reserved_bytes')} B); torch {torch_seconds:.2f} s; "
          f"gpupool/torch time {gp_seconds / torch_seconds:.2f}; recall@{k} of torch's ids vs ours {r:.6f}")
    return {"job": name, "gpupool_seconds": gp_seconds, "torch_seconds": torch_seconds,
            "recall": r, "summary": summary}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--workdir", default="/tmp/gpupool-knn-job")
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("knn_job: no CUDA device; nothing measured")
        return 0
    if not os.access(GPUPOOL, os.X_OK):
        print(f"knn_job: {GPUPOOL} is missing; run tools/build-gpu-bin.sh and carry gpu-bin")
        return 1
    os.makedirs(args.workdir, exist_ok=True)
    results = []
    k = 100

    train = os.path.join(DATA, "train-images-idx3-ubyte.gz")
    test = os.path.join(DATA, "t10k-images-idx3-ubyte.gz")
    if os.path.exists(train) and os.path.exists(test):
        out = os.path.join(args.workdir, "fashion")
        seconds, summary = run_gpupool(train, test, k, out)
        t_seconds, t_ids = torch_knn(idx_images(train), idx_images(test), k)
        results.append(report("fashion-mnist 10k x 60k x 784", k, seconds, summary, t_seconds, t_ids,
                              read_ivecs(out + ".neighbors.ivecs")))
    else:
        print(f"knn_job: no Fashion-MNIST in {DATA}; that job is skipped")

    rng = np.random.default_rng(7)
    base = os.path.join(args.workdir, f"base{args.rows}.fvecs")
    query = os.path.join(args.workdir, "query10k.fvecs")
    if not os.path.exists(base):
        write_fvecs(base, rng.standard_normal((args.rows, 128), dtype=np.float32))
    write_fvecs(query, rng.standard_normal((10_000, 128), dtype=np.float32))
    out = os.path.join(args.workdir, "synthetic")
    seconds, summary = run_gpupool(base, query, k, out)
    t_seconds, t_ids = torch_knn(fvecs_memmap(base), fvecs_memmap(query), k)
    results.append(report(f"synthetic {args.rows} x 128 from disk, 10k queries", k, seconds, summary,
                          t_seconds, t_ids, read_ivecs(out + ".neighbors.ivecs")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
