#!/usr/bin/env bash
# The GPU checks in one run (the default parts sized for at most 8 minutes on one H200):
#   engine   bench/batching.py on a Llama-3-8B-shaped random-weight model in bf16: continuous vs
#            static, the device's idle share, batch-1 decode against the weight-bandwidth roofline
#   startup  the same engine's start-up (weights + warm-up) with an empty compilation cache, then
#            with the cache the first run filled
#   compile  bench/compile_time.py: compile seconds, layers scanned and unrolled, 8B shape
#            included (not by default: measured 2026-12-04, bench/RESULTS.md)
#   steps    bench/profile_step.py: the 8B shape's decode step alone, 2 and 32 rows unrolled
#            (the GPU's default; scanned: measured 2026-12-04, bench/RESULTS.md); not by default
#   quant    the same step with fp8 and int4 weights at 2 rows, fp8 against bf16 at 64 rows, and
#            fp8 weights with an fp8 KV pool (needs qwix: not in the device image, carry its wheel);
#            one fp8 layer, fp8 x fp8 against weight-only (bench/fp8_matmul.py)
#   spec     bench/profile_step.py --verify 4: the 8B shape's verification call (5 tokens a row)
#            against its decode step, 2 and 32 rows (not by default: about a minute)
#   moe      bench/moe.py on Qwen3-30B-A3B's layers (4 of them, bf16): jax.lax.ragged_dot's
#            grouped matmul against a loop over experts at batch 1 and 32 (not by default)
#   tests    the kernel tests, compiled by Triton for real
#   kernels  bench/kernels.py: decode/prefill µs and GB/s vs copy bandwidth (not by default)
#   tune     bench/tune_decode.py: the decode kernel's tuning arguments at 64 x 4096 (not by default)
# Usage: bash bench/gpu_check.sh [comma-separated parts; default engine,startup,tests,quant].
# Results go to $OUT (or bench/out). Runs on the machine's own jax, the project not installed:
# the engine and the kernel tests need none of the server's or the grammars' packages.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
parts=${1:-engine,startup,tests,quant}
engine_args=(--model bench/models/llama3-8b --dtype bfloat16 --max-num-seqs 32
             --max-num-batched-tokens 1024 --prefill-chunk-sizes 256 --row-buckets 8,32
             --num-pages 4096 --max-model-len 2048)
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
# the planner's prediction first, for the engine's shapes on this GPU (JAXSERVE_TARGET: h100 or
# h200 by the device's memory), so each lent minute also checks jaxserve plan --target
target=${JAXSERVE_TARGET:-$(python3 -c "import jax; print('h200' if jax.devices()[0].memory_stats()['bytes_limit'] > 100e9 else 'h100')" 2>/dev/null || echo h200)}
echo "== plan --target $target (the prediction for the shapes below)"
timeout 60 python3 -m jaxserve.cli plan bench/models/llama3-8b --target "$target" --dtype bfloat16 \
  --max-num-seqs 32 --max-model-len 2048 --num-pages 4096 2>&1 | grep -E "^(target|estimate|problem)"
if [[ $parts == *engine* ]]; then
  echo "== engine: Llama-3-8B shape, bf16, continuous vs static, device idle, batch-1 roofline"
  # rows padded to 8 or 32 (prefill calls to 1, 8 or 32): a memory-bound 8B decode step costs
  # about the same at 8 rows as at 2, while a prefill call of 2-8 chunks pads to 8 rows
  timeout 200 python3 bench/batching.py "${engine_args[@]}" --num-prompts 192 \
    --output-json "$out/engine.json" 2>&1 | grep -v "^compiling"
fi
if [[ $parts == *startup* ]]; then
  echo "== start-up: Llama-3-8B shape, bf16: cold (empty compilation cache), then warm"
  cache=$(mktemp -d)
  for run in cold warm; do
    JAXSERVE_CACHE_DIR=$cache timeout 90 python3 - "$run" <<'PY'
import sys, time
start = time.perf_counter()
from jaxserve import LLM
LLM("bench/models/llama3-8b", load_format="dummy", dtype="bfloat16", max_num_seqs=32,
    max_num_batched_tokens=1024, prefill_chunk_sizes=(256,), row_buckets=(8, 32),
    num_pages=4096, max_model_len=2048, enable_prompt_logprobs=False)
print(f"{sys.argv[1]} start-up (import, weights, warm-up): {time.perf_counter() - start:.1f} s")
PY
  done
fi
if [[ $parts == *compile* ]]; then
  echo "== compile time"; timeout 60 python3 bench/compile_time.py 2>&1 | grep -v '^{'
fi
if [[ $parts == *tests* ]]; then
  echo "== kernel tests"; timeout 60 python3 -m pytest -q --noconftest tests/test_kernels.py 2>&1 | tail -3
fi
if [[ $parts == *steps* ]]; then
  echo "== decode step alone: Llama-3-8B shape, bf16, layers unrolled and scanned"
  for run in "2 false" "32 false"; do
    set -- $run
    echo "-- $1 rows, scan_layers $2"
    timeout 45 python3 bench/profile_step.py --model bench/models/llama3-8b --dtype bfloat16 \
      --rows "$1" --context 300 --iters 10 --top 8 --scan-layers "$2" 2>&1 | grep -v "^compiling"
  done
fi
if [[ $parts == *quant* ]]; then
  echo "== decode step with quantised weights: Llama-3-8B shape, bf16 activations"
  for run in "2 fp8 auto" "2 int4 auto" "64 fp8 auto" "64 none auto" "64 fp8 fp8"; do
    set -- $run
    echo "-- $1 rows, weights $2, KV $3"
    quant=(); [[ $2 != none ]] && quant=(--quantization "$2")
    timeout 60 python3 bench/profile_step.py --model bench/models/llama3-8b --dtype bfloat16 \
      --rows "$1" --context 300 --iters 10 --top 6 --kv-cache-dtype "$3" "${quant[@]}" 2>&1 |
      grep -v "^compiling"
  done
  echo "-- one fp8 layer (4096 x 14336): fp8 activations x fp8 weights against weight-only"
  timeout 60 python3 bench/fp8_matmul.py --rows 2,64,512
fi
if [[ $parts == *spec* ]]; then
  echo "== speculation's verification (k=4) against a decode step: Llama-3-8B shape, bf16"
  # random weights accept no drafts, so this measures what a verification costs: speculation
  # pays where the drafts a verification keeps average more than its line's break-even; 2 rows
  # (the decode row bucket's least) stand for batch 1
  for rows in 2 32; do
    echo "-- $rows rows"
    timeout 90 python3 bench/profile_step.py --model bench/models/llama3-8b --dtype bfloat16 \
      --rows "$rows" --context 300 --iters 10 --top 0 --verify 4 2>&1 |
      grep -v -e "^compiling" -e "op kind$"
  done
fi
if [[ $parts == *moe* ]]; then
  echo "== mixture of experts: grouped matmul against a loop over experts, Qwen3-30B-A3B layers"
  timeout 150 python3 bench/moe.py --hidden 2048 --moe-intermediate 768 --experts 128 \
    --layers 4 --heads 32 --kv-heads 4 --head-dim 128 --vocab 151936 --dtype bfloat16 2>&1 |
    tee "$out/moe.txt"
fi
if [[ $parts == *kernels* ]]; then
  echo "== kernel benchmark"; timeout 150 python3 bench/kernels.py --output-json "$out/kernels.json"
fi
if [[ $parts == *tune* ]]; then
  echo "== decode tuning"; timeout 70 python3 bench/tune_decode.py --iters 10 2>&1 | tee "$out/tune.txt"
fi
