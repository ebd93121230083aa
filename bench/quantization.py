"""Quantised weights (quantization="int8" | "fp8" | "int4") against float32 and bfloat16, one run:

    python bench/quantization.py [--skip-speed] [--skip-quality] [--skip-smollm2]

Speed: decode tokens/s at 1 and 32 rows on bench/models/llama-300m (random weights; its
linear layers' 720 MB of float32 exceed the last-level cache, so a decode step reads them from
memory), the CPU backend (the C++ matmul kernel: int8 and fp8 weights widened in registers;
int4 weights held as int8 there, so their speed is int8's),
with each configuration's weight bytes.
Quality, against the independent references: stories260K's greedy ids against its C
reference (tokens before the first difference, and the share of the reference's tokens that
are the model's top token under teacher forcing), and the demo model's bits per byte on its
held-out text (the validation windows its training report used).
SmolLM2-135M-Instruct (its Q4_1 GGUF, jaxserve/tools/fetch.py), against what transformers
generated in float32 on the file's dequantised weights (tests/fixtures/smollm2_reference.json:
12 chat prompts, 64 greedy tokens each): the file's own layers in float32 and in bfloat16, and
their dequantised weights requantised per output channel to int8, fp8 and int4 (the
quantization option on a GGUF file). For each, the
greedy tokens before the first difference (mean and min over the prompts, and how many agree on
all 64), the share of the reference's tokens that are the model's top token given the
reference's prefix (teacher forcing), and the weight bytes the configuration holds.
"""

import argparse
import dataclasses
import json
import time
from pathlib import Path

from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.tools.calibrate import profile_output, time_iteration

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "bench" / "models" / "llama-300m"
STORIES = ROOT / "models" / "stories260K"
SMOLLM2_REFERENCE = ROOT / "tests" / "fixtures" / "smollm2_reference.json"
# (label, dtype, quantization)
CONFIGS = [("float32", "float32", None), ("bfloat16", "bfloat16", None),
           ("int8", "float32", "int8"), ("fp8", "float32", "fp8"), ("int4", "float32", "int4")]


