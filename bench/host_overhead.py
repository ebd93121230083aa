"""The host's cost per engine iteration, over a stand-in accelerator (issue 29's yardstick).

    python bench/host_overhead.py                      # 8, 64, 256 sequences; 5 ms steps
    python bench/host_overhead.py --seqs 256 --step-ms 5 --long-tokens 8192

The real LLMEngine, scheduler and runner run a 1-layer, 32-wide Llama (random weights); its
prompts run the real model, its decode steps a stand-in with the real step's arguments and
results that runs no model: it waits `--step-ms` in a host callback (without using a core, and
dispatch stays asynchronous: the host goes on while the "device" works). So the device's own
work does not take the host's cores (256 rows' attention over 2,048-token contexts would, here,
where the "device" is the same two cores). Every decode iteration's host time is split into

    schedule   Scheduler.schedule
    batch      the runner's persistent arrays updated and each call's gathered (a decode
               call's one array; the metadata and sampling arrays of the others)
    dispatch   the jitted calls themselves (launch)
    collect    reading the step's results once they are ready (not the wait for them)
    output     the way out: the output processor (stops, logprobs, detokenizing, outputs), the
               scheduler's update, the engine's own

and the device's idle share is the part of the measured window in which no stand-in step slept.
The requests are long enough that every measured iteration runs all `--seqs` of them.
With `--long-tokens N`, one request generates N tokens alone and the host time of its last
1,024 tokens is compared with its first 1,024 (it should not grow with output length).
Contexts are `--context` tokens long (prompts of that length, then decode). With
`--tokenizer DIR` (a model directory: stories260K's SentencePiece tokenizer, the demo's byte
tokenizer) the outputs are text too, streamed as DELTA outputs as the server's are: the stand-in
"samples" a story's tokens in turn, and "output" counts their detokenizing.
"""

import argparse
import contextlib
import dataclasses
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine, freeze_gc
from jaxserve.model.sampler import packed_width
from jaxserve.model.step import unpack_decode_rows
from jaxserve.request import RequestOutputKind, SamplingParams

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32"}
PHASES = ("schedule", "batch", "dispatch", "collect", "output")
WAIT = "wait"  # the host blocked on the device's results: not host work
NOT_HOST = (WAIT,)


class Device:
    """The stand-in accelerator: the decode step is a jitted call with the real one's arguments
    and results (the same arrays cross from the host, the KV pool is donated and handed back)
    that runs no model, only "samples" each row's input token plus one; the device's time is
    modelled: a serial queue whose steps take `step_s` each, a step starting when it is launched
    or when the one before it ends, whichever is later. Reading a step's results waits (sleeps)
    until it ends, as for a real device. The device sits idle only between the end of a step
    and the launch of the next: its idle time is the sum of those gaps.

    (A host callback that sleeps inside the jitted call would model it too, but the CPU client
    runs a computation holding a host callback in the caller's thread when its inputs are
    ready, so once one step is read before the next launches, every launch would wait out the
    whole sleep.)"""

    def __init__(self, step_s: float, vocab_size: int, width: int, carry_size: int,
                 text_ids: list[int] | None = None):
        """`text_ids`: "sample" them in turn, the one at each row's position (a text to
        detokenize), instead of each input token plus one."""
        self.step_s = step_s
        self.launches: list[float] = []  # when each step was dispatched
        self.ends: list[float] = []  # when each step ends
        self._ends_by_result: dict[int, float] = {}  # id(packed result) -> its step's end
        text = None if text_ids is None else jnp.asarray(text_ids, jnp.int32)

        def decode(weights, kv, rows, carry0, carry1, steps):
            host_tokens, src, md, _ = unpack_decode_rows(rows)
            carries = jnp.concatenate([carry0, carry1])
            tokens = jnp.where(src >= 0, carries[jnp.maximum(src, 0)], host_tokens)
            if text is None:
                sampled = 3 + (tokens - 2) % (vocab_size - 3)  # never a special token
            else:
                sampled = text[(md.positions[:, 0] + 1) % text.shape[0]]
            packed = jnp.zeros((steps, tokens.shape[0], width), jnp.int32)
            packed = packed.at[:, :, 0].set(sampled)
            carry = jnp.zeros((carry_size,), jnp.int32).at[:tokens.shape[0]].set(sampled)
            return packed, carry, kv

        # keep_unused: the weights and metadata cross to the "device" as the real step's do
        self._decode = jax.jit(decode, donate_argnums=(1,), static_argnames=("steps",),
                               keep_unused=True)

    def decode(self, *args, **kwargs):
        out = self._decode(*args, **kwargs)
        now = time.perf_counter()
        end = max(now, self.ends[-1] if self.ends else now) + self.step_s
        self.launches.append(now)
        self.ends.append(end)
        self._ends_by_result[id(out[0])] = end
        return out

    def wait(self, packed) -> None:
        """Sleep until the step that produced `packed` has ended (a prompt's call: no wait)."""
        end = self._ends_by_result.pop(id(packed), None)
        if end is not None:
            time.sleep(max(0.0, end - time.perf_counter()))

    def idle_in(self, start: float, end: float) -> float:
        """Seconds of [start, end] between a step's end and the next step's launch."""
        pairs = zip(self.ends, self.launches[1:], strict=False)
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in pairs)


