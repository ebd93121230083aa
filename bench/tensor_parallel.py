"""Tensor parallelism's collectives and bytes: what one compiled decode step exchanges per layer,
and what each device holds, for tensor_parallel_size 1, 2 and 4 on the host's CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/tensor_parallel.py
    ... python bench/tensor_parallel.py --model models/stories260K --tp 1,2,4

Two backends: `cpu` (the C++ kernels; the shards' partial sums are gathered and added in one
fixed order, which keeps a row's bits whatever the batch: all-gathers) and `reference` (XLA's
dot; one all-reduce per sum). A layer sums twice (after o_proj and after down_proj), the
embedding once; the LM head's logits are gathered once, or, when every row of a call is greedy
and wants no logprobs, only each shard's maximum and its id (model/sampler.py's sharded_greedy). Layers run under scan (the reference
backend's default) compile one layer's body: its collectives count once.
"""

import argparse
import re
import time
from pathlib import Path

import jax
import numpy as np

from jaxserve import LLM
from jaxserve.model.kv_cache import AttentionMetadata
from jaxserve.model.sampler import SamplingMetadata
from jaxserve.model.step import pack_decode_rows

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = {"cpu": {}, "reference": dict(attention_impl="reference", matmul_impl="xla")}


def decode_collectives(runner) -> dict:
    """The all-reduces and all-gathers (with their output shapes) of the runner's compiled
    one-step decode at its smallest row bucket."""
    rows = runner.row_buckets[0]
    md = AttentionMetadata(positions=np.full((rows, 1), 3, np.int32),
                           query_lens=np.ones(rows, np.int32), seq_lens=np.full(rows, 4, np.int32),
                           page_table=np.ones((rows, runner.pages_per_seq), np.int32))
    vocab = runner.model_config.vocab_size
    sm = SamplingMetadata(temperature=np.zeros(rows, np.float32),
                          top_k=np.full(rows, vocab, np.int32), top_p=np.ones(rows, np.float32),
                          seeds=np.zeros(rows, np.uint32), positions=np.full(rows, 4, np.int32),
                          logprobs=np.zeros(rows, bool))
    packed = pack_decode_rows(np.zeros(rows, np.int32), np.full(rows, -1, np.int32), md, sm)
    hlo = runner.fns.decode.lower(runner.weights, runner.kv, packed, *runner._carries,
                                  steps=1).compile().as_text()
    ops = re.findall(r"= (\S+) (all-reduce|all-gather)(?:-start)?\(", hlo)
    return {"all_reduces": sum(op == "all-reduce" for _, op in ops),
            "all_gathers": [re.sub(r"\{.*\}", "", shape) for shape, op in ops
                            if op == "all-gather"]}


def shard_bytes(runner) -> dict:
    """Each weight's and KV pool's bytes on the first device, and whole."""
    weights = {jax.tree_util.keystr(path): (x.addressable_shards[0].data.nbytes, x.nbytes)
               for path, x in jax.tree_util.tree_leaves_with_path(runner.state)}
    return {"weights": weights,
            "kv": [(p.addressable_shards[0].data.nbytes, p.nbytes) for p in runner.kv.pools]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "tests" / "fixtures" / "hf" / "llama")
    parser.add_argument("--tp", default="1,2,4")
    args = parser.parse_args()
    print(f"{args.model.name}: {len(jax.devices())} {jax.default_backend()} devices")
    print(f"{'backend':>9} {'tp':>3} {'layers':>8} {'all-reduces':>11} {'all-gathers':>11} "
          f"{'weights/device':>14} {'KV/device':>9} {'warm-up s':>9}")
    for name, options in BACKENDS.items():
        for tp in (int(t) for t in args.tp.split(",")):
            start = time.perf_counter()
            llm = LLM(args.model, tensor_parallel_size=tp, max_num_seqs=4, row_buckets=(4,),
                      prefill_chunk_sizes=(16,), max_num_batched_tokens=32, num_pages=256,
                      enable_prompt_logprobs=False, **options)
            warm = time.perf_counter() - start
            runner = llm.engine.runner
            ops, held = decode_collectives(runner), shard_bytes(runner)
            local = sum(a for a, _ in held["weights"].values())
            whole = sum(b for _, b in held["weights"].values())
            kv_local, kv_whole = (sum(x[i] for x in held["kv"]) for i in (0, 1))
            layers = "1 (scan)" if runner.scan_layers else runner.model_config.num_layers
            print(f"{name:>9} {tp:>3} {layers:>8} "
                  f"{ops['all_reduces']:>11} {len(ops['all_gathers']):>11} "
                  f"{local / whole:>14.3f} {kv_local / kv_whole:>9.3f} {warm:>9.1f}")
            if tp > 1:
                print(f"{'':>14}all-gathers: {', '.join(ops['all_gathers'])}")


if __name__ == "__main__":
    main()
