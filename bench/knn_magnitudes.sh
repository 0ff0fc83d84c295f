#!/usr/bin/env bash
# gpupool knn on N(0,1) data scaled by 1e5, 1e-8, 1e17 and 1e-30 (200,000 × 128 base, 100 queries,
# k = 10): the exact mode's result (checked by --verify 20) against every --fast precision, in
# every metric — non-finite distances and recall@10 each. Needs numpy; run from the repository
# root on the GPU machine after tools/build-gpu-bin.sh (GPUPOOL=path/to/gpupool to change).
set -u
gpupool="$(realpath "${GPUPOOL:-gpu-bin/gpupool}")"
work="${WORK:-/tmp/knn-magnitudes}"
mkdir -p "$work" && cd "$work"
python3 - <<'PY'
import numpy as np
rng = np.random.default_rng(5)
def fvecs(path, a):
    a = a.astype('<f4'); n, d = a.shape
    out = np.empty((n, d + 1), dtype='<f4')
    out[:, 0] = np.frombuffer(np.int32(d).tobytes(), '<f4')[0]
    out[:, 1:] = a
    out.tofile(path)
for scale in ['1e5', '1e-8', '1e17', '1e-30']:
    fvecs(f'b{scale}.fvecs', rng.standard_normal((200000, 128)) * float(scale))
    fvecs(f'q{scale}.fvecs', rng.standard_normal((100, 128)) * float(scale))
PY
for scale in 1e5 1e-8 1e17 1e-30; do
  for metric in l2 cos ip; do
    line="scale $scale $metric:"
    "$gpupool" knn --base "b$scale.fvecs" --query "q$scale.fvecs" --k 10 --quiet --metric "$metric" \
      --verify 20 --out truth --out-format npy --distance-type fp64 >/dev/null 2>err ||
      line="$line exact FAILED: $(head -c 300 err)"
    cp truth.neighbors.npy "truth-$scale-$metric.neighbors.npy" 2>/dev/null
    for precision in fp32 fp16 bf16 int8; do
      "$gpupool" knn --base "b$scale.fvecs" --query "q$scale.fvecs" --k 10 --quiet --json \
        --metric "$metric" --fast --precision "$precision" --out-format npy --out fast >summary 2>err
      status=$?
      non_finite=$(python3 -c "import json; print(json.load(open('summary'))['non_finite_distances'])" 2>/dev/null)
      recall=$("$gpupool" recall --truth truth.neighbors.npy --result fast.neighbors.npy --k 10 2>&1 |
        grep -o "recall@10 = [0-9.]*")
      line="$line | $precision exit $status, non-finite $non_finite, $recall"
    done
    echo "$line"
  done
done

# The peer in the same run: torch's fp16 GEMM + topk (L2 as ‖q‖² + ‖x‖² − 2 q·x, as cuVS/FAISS
# compute it), where torch and a GPU are there.
python3 - <<'PY' || echo "torch: not run"
import numpy as np, torch
if not torch.cuda.is_available(): raise SystemExit("torch: no GPU")
def read(path):
    raw = np.fromfile(path, dtype='<f4'); d = raw[:1].view('<i4')[0]
    return raw.reshape(-1, d + 1)[:, 1:]
for scale in ['1e5', '1e-8', '1e17', '1e-30']:
    q = torch.from_numpy(read(f'q{scale}.fvecs')).cuda().half()
    x = torch.from_numpy(read(f'b{scale}.fvecs')).cuda().half()
    d = (q.float().pow(2).sum(1, keepdim=True) + x.float().pow(2).sum(1) - 2 * (q @ x.T).float())
    dist, ids = d.topk(10, largest=False)
    truth = np.load(f'truth-{scale}-l2.neighbors.npy')
    ids = ids.cpu().numpy()
    found = sum(len(set(ids[r]) & set(truth[r])) for r in range(len(truth)))
    print(f"torch fp16 GEMM + topk, scale {scale} l2: non-finite "
          f"{int((~torch.isfinite(dist)).sum())} of {dist.numel()}, recall@10 = {found / truth.size:.6f}")
PY