def speed(rows: tuple[int, ...], context: int) -> None:
    print(f"{MODEL.name}, decode at context {context} (CPU backend, one iteration in flight)")
    print(f"{'weights':<10}{'MiB':>8}" + "".join(f"{f'{r} rows tok/s':>16}" for r in rows)
          + f"{'vs float32 at 1':>18}")
    base = None
    for label, dtype, quantization in CONFIGS:
        engine = LLMEngine(MODEL, EngineConfig(
            dtype=dtype, quantization=quantization, load_format="dummy",
            max_num_seqs=max(rows), max_num_batched_tokens=256, prefill_chunk_sizes=(256,),
            num_pages=max(rows) * (context // 16 + 2) + 1, enable_prompt_logprobs=False,
            row_buckets=tuple(sorted({max(2, r) for r in rows}))), progress=False)
        rates = [r / time_iteration(engine, profile_output(engine, (r, context, 1, 0, 0)),
                                    budget_s=2.0) for r in rows]
        base = base or rates[0]
        print(f"{label:<10}{engine.runner.weight_bytes / 2**20:>8.0f}"
              + "".join(f"{rate:>16.1f}" for rate in rates) + f"{rates[0] / base:>17.2f}x",
              flush=True)
        del engine


def agreement(llm: LLM, cases: list[dict]) -> tuple[list[int], int]:
    """Per case, the greedy tokens before the first difference from its `generated_ids`; and
    how many of all the cases' generated ids are the model's top token given the reference's
    prefix (teacher forcing: prompt and reference ids as one prompt, read from its prompt
    logprobs)."""
    outs = llm.generate([{"prompt_token_ids": c["prompt_ids"]} for c in cases],
                        [SamplingParams(max_tokens=len(c["generated_ids"]), temperature=0.0,
                                        ignore_eos=True) for c in cases], use_tqdm=False)
    before = [next((i for i, (a, b) in enumerate(zip(o.outputs[0].token_ids,
                                                      c["generated_ids"], strict=True))
                    if a != b), len(c["generated_ids"])) for o, c in zip(outs, cases,
                                                                            strict=True)]
    agree = 0
    for case in cases:
        ids = case["prompt_ids"] + case["generated_ids"]
        out = llm.generate({"prompt_token_ids": ids},
                           SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
        agree += sum(out.prompt_logprobs[p][ids[p]].rank == 1
                     for p in range(len(case["prompt_ids"]), len(ids)))
    return before, agree


def stories_quality() -> None:
    cases = json.loads((STORIES / "reference_outputs.json").read_text())["cases"]
    total = sum(len(c["generated_ids"]) for c in cases)
    print(f"\nstories260K against its C reference ({len(cases)} prompts, {total} tokens)")
    print(f"{'weights':<10}{'tokens before the first difference':>36}{'share':>8}"
          f"{'teacher-forced top-1':>22}")
    for label, quantization in (("float32", None), ("int8", "int8"), ("fp8", "fp8"),
                                ("int4", "int4")):
        llm = LLM(STORIES, quantization=quantization, page_size=4, prefill_chunk_sizes=(64,),
                  max_num_seqs=8, max_num_batched_tokens=256, num_pages=512)
        before, agree = agreement(llm, cases)
        print(f"{label:<10}{before!s:>36}{sum(before) / total:>8.1%}{agree / total:>22.1%}",
              flush=True)


def smollm2_quality() -> None:
    from jaxserve.tools.fetch import fetch_smollm2

    path = fetch_smollm2()
    cases = json.loads(SMOLLM2_REFERENCE.read_text())["prompts"]
    total = sum(len(c["generated_ids"]) for c in cases)
    new = len(cases[0]["generated_ids"])
    print(f"\nSmolLM2-135M-Instruct against transformers in float32 on the dequantised file "
          f"({len(cases)} prompts, {total} tokens)")
    print(f"{'weights':<20}{'before the first difference':>29}{f'all {new}':>8}"
          f"{'teacher-forced top-1':>22}{'MiB':>8}")
    print(f"{'':<20}{'mean':>15}{'min':>14}")
    # (label, dtype, quantization): None keeps the file's own Q4_1 layers
    for label, dtype, quantization in (("Q4_1 (file) float32", "float32", None),
                                       ("Q4_1 (file) bf16", "bfloat16", None),
                                       ("int8", "float32", "int8"), ("fp8", "float32", "fp8"),
                                       ("int4", "float32", "int4")):
        llm = LLM(str(path), dtype=dtype, quantization=quantization, max_num_seqs=16,
                  max_model_len=256, page_size=16, max_num_batched_tokens=256)
        before, agree = agreement(llm, cases)
        print(f"{label:<20}{sum(before) / len(before):>15.1f}{min(before):>14}"
              f"{sum(b == new for b in before):>5}/{len(cases):<2}{agree / total:>22.1%}"
              f"{llm.llm_engine.runner.weight_bytes / 2**20:>8.1f}", flush=True)
        del llm


def demo_bpb(windows: int) -> None:
    import jax.numpy as jnp

    from jaxserve.config.model import ModelConfig
    from jaxserve.demo import demo_model_dir
    from jaxserve.demo.data import evenly_spaced_windows, load_corpus
    from jaxserve.demo.train import validation_bpb
    from jaxserve.model.loader import load_state

    demo = demo_model_dir()
    cfg = ModelConfig.from_hf_dir(demo)
    val = evenly_spaced_windows(load_corpus().val, windows, cfg.max_position_embeddings)
    print(f"\nthe demo model's bits per byte on {windows} held-out windows of "
          f"{cfg.max_position_embeddings} bytes")
    base = None
    for label, quantization in (("float32", None), ("int8", "int8"), ("fp8", "fp8"),
                                ("int4", "int4")):
        graphdef, state = load_state(demo, dataclasses.replace(cfg, quantization=quantization),
                                     jnp.float32)
        bpb = validation_bpb(graphdef, state, val, batch_size=8)
        base = base or bpb
        print(f"{label:<10}{bpb:>8.4f}{(bpb / base - 1):>+9.2%}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-smollm2", action="store_true")
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--windows", type=int, default=128)
    args = parser.parse_args()
    start = time.perf_counter()
    if not args.skip_speed:
        speed(tuple(int(r) for r in args.rows.split(",")), args.context)
    if not args.skip_quality:
        stories_quality()
        demo_bpb(args.windows)
    if not args.skip_smollm2:
        smollm2_quality()
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