class Timers:
    """Seconds per phase of the current iteration, reset per engine step."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.now = dict.fromkeys((*PHASES, *NOT_HOST), 0.0)
        self.active: set[str] = set()  # phases being timed: a nested call is not counted again

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            if phase in self.active:
                return fn(*args, **kwargs)
            self.active.add(phase)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[phase] += time.perf_counter() - start
                self.active.discard(phase)
        return timed


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "byte_tokenizer.json")
TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
        "the park with her friends. One day, she found a shiny red ball under a big tree. ")


def _model_dir(max_model_len: int, tokenizer: Path | None = None) -> Path:
    """The tiny model's directory; with `tokenizer` (a model directory), its tokenizer and
    vocabulary size too."""
    path = Path(tempfile.mkdtemp(prefix="jaxserve-host-overhead-"))
    config = TINY | {"max_position_embeddings": max_model_len}
    if tokenizer is not None:
        config["vocab_size"] = json.loads((tokenizer / "config.json").read_text())["vocab_size"]
        for name in TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                shutil.copy(tokenizer / name, path / name)
    (path / "config.json").write_text(json.dumps(config))
    return path


def budget(seqs: int) -> int:
    """The step's token budget: every decode row and at least as many prompt tokens."""
    return max(2048, 2 * seqs)


