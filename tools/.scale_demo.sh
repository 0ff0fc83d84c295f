set -u
export LD_LIBRARY_PATH=$PWD/gpu-bin/lib:/usr/local/cuda/lib64
nvidia-smi --query-gpu=name --format=csv,noheader
gpu-bin/gpupool_tests "[gpu][knn-job],*convert_stored*" 2>&1 | tail -n 4
mkdir -p /tmp/s && cd /tmp/s
python3 - <<'PY'
import numpy as np
rng = np.random.default_rng(5)
def fvecs(path, a):
    a = a.astype('<f4'); n, d = a.shape
    out = np.empty((n, d + 1), dtype='<f4'); out[:, 0] = np.frombuffer(np.int32(d).tobytes(), '<f4')[0]; out[:, 1:] = a
    out.tofile(path)
for scale in ['1e5', '1e-8', '1e17', '1e-30']:
    s = float(scale)
    fvecs(f'b{scale}.fvecs', rng.standard_normal((200000, 128)) * s)
    fvecs(f'q{scale}.fvecs', rng.standard_normal((100, 128)) * s)
PY
G=$OLDPWD/gpu-bin/gpupool
for scale in 1e5 1e-8 1e17 1e-30; do
  $G knn --base b$scale.fvecs --query q$scale.fvecs --k 10 --quiet --out e$scale --out-format npy --distance-type fp64 --verify 20 > /dev/null 2> err || { echo "exact $scale failed: $(cat err)"; }
  for m in l2 cos ip; do
    line="scale $scale $m:"
    $G knn --base b$scale.fvecs --query q$scale.fvecs --k 10 --quiet --metric $m --out t --out-format npy --distance-type fp64 >/dev/null 2>err || line="$line exact failed $(head -c 200 err)"
    for p in fp32 fp16 bf16 int8; do
      $G knn --base b$scale.fvecs --query q$scale.fvecs --k 10 --quiet --json --metric $m --fast --precision $p --out-format npy --out f > j 2>err; rc=$?
      nf=$(python3 -c "import json;print(json.load(open('j'))['non_finite_distances'])" 2>/dev/null)
      r=$($G recall --truth t.neighbors.npy --result f.neighbors.npy --k 10 2>&1 | grep -o "recall@10 = [0-9.]*")
      line="$line | $p rc=$rc nonfinite=$nf $r"
    done
    echo "$line"
  done
done
