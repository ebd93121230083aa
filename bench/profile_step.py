"""Where a decode step's time goes: XLA's own profile of the engine's jitted step, by op kind.

    python bench/profile_step.py                       # the peer model's shape, 64 rows x 300
    python bench/profile_step.py --model bench/models/llama-20m --rows 32 --context 200
    python bench/profile_step.py --rows 4 --prefill 256   # a prefill call: 4 new prompts x 256
    python bench/profile_step.py --rows 2 --verify 4      # and speculation's verification, k=4

Builds the engine's runner on the model's shape with random weights, times one decode step of
`--rows` sequences near `--context` tokens each (their pages scattered over the pool, as a busy
engine's are), then traces a few steps with `jax.profiler` and sums XLA's ops by kind (the
numeric suffix dropped: every `transpose_copy_fusion.N` is one kind; a custom call is named by its
target and output shape, so the matmul's and attention's kernels are told apart). On the CPU the
ops of both executor threads add up and a `while` op counts its body's ops again, so the column sums to more
than the step's wall time; read it for the large entries.

With `--verify K` it also times speculative decoding's verification call on the same rows, each
its newest token and K drafts (K + 1 query tokens a row), and prints its cost against the decode
step's: a verification that keeps n drafts gives n + 1 tokens, so speculation pays once the
drafts a verification keeps average more than verify / decode - 1 (the proposer's host time aside).
"""

import argparse
import collections
import re
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxserve.config.engine import EngineConfig  # noqa: E402
from jaxserve.config.model import ModelConfig  # noqa: E402
from jaxserve.model.kv_cache import AttentionMetadata  # noqa: E402
from jaxserve.model.sampler import SamplingMetadata  # noqa: E402
from jaxserve.model.step import pack_decode_rows  # noqa: E402
from jaxserve.runner.model_runner import ModelRunner  # noqa: E402

# the executor's own spans
_WRAPPERS = ("ThunkExecutor", "SlinkyThreadPool", "ThreadpoolListener", "end:")


