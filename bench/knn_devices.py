#!/usr/bin/env python3
"""`gpupool knn` over several GPUs of one host, beside torch's loop spread over the same GPUs.

On knn_scale.py's files (its generator, its u8 and f32 jobs), for each GPU count N of --counts:
  gpupool  one process over cuda:0 ... cuda:N-1 (--devices; N = 1: --device cuda:0): the whole
           process's seconds (median of --repeat), each device's rows and seconds, the lists'
           merge time, and whether the neighbour and distance files are byte for byte one GPU's
  mpirun   -np N gpupool knn, one process per GPU (each takes its local rank's GPU): the same
  torch    N processes, one per GPU, each knn_scale.py's loop over 1/N of the rows, the lists
           merged on the host: seconds from the workers' common start (after CUDA is up) to the
           merged lists, and recall@k of its ids against gpupool's
Every figure goes to WORKDIR/knn_devices.json.

  python3 bench/knn_devices.py --workdir /tmp/knnscale [--counts 1,2,4] [--only u8|f32]
      [--rows-u8 100000000] [--rows-f32 30000000] [--queries 10000] [--k 100] [--repeat 2]
      [--skip-torch] [--skip-mpi] [--mpirun "mpirun --bind-to none"]
Exits 0 with a message when PyTorch or a CUDA device is missing.
"""
import argparse
import filecmp
import json
import multiprocessing as mp
import os
import shlex
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import knn_scale as ks  # noqa: E402  (the files, the generator and torch's loop)

np, torch = ks.np, ks.torch


def first_json(text):
    """The first JSON object in a process's standard output (rank 0's summary)."""
    start = text.find("{")
    if start < 0:
        raise ValueError("no JSON object")
    return json.JSONDecoder().raw_decode(text[start:])[0]


def timed(cmd, env=None):
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        return seconds, None, f"exit {done.returncode}: {done.stderr.strip()[-2000:]}"
    try:
        return seconds, first_json(done.stdout), None
    except ValueError:
        return seconds, None, f"stdout has no JSON: {done.stdout[:2000]!r}; stderr: {done.stderr.strip()[-2000:]}"


def same_files(out, reference):
    return all(filecmp.cmp(out + ext, reference + ext, shallow=False)
               for ext in (".neighbors.ivecs", ".distances.fvecs"))


def device_rows(summary):
    return [{"device": d["device"], "rank": d["rank"], "rows": d["rows"], "seconds": d["seconds"],
             "times": d["times"]} for d in summary.get("devices", [])]


def run_gpupool(args, base, query, out, count, mpi):
    knn = [args.gpupool, "knn", "--base", base, "--query", query, "--k", str(args.k), "--out", out,
           "--json", "--quiet"]
    if mpi:
        cmd = shlex.split(args.mpirun) + ["--allow-run-as-root", "--oversubscribe", "-np", str(count),
                                          "-x", "LD_LIBRARY_PATH"] + knn
    else:
        cmd = knn + (["--device", "cuda:0"] if count == 1 else
                     ["--devices", ",".join(f"cuda:{i}" for i in range(count))])
    runs = []
    for _ in range(args.repeat):
        seconds, summary, error = timed(cmd)
        if error:
            return {"error": error, "seconds": seconds, "command": " ".join(cmd)}
        runs.append((seconds, summary))
    seconds, summary = sorted(runs, key=lambda run: run[0])[len(runs) // 2]
    return {"seconds": seconds, "runs": [run[0] for run in runs], "job_seconds": summary["seconds"],
            "merging_lists_seconds": summary.get("merging_lists_seconds", 0.0),
            "times": summary["times"],
            "devices": device_rows(summary), "command": " ".join(cmd)}


def torch_worker(rank, count, base, query, k, barrier, out):
    """One GPU's share of torch's loop: rows [rank·n/count, (rank+1)·n/count)."""
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.zeros(1, device="cuda")
    rows, queries = ks.vecs_memmap(base), np.array(ks.vecs_memmap(query))
    lo, hi = rows.shape[0] * rank // count, rows.shape[0] * (rank + 1) // count
    barrier.wait()
    start = time.time()
    ids, dists = ks.gpu_topk(rows[lo:hi], queries, k, torch.float32)
    np.save(f"{out}.{rank}.ids.npy", ids + lo)
    np.save(f"{out}.{rank}.d.npy", dists)
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"start": start, "end": time.time(), "rows": hi - lo}, f)


