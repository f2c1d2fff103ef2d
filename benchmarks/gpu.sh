#!/usr/bin/env bash
# The single-GPU figures the docs cite, in one run (about 10 minutes on one H200):
#   1. benchmarks/step.py section 6 on the GPU: the step split by failure domain vs
#      the fused step, failure-free, and each program's compile time;
#   2. benchmarks/state.py's save section on the GPU: copy off the device, save
#      stall, write and restore rates (512 MB and 2 GB, 3 runs; 8 GB, 1 run);
#   3. spare_jax.fit of a 1-process job under the launcher on the GPU, then the same
#      command again (it resumes from the checkpoint): the GPU recovery flags that
#      spare_jax.initialize sets (docs/multihost.md) in a real run.
#
#   bash benchmarks/gpu.sh OUT_DIR      # PYTHON=... to pick the interpreter
#
# From the repository's root, with spare_jax and a CUDA build of JAX installed
# (pip install -e . and jax[cuda]); nothing here needs more than one GPU.
#
# Writes only under OUT_DIR: gpu.txt, step.json, state.json and a log per part.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu.sh OUT_DIR}
py=${PYTHON:-python3}
mkdir -p "$out"
scratch=$(mktemp -d "$out/scratch.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
export PYTHONUNBUFFERED=1

{
  nvidia-smi -L
  $py -c 'import jax, jaxlib, orbax.checkpoint as ocp, flax
print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "orbax", ocp.__version__,
      "flax", flax.__version__, jax.devices())'
} 2>&1 | tee "$out/gpu.txt"

echo "== 1. step: split vs fused" | tee "$out/step.log"
timeout -s KILL 300 $py benchmarks/step.py --platform=gpu --sections=6 --steps=20 --batch=8 \
  --out="$out/step.json" 2>&1 | tee -a "$out/step.log"

echo "== 2. state: save and restore" | tee "$out/state.log"
timeout -s KILL 400 $py benchmarks/state.py --platform=gpu --sections=save \
  --sizes_mb=512,2048 --repeats=3 --out="$out" 2>&1 | tee -a "$out/state.log"
timeout -s KILL 300 $py benchmarks/state.py --platform=gpu --sections=save \
  --sizes_mb=8192 --repeats=1 --out="$out" 2>&1 | tee -a "$out/state.log"

echo "== 3. fit under the launcher, then resumed" | tee "$out/fit.log"
cat > "$scratch/fit_one_gpu.py" <<'PY'
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import spare_jax

spare_jax.initialize()
print("XLA_FLAGS:", os.environ.get("XLA_FLAGS"), "| devices:", jax.devices())
rng = np.random.default_rng(0)
params = {"w1": rng.normal(size=(512, 2048)).astype(np.float32) / 23,
          "w2": rng.normal(size=(2048, 1)).astype(np.float32) / 45}


def loss_fn(p, batch):
    return jnp.mean((jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"] - batch["y"]) ** 2)


def batches(t):
    x = np.random.default_rng([7, t]).normal(size=(256, 512)).astype(np.float32)
    return {"x": x, "y": np.sin(x[:, :1])}


step = spare_jax.make_train_step(
    loss_fn, optax.adamw(1e-3), spare_jax.make_mesh((1, 1, 1)), redundancy=1, microbatches=2
)
result = spare_jax.fit(step, params, batches, steps=int(sys.argv[2]), workdir=sys.argv[1],
                       checkpoint_steps=10)
print("done:", {k: result.summary[k] for k in ("final_step", "final_loss")})
PY
for steps in 30 60; do
  timeout -s KILL 150 $py -m spare_jax.launch --processes=1 --launch_dir="$scratch/launch" -- \
    $py "$scratch/fit_one_gpu.py" "$scratch/fit" $steps 2>&1 | tail -n 5 | tee -a "$out/fit.log"
  grep -h '"kind": "\(resume\|summary\)"\|^done:\|XLA_FLAGS' "$scratch"/launch/worker-0.log \
    2>/dev/null | cut -c1-400 | tee -a "$out/fit.log"
done
