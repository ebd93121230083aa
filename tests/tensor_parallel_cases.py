"""Tensor parallelism's checks, run by test_tensor_parallel.py in a process of its own with 8
host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, which must be set before jax
starts): one JSON object on stdout, the tests assert on it.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/tensor_parallel_cases.py

For each model and tensor_parallel_size (and data_parallel_size: replicas of it): the logits of a prompt (the model's own forward, run per
shard as the steps run it) against tp=1's, the engine's greedy ids (batched, and one prompt alone
against the same prompt in a batch: batch invariance), sampler controls and structured
output, each weight's and the KV pool's bytes on
one device, the all-reduces and all-gathers the compiled decode step holds, and compilations
after warm-up.
"""

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve import LLM, SamplingParams
from jaxserve.model.kv_cache import AttentionMetadata
from jaxserve.request import StructuredOutputsParams

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_tp", ROOT / "bench" / "tensor_parallel.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
MODELS = {name: ROOT / "tests" / "fixtures" / "hf" / name
          for name in ("llama", "qwen2", "mistral", "phi3", "mixtral", "qwen3_moe")}
MODELS["stories260K"] = ROOT / "models" / "stories260K"
ENGINE = dict(max_num_seqs=4, page_size=8, num_pages=80, prefill_chunk_sizes=(16,),
              max_num_batched_tokens=32, row_buckets=(4,), enable_prompt_logprobs=False)
# data_parallel_size x tensor_parallel_size
DATA_PARALLEL = {"llama": ((2, 2), (4, 1)), "qwen2": ((2, 2),), "mistral": ((2, 2),)}
PROMPTS = [[1, 5, 9, 20, 33, 7, 2, 11, 3], [1, 40, 2, 3], [1, 17, 8, 30, 4, 4, 9]]


def prompt_logits(runner, tokens: list[int]) -> np.ndarray:  # [T, vocab] float32
    """The model's logits at every position of a fresh prompt, through the runner's own
    weights, KV pool and backend (under shard_map on its mesh, as the steps run)."""
    t = len(tokens)
    pages = -(-t // runner.page_size)
    md = AttentionMetadata(positions=np.arange(t, dtype=np.int32)[None],
                           query_lens=np.array([t], np.int32), seq_lens=np.array([t], np.int32),
                           page_table=np.arange(1, 1 + runner.pages_per_seq, dtype=np.int32)[None])
    assert pages <= runner.pages_per_seq
    treedef = jax.tree.structure(runner.state)

    def forward(weights, kv, tokens, md):
        leaves, rope = weights
        model = nnx.merge(runner.graphdef, jax.tree.unflatten(treedef, leaves))
        hidden, _ = model(tokens, kv, md, runner.backend, rope)
        return model.logits(hidden[0], runner.backend)

    if runner.shards is not None:
        forward = jax.shard_map(forward, mesh=runner.shards.mesh,
                                in_specs=((runner.shards.weights, (P(), P())), runner.shards.kv,
                                          P(), P()), out_specs=P(), check_vma=False)
    return np.asarray(jax.jit(forward)(runner.weights, runner.kv,
                                       np.array([tokens], np.int32), md))


def logprobs(output) -> list:
    return [sorted(v.logprob for v in d.values()) for d in output.logprobs]


def run_model(path: Path, tps: tuple[int, ...], **options) -> dict:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    results = {}
    for tp in tps:
        llm = LLM(path, tensor_parallel_size=tp, **ENGINE, **options)
        runner = llm.engine.runner
        batched = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        alone = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)[0]
        results[tp] = {
            "ids": [o.outputs[0].token_ids for o in batched],
            "alone_same": (alone.outputs[0].token_ids == batched[0].outputs[0].token_ids
                           and logprobs(alone.outputs[0]) == logprobs(batched[0].outputs[0])),
            "logits": prompt_logits(runner, PROMPTS[0]).tolist(),
            "bytes": bench.shard_bytes(runner),
            "collectives": bench.decode_collectives(runner),
            "num_layers": runner.model_config.num_layers,
            "scan_layers": runner.scan_layers,
            "num_pages": runner.num_pages,
            "hidden_size": runner.model_config.hidden_size,
            "vocab_size": runner.model_config.vocab_size,
            "rows": runner.row_buckets[0],
            "compilations_after_warmup": runner.num_compilations_after_warmup,
        }
    return results