def custom_call_names(hlo_text: str) -> dict[str, str]:
    """A compiled module's custom-call op names -> "target output-shape", from its HLO text."""
    names = {}
    for line in hlo_text.splitlines():
        op = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = (\S+) custom-call\(", line)
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if op and target:
            shape = re.sub(r"\{[^}]*\}", "", op.group(2))
            names[op.group(1)] = f"{target.group(1)} {shape}"
    return names


def op_totals(profile: jax.profiler.ProfileData, steps: int,
              names: dict[str, str] | None = None) -> dict[str, tuple[float, float]]:
    """Op kind -> (milliseconds, calls) per step, from XLA's op events: a GPU's "XLA Ops" line
    when the trace has a device, else the CPU client's executor threads. `names` renames ops
    (custom calls by their target, see custom_call_names) before the suffix is dropped."""
    names = names or {}
    planes = [p for p in profile.planes if p.name.startswith("/device:")]
    if planes:
        lines = [ln for p in planes for ln in p.lines if ln.name == "XLA Ops"]
        if not lines:  # other jax versions name the device's lines otherwise: say which
            print("no 'XLA Ops' line on the device; its lines:",
                  sorted({f"{p.name}: {ln.name}" for p in planes for ln in p.lines}))
    else:  # the executor's threads (its pool's, and the client's, which runs a step with a
        # custom call in it); other jax versions may name them otherwise
        host = [ln for p in profile.planes for ln in p.lines]
        lines = ([ln for ln in host if ln.name.startswith("tf_XLA")] or
                 [ln for ln in host if "python" not in ln.name.lower()])
    ms, calls = collections.Counter(), collections.Counter()
    for line in lines:
        for event in line.events:
            if event.name.startswith(_WRAPPERS):
                continue
            kind = names.get(event.name) or re.sub(r"\.\d+$", "", event.name)
            ms[kind] += event.duration_ns / 1e6 / steps
            calls[kind] += 1 / steps
    return {k: (ms[k], calls[k]) for k, _ in ms.most_common()}


def decode_inputs(runner: ModelRunner, rows: int, context: int, seed: int = 0):
    """A decode step's arrays: `rows` sequences of context +-10% tokens on random pages."""
    rng = np.random.default_rng(seed)
    pages = rng.permutation(np.arange(1, runner.num_pages))[:rows * runner.pages_per_seq]
    table = pages.reshape(rows, runner.pages_per_seq).astype(np.int32)
    spread = max(1, context // 10)
    lens = rng.integers(max(1, context - spread), context + spread + 1, rows).astype(np.int32)
    md = AttentionMetadata(positions=(lens - 1)[:, None], query_lens=np.ones(rows, np.int32),
                           seq_lens=lens, page_table=table)
    vocab = runner.model_config.vocab_size
    sm = SamplingMetadata(temperature=np.zeros(rows, np.float32),
                          top_k=np.full(rows, vocab, np.int32), top_p=np.ones(rows, np.float32),
                          seeds=np.zeros(rows, np.uint32), positions=lens,
                          logprobs=np.zeros(rows, bool))
    tokens = rng.integers(0, vocab, rows).astype(np.int32)
    return tokens, np.full(rows, -1, np.int32), md, sm


def prefill_inputs(runner: ModelRunner, rows: int, chunk: int, seed: int = 0):
    """A prefill call's arrays: `rows` new prompts of `chunk` tokens each on random pages."""
    rng = np.random.default_rng(seed)
    pages = rng.permutation(np.arange(1, runner.num_pages))[:rows * runner.pages_per_seq]
    table = pages.reshape(rows, runner.pages_per_seq).astype(np.int32)
    lens = np.full(rows, chunk, np.int32)
    md = AttentionMetadata(positions=np.tile(np.arange(chunk, dtype=np.int32), (rows, 1)),
                           query_lens=lens, seq_lens=lens, page_table=table)
    vocab = runner.model_config.vocab_size
    sm = SamplingMetadata(temperature=np.zeros(rows, np.float32),
                          top_k=np.full(rows, vocab, np.int32), top_p=np.ones(rows, np.float32),
                          seeds=np.zeros(rows, np.uint32), positions=lens,
                          logprobs=np.zeros(rows, bool))
    return rng.integers(0, vocab, (rows, chunk)).astype(np.int32), md, sm


def verify_inputs(runner: ModelRunner, md: AttentionMetadata, k: int, seed: int = 0):
    """A verification call's arrays for the rows of decode_inputs' `md`: each row its newest
    token at the decode step's position and k random drafts after it, as
    ModelRunner._dispatch_verify builds them (its sampling arrays are the decode step's: both
    sample first at the position past the newest token)."""
    rng = np.random.default_rng(seed)
    rows = len(md.seq_lens)
    start = md.seq_lens - 1  # the newest token's position
    tokens = rng.integers(0, runner.model_config.vocab_size, (rows, k + 1)).astype(np.int32)
    query_lens = np.full(rows, k + 1, np.int32)
    vmd = AttentionMetadata(positions=start[:, None] + np.arange(k + 1, dtype=np.int32),
                            query_lens=query_lens, seq_lens=start + query_lens,
                            page_table=md.page_table)
    return tokens, vmd, tokens[:, 1:], np.full(rows, k, np.int32)


def times_of(step, iters: int) -> list[float]:
    """Seconds per call of `step` (which waits for its result), after one call to compile."""
    step()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="a directory with config.json (default: bench/peer_hf.py's model)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--prefill", type=int, default=0, metavar="C",
                        help="profile a prefill call of --rows new prompts of C tokens instead")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--top", type=int, default=15, help="op kinds to print")
    parser.add_argument("--attention-impl", default="auto", help="as the engine's option")
    parser.add_argument("--matmul-impl", default="auto", help="as the engine's option")
    parser.add_argument("--kv-cache-dtype", default="auto", help="as the engine's option")
    parser.add_argument("--dtype", default="auto", help="as the engine's option")
    parser.add_argument("--quantization", default=None, choices=("int8", "fp8", "int4"),
                        help="as the engine's option")
    parser.add_argument("--scan-layers", choices=("auto", "true", "false"), default="auto",
                        help="as the engine's option (auto: the backend's choice)")
    parser.add_argument("--verify", type=int, default=0, metavar="K",
                        help="also time speculation's verification call, K drafts a row, "
                             "against the decode step")
    args = parser.parse_args(argv)
    if args.rows < 2 or args.context < 1 or args.verify < 0:
        raise SystemExit("--rows must be at least 2, --context at least 1 and --verify at least 0")
    if args.prefill < 0:
        raise SystemExit("--prefill must be a chunk length of at least 2 tokens, or 0")
    if args.verify and args.prefill:
        raise SystemExit("--verify compares against a decode step: not with --prefill")

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or _peer_config(Path(tmp))
        mc = ModelConfig.from_hf_dir(model)
        max_len = mc.max_position_embeddings
        if max(args.context * 11 // 10 + 2 + args.verify, args.prefill) > max_len:
            raise SystemExit(f"--context {args.context} or --prefill {args.prefill} leaves no "
                             f"room in the model's {max_len} positions")
        if 0 < args.prefill < 2:
            raise SystemExit("--prefill must be a chunk length of at least 2 tokens, or 0")
        config = EngineConfig(load_format="dummy", max_num_seqs=args.rows,
                              row_buckets=(args.rows,), enable_prompt_logprobs=False,
                              attention_impl=args.attention_impl, matmul_impl=args.matmul_impl,
                              kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype,
                              quantization=args.quantization,
                              scan_layers={"auto": None, "true": True,
                                           "false": False}[args.scan_layers],
                              max_num_batched_tokens=max(args.rows, args.rows * args.prefill),
                              prefill_chunk_sizes=(max(args.prefill, 2),),
                              speculative_config={"method": "ngram",
                                                  "num_speculative_tokens": args.verify}
                              if args.verify else None)
        config = replace(config, num_pages=args.rows * config.pages_per_seq(max_len) + 1)
        mc = config.served_model(mc)
        runner = ModelRunner(model, mc, config)
        if args.prefill:
            tokens, md, sm = prefill_inputs(runner, args.rows, args.prefill)
            carry_index = np.arange(args.rows, dtype=np.int32)
            call = (runner.weights, runner.kv, tokens, md, sm, runner._zeros, carry_index)
            hlo = runner.fns.prefill.lower(*call).compile().as_text()
            what = f"prefill call of {args.rows} rows x {args.prefill} tokens"

            def step():
                packed, _, runner.kv = runner.fns.prefill(runner.weights, runner.kv, tokens, md,
                                                          sm, runner._zeros, carry_index)
                packed.block_until_ready()
        else:
            _, _, md, sm = inputs = decode_inputs(runner, args.rows, args.context)
            rows = pack_decode_rows(*inputs)
            call = (runner.weights, runner.kv, rows, *runner._carries)
            hlo = runner.fns.decode.lower(*call, steps=1).compile().as_text()
            what = f"decode step of {args.rows} rows at about {args.context} tokens"

            def step():
                packed, _, runner.kv = runner.fns.decode(runner.weights, runner.kv, rows,
                                                         *runner._carries, steps=1)
                packed.block_until_ready()

        times = times_of(step, args.iters)
        with tempfile.TemporaryDirectory() as trace_dir:
            jax.profiler.start_trace(trace_dir)
            for _ in range(5):
                step()
            jax.profiler.stop_trace()
            trace = next(Path(trace_dir).rglob("*.xplane.pb"))
            totals = op_totals(jax.profiler.ProfileData.from_file(str(trace)), 5,
                               custom_call_names(hlo))
        if args.verify:
            query, vmd, drafts, num_drafts = verify_inputs(runner, md, args.verify)

            def verify():
                packed, runner.kv = runner.fns.verify(runner.weights, runner.kv, query[:, 0],
                                                      drafts, num_drafts, vmd, sm, None)
                packed.block_until_ready()

            verify_times = times_of(verify, args.iters)

    print(f"{mc.num_params / 1e6:.1f}M parameters on {jax.default_backend()} "
          f"({runner.attention_impl} attention, {runner.matmul_impl} matmul, "
          f"{runner.kv_dtype_name} KV): {what}: median "
          f"{1e3 * np.median(times):.1f} ms, best {1e3 * min(times):.1f} ms; weights "
          f"{runner.weight_bytes / 1e9:.2f} GB ({mc.quantization or runner.dtype.__name__}), "
          f"read once a step at {runner.weight_bytes / np.median(times) / 1e9:.0f} GB/s")
    print(f"{'ms/step':>9} {'calls':>7}  op kind")
    for kind, (ms, calls) in list(totals.items())[:args.top]:
        print(f"{ms:9.2f} {calls:7.1f}  {kind}")
    if args.verify:
        ratio = np.median(verify_times) / np.median(times)
        print(f"verify K={args.verify}: {1e3 * np.median(verify_times):.1f} ms a step vs decode "
              f"{1e3 * np.median(times):.1f} ms ({ratio:.2f}x) at {args.rows} rows; speculation "
              f"pays above {max(ratio - 1, 0):.2f} accepted drafts a verification on average")


def _peer_config(folder: Path) -> Path:
    import json

    from peer_hf import PEER_MODEL

    config = dict(PEER_MODEL, architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5,
                  dtype="float32", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


if __name__ == "__main__":
    main()
