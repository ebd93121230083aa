#!/usr/bin/env bash
# The GPU checks in one run (sized for at most 8 minutes on one H200):
#   tests   the kernel tests, compiled by Triton for real
#   kernels bench/kernels.py: decode/prefill µs and GB/s vs copy bandwidth, JAX's paged attention beside
#   tune    bench/tune_decode.py: the decode kernel's tuning arguments at 64 x 4096
#   engine  bench/batching.py on a Llama-3-8B-shaped random-weight model in bf16: continuous vs static
# Usage: bash bench/gpu_check.sh [comma-separated parts; default all]. Results go to $OUT (or bench/out).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
parts=${1:-tests,kernels,tune,engine}
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
if [[ $parts == *tests* ]]; then
  echo "== kernel tests"; timeout 150 python3 -m pytest -q tests/test_kernels.py 2>&1 | tail -3
fi
if [[ $parts == *kernels* ]]; then
  echo "== kernel benchmark"; timeout 150 python3 bench/kernels.py --output-json "$out/kernels.json"
fi
if [[ $parts == *engine* ]]; then
  echo "== engine: Llama-3-8B shape, bf16, continuous vs static"
  # rows padded to 8 or 32 (prefill calls to 1, 8 or 32): five 32-layer steps to compile
  # instead of eleven; a memory-bound 8B decode step costs about the same at 8 rows as at 2,
  # while a prefill call of 2-8 chunks pads to 8 rows
  timeout 230 python3 bench/batching.py --model bench/models/llama3-8b --dtype bfloat16 \
    --num-prompts 192 --max-num-seqs 32 --max-num-batched-tokens 1024 --prefill-chunk-sizes 256 \
    --row-buckets 8,32 \
    --num-pages 4096 --max-model-len 2048 --output-json "$out/engine.json" 2>&1 | grep -v "^compiling"
fi
if [[ $parts == *tune* ]]; then
  echo "== decode tuning"; timeout 70 python3 bench/tune_decode.py --iters 10 2>&1 | tee "$out/tune.txt"
fi