def data_parallel(path: Path, dp: int, tp: int) -> dict:
    """dp replicas of a tp-way model: the greedy ids and logprobs of the prompts (spread over
    the replicas), one prompt alone, the last replica's logits, each replica's devices."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    llm = LLM(path, data_parallel_size=dp, tensor_parallel_size=tp, **ENGINE)
    engine = llm.engine
    batched = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    steps = [c.num_steps for c in engine.cores]
    alone = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)[0]
    return {
        "ids": [o.outputs[0].token_ids for o in batched],
        "alone_same": (alone.outputs[0].token_ids == batched[0].outputs[0].token_ids
                       and logprobs(alone.outputs[0]) == logprobs(batched[0].outputs[0])),
        "logits": prompt_logits(engine.runners[-1], PROMPTS[0]).tolist(),
        "steps_per_replica": steps,
        "devices": [sorted({d.id for a in jax.tree.leaves((r.state, r.kv)) for d in a.devices()})
                    for r in engine.runners],
        "compilations_after_warmup": llm.stats()["num_compilations_after_warmup"],
    }


def prefix_cached(dp: int, tp: int, cache: bool) -> dict:
    """Prompts sharing a 24-token prefix (three pages), the first alone and then the rest,
    which find its pages in the cache when it is on: the ids and every logprob, the hits."""
    shared = list(range(3, 27))
    prompts = [[*shared, 40 + i, 50 + i, 60 + i] for i in range(5)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    llm = LLM(MODELS["llama"], data_parallel_size=dp, tensor_parallel_size=tp,
              enable_prefix_caching=cache, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": prompts[0]}], params) + llm.generate(
        [{"prompt_token_ids": p} for p in prompts[1:]], params)
    stats = llm.stats()
    return {"ids": [o.outputs[0].token_ids for o in outs],
            "logprobs": [logprobs(o.outputs[0]) for o in outs],
            "hits": stats["prefix_cache_hits"],
            "compilations_after_warmup": stats["num_compilations_after_warmup"]}


def stories_reference(tp: int, dp: int = 1) -> dict:
    """stories260K's C-reference cases through dp replicas of a tp-way engine: the ids."""
    path = MODELS["stories260K"]
    cases = json.loads((path / "reference_outputs.json").read_text())["cases"]
    llm = LLM(path, tensor_parallel_size=tp, data_parallel_size=dp, page_size=4,
              prefill_chunk_sizes=(8,), max_num_seqs=8,
              max_num_batched_tokens=32, num_pages=512, enable_prompt_logprobs=False)
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases],
                        [SamplingParams(max_tokens=len(c["generated_ids"]), temperature=0.0,
                                        ignore_eos=True) for c in cases])
    return {"ids": [o.outputs[0].token_ids for o in outs],
            "expected": [c["generated_ids"] for c in cases]}


def controlled_outputs(tp: int) -> list:
    """Sampler controls, a seeded random sample, structured output and prompt logprobs through a
    tp-way stories260K engine: ids, text and the prompt logprobs' top tokens."""
    llm = LLM(MODELS["stories260K"], tensor_parallel_size=tp, max_num_seqs=4, page_size=8,
              num_pages=300, prefill_chunk_sizes=(16,), max_num_batched_tokens=32,
              row_buckets=(4,))
    params = [SamplingParams(max_tokens=20, temperature=0.0, presence_penalty=0.7,
                             repetition_penalty=1.3, prompt_logprobs=2),
              SamplingParams(max_tokens=30, temperature=0.8, seed=7, min_p=0.05),
              SamplingParams(max_tokens=40, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(choice=["Lily", "Tom"]))]
    outs = llm.generate(["Once upon a time", "The cat", "Her name was"], params)
    return [[o.outputs[0].token_ids, o.outputs[0].text,
             [sorted(d) for d in o.prompt_logprobs[1:]] if o.prompt_logprobs else None]
            for o in outs] + [llm.stats()["num_compilations_after_warmup"]]