def run_torch(args, base, query, count, out):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(count)
    workers = [ctx.Process(target=torch_worker, args=(r, count, base, query, args.k, barrier, out))
               for r in range(count)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if any(w.exitcode != 0 for w in workers):
        return {"error": f"a torch worker failed: exit codes {[w.exitcode for w in workers]}"}, None
    parts = [json.load(open(f"{out}.{r}.json")) for r in range(count)]
    merge_start = time.time()
    ids = np.concatenate([np.load(f"{out}.{r}.ids.npy") for r in range(count)], 1)
    dists = np.concatenate([np.load(f"{out}.{r}.d.npy") for r in range(count)], 1)
    order = np.argsort(dists, axis=1, kind="stable")[:, :args.k]
    ids = np.take_along_axis(ids, order, 1)
    merge = time.time() - merge_start
    seconds = max(p["end"] for p in parts) - min(p["start"] for p in parts) + merge
    return {"seconds": seconds, "merge_seconds": merge,
            "workers": [p["end"] - p["start"] for p in parts]}, ids


def run_job(args, kind):
    rows = args.rows_u8 if kind == "u8" else args.rows_f32
    ext, rec = (".bvecs", ks.DIM + 4) if kind == "u8" else (".fvecs", (ks.DIM + 1) * 4)
    base = os.path.join(args.workdir, f"base_{kind}_{rows}{ext}")
    query = os.path.join(args.workdir, f"query_{kind}_{args.queries}{ext}")
    res = {"job": kind, "rows": rows, "queries": args.queries, "k": args.k, "runs": []}
    if not (os.path.exists(base) and os.path.getsize(base) == rows * rec):
        res["generate_seconds"] = ks.write_vecs(base, kind, rows, seed=1)
    ks.write_vecs(query, kind, args.queries, seed=10**12)
    os.sync()
    res["page_cache_gbps"] = ks.warm(base)
    print(f"knn_devices {kind}: {rows} rows, page-cache read {res['page_cache_gbps']:.2f} GB/s", flush=True)
    reference = os.path.join(args.workdir, f"{kind}_1gpu")
    reference_ids = None
    for count in args.counts:
        for mpi in ([False] if args.skip_mpi or count == 1 else [False, True]):
            name = f"{kind}_{count}{'mpi' if mpi else 'gpu'}"
            out = reference if count == 1 else os.path.join(args.workdir, name)
            run = {"gpus": count, "how": "mpirun" if mpi else "one process",
                   **run_gpupool(args, base, query, out, count, mpi)}
            if "error" not in run:
                run["identical_to_one_gpu"] = same_files(out, reference)
                if count == 1:
                    reference_ids = ks.read_vecs_out(out + ".neighbors.ivecs", "<i4")
            res["runs"].append(run)
            print(f"knn_devices {name}: {json.dumps(run)}", flush=True)
        if not args.skip_torch:
            t, ids = run_torch(args, base, query, count, os.path.join(args.workdir, f"torch_{kind}"))
            if ids is not None and reference_ids is not None:
                t["recall_vs_gpupool"] = ks.recall(reference_ids, ids, args.k)
            res["runs"].append({"gpus": count, "how": "torch", **t})
            print(f"knn_devices {kind}_{count}torch: {json.dumps(t)}", flush=True)
    return res


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/knnscale")
    parser.add_argument("--counts", default="", help="GPU counts, e.g. 1,2,4 (default: powers of two up to the host's GPUs, and all of them)")
    parser.add_argument("--rows-u8", type=int, default=100_000_000)
    parser.add_argument("--rows-f32", type=int, default=30_000_000)
    parser.add_argument("--queries", type=int, default=10_000)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--only", choices=["u8", "f32"])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--skip-mpi", action="store_true")
    parser.add_argument("--mpirun", default="mpirun --bind-to none",
                        help="the launcher and its options (mpirun alone binds each process of a job "
                             "of two or fewer to one core)")
    parser.add_argument("--gpupool", default=os.path.join(ks.ROOT, "gpu-bin", "gpupool"))
    args = parser.parse_args()
    if not ks.CUDA:
        print("knn_devices: " + ("no CUDA device" if torch else "PyTorch is not installed") + "; nothing measured")
        return 0
    gpus = torch.cuda.device_count()
    if args.counts:
        args.counts = [int(c) for c in args.counts.split(",")]
    else:
        args.counts = sorted({c for c in (1, 2, 4, 8, 16) if c <= gpus} | {gpus})
    if any(c < 1 or c > gpus for c in args.counts):
        print(f"knn_devices: --counts {args.counts}: this host has {gpus} GPUs")
        return 2
    os.makedirs(args.workdir, exist_ok=True)
    results = {"gpus": [torch.cuda.get_device_name(i) for i in range(gpus)], "args": vars(args), "jobs": []}
    ks.run_jobs(args, results, run_job, "knn_devices")
    return 0


if __name__ == "__main__":
    sys.exit(main())