def build(seqs: int, context: int, step_ms: float, long_tokens: int = 0,
          tokenizer: Path | None = None):
    """An engine over the stand-in device, with every step's timing wrapped; with `tokenizer`,
    the outputs are text too (the stand-in "samples" TEXT's tokens)."""
    model_len = context + max(long_tokens, 64) + 16
    config = EngineConfig.from_overrides(
        load_format="dummy", max_num_seqs=max(seqs, 2), max_model_len=model_len,
        max_num_batched_tokens=budget(seqs), page_size=16,
        num_pages=max(seqs, 2) * (-(-model_len // 16)) + 1,
        prefill_chunk_sizes=(min(512, model_len - 16),))
    engine = LLMEngine(_model_dir(model_len, tokenizer), config)
    freeze_gc()  # as the server does once its engine is warm
    runner = engine.runner
    text_ids = None if tokenizer is None else engine.tokenizer.encode(TEXT, False)
    device = Device(step_ms / 1000.0, runner.model_config.vocab_size,
                    packed_width(config.max_top_logprobs), runner.carry_size, text_ids)
    timers = Timers()
    fns = runner.fns
    runner.fns = dataclasses.replace(  # the stand-in decodes; the prompts run the real model
        fns, decode=timers.wrap("dispatch", device.decode),
        prefill=timers.wrap("dispatch", fns.prefill),
        prefill_with_prompt_logprobs=timers.wrap("dispatch", fns.prefill_with_prompt_logprobs),
        ragged=timers.wrap("dispatch", fns.ragged),
        ragged_head=timers.wrap("dispatch", fns.ragged_head))
    batch = runner.input_batch  # the persistent arrays' update, then each call's gather
    batch.update = timers.wrap("batch", batch.update)
    batch.decode_rows = timers.wrap("batch", batch.decode_rows)
    runner._metadata = timers.wrap("batch", runner._metadata)
    runner._sampling = timers.wrap("batch", runner._sampling)
    engine.scheduler.schedule = timers.wrap("schedule", engine.scheduler.schedule)
    collect = runner.collect

    def collect_ready(flight):  # the wait for the device is not host work
        arrays = [a for a in [flight.decode_packed] + [p.packed for p in flight.prefills]
                  if a is not None]
        wait = timers.wrap("wait", lambda: [device.wait(a) for a in arrays]
                           + [jax.block_until_ready(arrays)])
        wait()
        return timers.wrap("collect", collect)(flight)
    runner.collect = collect_ready
    # the way out: the output processor (stops, text, outputs) runs inside the engine loop,
    # then the scheduler's update and the engine's own
    processor = engine.core.processor
    processor.update = timers.wrap("output", processor.update)
    engine.scheduler.update = timers.wrap("output", engine.scheduler.update)
    engine._process = timers.wrap("output", engine._process)
    return engine, device, timers


def measure(seqs: int, context: int, step_ms: float, steps: int, seed: int = 0,
            tokenizer: Path | None = None) -> dict:
    # the requests decode while the later ones prefill: none may finish before the last
    # measured iteration, or the iterations run fewer rows than `seqs`
    prefill_steps = -(-seqs * context // (budget(seqs) - seqs)) + seqs
    max_tokens = prefill_steps + steps + 32
    engine, device, timers = build(seqs, context, step_ms, max_tokens + 8, tokenizer)
    rng = np.random.default_rng(seed)
    # with text, DELTA outputs, as the server streams them
    kind = RequestOutputKind.CUMULATIVE if tokenizer is None else RequestOutputKind.DELTA
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=kind)
    vocab = engine.runner.model_config.vocab_size
    for i in range(seqs):
        prompt = rng.integers(3, min(vocab, 500), context).tolist()
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while any(r.num_to_compute > 1 for r in engine.scheduler.requests.values()) or (
            engine.scheduler.waiting):  # prefill first: measure decode iterations only
        engine.step()
    for _ in range(3):
        engine.step()
    rows, start = [], time.perf_counter()
    for _ in range(steps):
        timers.reset()
        t = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t
        rows.append(timers.now | {"other": total - sum(timers.now.values())})
    end = time.perf_counter()
    if len(engine.scheduler.requests) != seqs:  # every measured iteration ran every row
        raise RuntimeError(f"{seqs - len(engine.scheduler.requests)} of {seqs} requests "
                           "finished before the last measured iteration")
    per_phase = {k: statistics.median(r[k] for r in rows) * 1e6
                 for k in (*PHASES, "other", *NOT_HOST)}
    host_us = statistics.median(sum(v for k, v in r.items() if k not in NOT_HOST)
                                for r in rows) * 1e6
    idle = device.idle_in(start, end) / (end - start)
    return {"seqs": seqs, "context": context, "step_ms": step_ms, "iterations": steps,
            "host_us_per_iteration": round(host_us, 1),
            "host_us_by_phase": {k: round(v, 1) for k, v in per_phase.items()
                                 if k not in NOT_HOST},
            "wait_us_per_iteration": round(per_phase[WAIT], 1),
            "device_idle_share": round(idle, 4)}


def long_request(tokens: int, step_ms: float) -> dict:
    engine, _, timers = build(1, 16, step_ms, long_tokens=tokens)
    engine.add_request("long", {"prompt_token_ids": list(range(3, 19))},
                       SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    per_token: list[float] = []
    while engine.has_unfinished_requests():
        timers.reset()
        t = time.perf_counter()
        engine.step()
        per_token.append(time.perf_counter() - t - timers.now[WAIT])
    first, last = per_token[2:1026], per_token[-1024:]
    # the sums carry every hiccup of a shared machine (a pause of the OS or the collector
    # lands in one block or the other); the medians per token show the trend alone
    return {"tokens": tokens, "host_ms_first_1024": round(sum(first) * 1e3, 2),
            "host_ms_last_1024": round(sum(last) * 1e3, 2),
            "last_over_first": round(sum(last) / sum(first), 3),
            "median_us_first_1024": round(statistics.median(first) * 1e6, 1),
            "median_us_last_1024": round(statistics.median(last) * 1e6, 1),
            "median_last_over_first": round(statistics.median(last) / statistics.median(first),
                                            3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=100, help="decode iterations measured")
    parser.add_argument("--long-tokens", type=int, default=8192,
                        help="one request's output length (0: skip)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a model directory whose tokenizer (and vocabulary size) to use: "
                             "the outputs are detokenized, as a server's are")
    args = parser.parse_args()
    out = {"jax": jax.__version__, "backend": jax.default_backend(),
           "tokenizer": None if args.tokenizer is None else str(args.tokenizer),
           "runs": [measure(n, args.context, args.step_ms, args.steps, tokenizer=args.tokenizer)
                    for n in args.seqs]}
    if args.long_tokens:
        with contextlib.suppress(KeyboardInterrupt):
            out["long_request"] = long_request(args.long_tokens, args.step_ms)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