def sharded_greedy_cases() -> dict:
    """sharded_greedy over 4 shards against first_argmax over the whole vocabulary: random
    rows, a maximum tied across two shards, one within a shard, a row holding NaN."""
    from jax.sharding import Mesh

    from jaxserve.model.sampler import first_argmax, sharded_greedy

    logits = np.random.default_rng(0).normal(size=(6, 64)).astype(np.float32)
    logits[1, [5, 40]] = 9.0  # shards 0 and 2
    logits[2, [50, 52]] = 9.0  # shard 3 twice
    logits[3, 17] = np.nan
    logits[4, :] = 1.0  # all tied
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("data", "model"))
    split = jax.jit(jax.shard_map(lambda x: sharded_greedy(x, "model", 2), mesh=mesh,
                                  in_specs=P(None, "model"), out_specs=P(), check_vma=False))
    return {"split": np.asarray(split(logits))[:, 0].tolist(),
            "whole": np.asarray(first_argmax(logits)).tolist()}


def tpu_attention_ids(tmp: Path) -> dict:
    """JAX's Pallas TPU attention (the interpreter on the CPU) per shard of tp=4, its combined
    K/V pool split by heads (2 KV heads, each repeated on two shards): greedy ids against the
    reference attention on one device, padded decode, ragged chunks and mixed iterations."""
    config = json.loads((MODELS["llama"] / "config.json").read_text())
    config |= dict(hidden_size=256, intermediate_size=256, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=128, vocab_size=300, num_hidden_layers=2)
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(4)
    prompts = [{"prompt_token_ids": rng.integers(3, 300, int(n)).tolist()} for n in (7, 40, 21)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    base = dict(load_format="dummy", max_num_seqs=4, max_num_batched_tokens=32,
                prefill_chunk_sizes=(16, 32), num_pages=48, page_size=8, row_buckets=(4,),
                enable_prompt_logprobs=False, matmul_impl="xla")
    return {name: [o.outputs[0].token_ids for o in LLM(
                tmp, attention_impl=impl, tensor_parallel_size=tp, **base).generate(prompts, params)]
            for name, impl, tp in (("reference", "reference", 1), ("tpu", "tpu", 4))}


def lora_cases() -> dict:
    """The tiny Llama's three PEFT adapters mixed with base requests (make_lora_fixtures.py),
    at tp 1, 2 and 4 (4 shards of its 2 KV heads: k_proj's and v_proj's B repeated as their
    kernels): greedy ids, PEFT's expected, and compiles after warm-up."""
    from jaxserve import LoRARequest

    fixture = MODELS["llama"] / "lora"
    expected = json.loads((fixture / "expected.json").read_text())
    base = json.loads((MODELS["llama"] / "expected.json").read_text())["greedy"]
    names = list(expected["adapters"])
    params = SamplingParams(max_tokens=expected["new_tokens"], temperature=0.0, ignore_eos=True)
    prompts, loras, want = [], [], []
    for i, prompt in enumerate(expected["prompts"]):
        for j, name in enumerate([None, *names]):
            prompts.append({"prompt_token_ids": prompt})
            loras.append(None if name is None else LoRARequest(name, j, str(fixture / name)))
            want.append(base[i][:expected["new_tokens"]] if name is None
                        else expected["adapters"][name]["greedy"][i])
    report = {"expected": want}
    for tp in (1, 2, 4):
        llm = LLM(MODELS["llama"], tensor_parallel_size=tp, enable_lora=True, max_loras=2,
                  **ENGINE | dict(max_num_seqs=8, row_buckets=(8,), num_pages=160))
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        report[str(tp)] = {"ids": [o.outputs[0].token_ids for o in outs],
                           "compiles": llm.stats()["num_compilations_after_warmup"]}
    return report


def main() -> None:
    if len(jax.devices()) < 8:
        sys.exit("run with XLA_FLAGS=--xla_force_host_platform_device_count=8")
    report = {name: run_model(path, (1, 2, 4)) for name, path in MODELS.items()
              if name not in ("stories260K", "mixtral", "qwen3_moe")}
    # mixtures of experts: each expert split (tp=2), and whole experts over 4 devices
    for name in ("mixtral", "qwen3_moe"):
        report[name] = run_model(MODELS[name], (1, 2))
        report[f"{name}_ep"] = run_model(MODELS[name], (1, 4), enable_expert_parallel=True)
    report["stories260K"] = run_model(MODELS["stories260K"], (1, 4))
    # quantised weights: the narrow kernels and their column scales split with the model
    report["llama_int8"] = run_model(MODELS["llama"], (1, 2, 4), quantization="int8")
    report["qwen2_fp8"] = run_model(MODELS["qwen2"], (1, 2), quantization="fp8")
    # int4 checkpoints (compressed-tensors' pack-quantized), unpacked onto their shards
    for name in ("llama_w4a16", "llama_w4a16_g32"):  # per column, per group of 32 rows
        report[name] = run_model(ROOT / "tests" / "fixtures" / "hf" / name, (1, 2))
    # group-wise layers held as they are (XLA's dot; the CPU's kernels dequantise them at load)
    report["llama_w4a16_g32_xla"] = run_model(
        ROOT / "tests" / "fixtures" / "hf" / "llama_w4a16_g32", (1, 2), matmul_impl="xla")
    # AWQ's 4-bit weights with zero points: uint4 values and group-wise zero points, split as
    # their group-wise scales are
    from test_gptq_awq import write_packed

    with tempfile.TemporaryDirectory() as tmp:
        awq = write_packed(Path(tmp) / "awq", "awq", sym=False, fmt="awq")
        report["llama_awq"] = run_model(awq, (1, 2))
        report["llama_awq_xla"] = run_model(awq, (1, 2), matmul_impl="xla")
    # a GGUF's Q4_1 layers (uint4, float16 scales and minima a group) and Q8_0 embedding, split
    # as held (XLA's dot) and dequantised at load (the CPU's kernels)
    from gguf import GGMLQuantizationType
    from gguf_writer import write_gguf

    with tempfile.TemporaryDirectory() as tmp:
        gguf = write_gguf(MODELS["llama"], Path(tmp) / "q.gguf",
                          linear=GGMLQuantizationType.Q4_1, embedding=GGMLQuantizationType.Q8_0)
        report["llama_gguf"] = run_model(gguf, (1, 2))
        report["llama_gguf_xla"] = run_model(gguf, (1, 2), matmul_impl="xla")
    report["stories260K_reference"] = stories_reference(4)
    # data parallelism: replicas on their own devices, requests spread over them
    report["data_parallel"] = {name: {f"{dp}x{tp}": data_parallel(MODELS[name], dp, tp)
                                      for dp, tp in sizes}
                               for name, sizes in DATA_PARALLEL.items()}
    report["stories260K_reference_dp"] = stories_reference(2, dp=2)
    # the prefix cache over a sharded pool (and each replica's own)
    report["prefix_cached"] = {f"{dp}x{tp}" + ("" if cache else " off"): prefix_cached(
        dp, tp, cache) for dp, tp, cache in ((1, 2, False), (1, 2, True), (2, 2, True))}
    report["stories260K_controls"] = {tp: controlled_outputs(tp) for tp in (1, 2)}
    # random weights made on their shards: the same weights as on one device
    report["dummy_logits"] = {tp: prompt_logits(LLM(MODELS["llama"], load_format="dummy",
                                                    tensor_parallel_size=tp,
                                                    **ENGINE).engine.runner, PROMPTS[0]).tolist()
                              for tp in (1, 4)}
    # XLA's dot and attention: the shards' sums as all-reduces
    report["llama_reference_backend"] = run_model(MODELS["llama"], (1, 2),
                                                  **bench.BACKENDS["reference"])
    report["sharded_greedy"] = sharded_greedy_cases()
    report["lora"] = lora_cases()
    with tempfile.TemporaryDirectory() as tmp:
        report["tpu_attention"] = tpu_attention_ids(Path(tmp))
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
