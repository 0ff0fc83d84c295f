#!/usr/bin/env python3
"""PyTorch's own caching allocator beside gpupool as its pluggable allocator, on real models, in
one run on one GPU: ms per training step, peak reserved and peak in use, and whether the losses
are identical (deterministic kernels, same seed). Each run is a fresh process (an allocator is
chosen before CUDA starts). Optionally records torch's memory snapshots and converts them to
gpupool traces (tools/torch_snapshot_to_trace.py) for `gpupool replay`.

    python3 bench/interop/torch_allocators.py [--models resnet50,bert,vit] [--segments device,virtual]
                                              [--traces DIR]

--segments runs gpupool once per kind of segment (GPUPOOL_SEGMENTS; docs/pool.md).
"""
import argparse
import json
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.join(here, "..", "..")


def run(model, allocator, extra=(), segments=None):
    command = [sys.executable, os.path.join(here, "torch_workload.py"), "--model", model,
               "--allocator", allocator, *extra]
    env = dict(os.environ, **({"GPUPOOL_SEGMENTS": segments} if segments else {}))
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# Relative difference of a loss that nondeterministic kernels (atomics in BERT's embedding
# backward) may give between two runs of the same allocator: two PyTorch runs differ by up to
# ~1.2e-7 on BERT, and by 0 in other runs.
NONDETERMINISTIC_TOLERANCE = 1e-6


def max_relative_difference(a, b):
    return max(abs(x - y) / max(abs(x), abs(y), 1e-30) for x, y in zip(a, b))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="resnet50,bert,bert-varlen,vit,resnet50-infer")
    parser.add_argument("--segments", default="device",
                        help="gpupool's kinds of segment to run, comma-separated: device, virtual")
    parser.add_argument("--traces", help="record torch's snapshots and write gpupool traces here")
    args = parser.parse_args()
    import torch
    print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"{'model':14} {'allocator':9} {'ms/step':>8} {'peak reserved':>14} {'peak in use':>12} "
          f"{'reserved/in use':>15} {'device allocs':>13} last loss")
    failed = False
    for model in args.models.split(","):
        native = run(model, "native")
        again = run(model, "native")  # what the kernels themselves vary by, run to run
        pooled_runs = []
        for segments in args.segments.split(","):
            pooled = run(model, "gpupool", segments=segments)
            pooled["allocator"] = f"gpupool/{segments}"
            pooled_runs.append(pooled)
        for r in (native, *pooled_runs):
            print(f"{model:14} {r['allocator']:9} {r['ms_per_step_median']:8.2f} "
                  f"{r['peak_reserved_bytes'] / 2**20:11.0f} MiB {r['peak_in_use_bytes'] / 2**20:8.0f} MiB "
                  f"{r['peak_reserved_bytes'] / r['peak_in_use_bytes']:15.3f} "
                  f"{r['device_allocations']:13} {r['losses'][-1]:.6f}")
        noise = max_relative_difference(native["losses"], again["losses"])
        for pooled in pooled_runs:
            difference = max_relative_difference(native["losses"], pooled["losses"])
            if difference == 0:
                verdict = "losses identical"
            elif difference <= max(10 * noise, NONDETERMINISTIC_TOLERANCE):
                verdict = (f"losses within {difference:.1e} (two native runs differ by {noise:.1e}; "
                           f"PyTorch's kernels for this model are not deterministic)")
            else:
                verdict = f"losses DIFFER by {difference:.1e} (two native runs: {noise:.1e})"
                failed = True
            print(f"{model:14} {pooled['allocator']}/native: time "
                  f"{pooled['ms_per_step_median'] / native['ms_per_step_median']:.3f}x, peak reserved "
                  f"{pooled['peak_reserved_bytes'] / native['peak_reserved_bytes']:.3f}x; {verdict}")
        if args.traces:
            os.makedirs(args.traces, exist_ok=True)
            snapshot = os.path.join(args.traces, f"{model}.pickle")
            run(model, "native", ("--steps", "3", "--warmup", "1", "--record-trace", snapshot))
            trace = os.path.join(args.traces, f"torch-{model}.csv")
            memory = torch.cuda.get_device_properties(0).total_memory
            subprocess.run([sys.executable, os.path.join(root, "tools", "torch_snapshot_to_trace.py"),
                            snapshot, trace, "--device-memory", str(memory)], check=True)
            os.remove(snapshot)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
