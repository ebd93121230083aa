"""llama.cpp beside jaxserve on SmolLM2-135M-Instruct's Q4_1 GGUF: the same file, prompts, machine.

    P=~/.cache/jaxserve/peers/llamacpp
    python3 -m venv $P && $P/bin/pip install llama-cpp-python    # its venv: the default below
    .venv/bin/python bench/peer_llamacpp.py [--peer-python $P/bin/python]

The install compiles llama.cpp from source with cmake (llama-cpp-python 0.3.36: 16 minutes on
2 cores shared with other jobs, a 162 MB venv). Two processes, never at once: this one
(jaxserve's venv) renders the chat prompts to ids with the GGUF's own template and tokenizer,
runs llama.cpp's side as this same file under --peer-python (request and result as JSON files),
then jaxserve's side. Each engine, greedy, every request exactly --max-tokens long (EOS
ignored), in two modes:

    one at a time   llama.cpp: Llama.generate, which never stops at EOS by itself (it is
                    create_completion that checks for it), keeping the KV of the previous
                    request's common prefix (its default); jaxserve: LLM.generate per request
                    (its prefix cache on, its default)
    all at once     llama.cpp: its batched API, llama_decode on a llama_batch of every request's
                    sequence (as llama.cpp's `batched` example and llama-server's slots do: the
                    prompts in chunks of --n-batch tokens, then one token of every sequence a
                    step); jaxserve: LLM.generate on them all (continuous batching)

llama.cpp computes with its own Q4_1 kernels on activations quantised to 8 bits (an f16 KV
cache), jaxserve with float32 activations on the file's Q4_1 blocks (4-bit values, a scale and a
minimum a block, widened inside the matmul), so greedy ids part where the top two logits are
close (SmolLM2's first answer token to "What is the capital of France?": 0.08 apart in
transformers' float32, the other way round in llama.cpp): reported, never asserted. The peer
runs with OMP_WAIT_POLICY=PASSIVE (--omp-wait-policy; see `exchange`).

It prints, per engine and mode: start-up (imports, load, compile, one warm-up request), wall
time, output tokens/s, time to first token (one at a time: from the request's own start; all at
once: from the start of the run), the 1-minute load average before the run (the machine's other
jobs), then each run's greedy ids against jaxserve's all-at-once run: requests identical and the
tokens before the first difference. bench/peer_vllm.py uses its harness.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ONE, ALL = "one at a time", "all at once"
FIXTURE = ROOT / "tests" / "fixtures" / "smollm2_reference.json"  # its 12 chats come first
MORE_CHATS = [
    "Name three animals that live in the ocean.", "What is the boiling point of water?",
    "Write a short poem about autumn leaves.", "How do airplanes stay in the air?",
    "Give me a recipe for a simple salad.", "What is the difference between weather and climate?",
    "Translate 'good morning' into Spanish.", "Why is the sky blue?",
    "Suggest a name for a small bakery.", "What are the planets of the solar system?",
    "Explain what a computer program is to a child.", "How many legs does a spider have?",
    "Write a sentence using the word 'curious'.", "What should I pack for a day at the beach?",
    "Describe a cat in three words.", "What is 7 times 8?",
    "Why do we need sleep?", "Tell me a fun fact about the moon.",
    "How can I save water at home?", "What is the tallest mountain on Earth?",
]

PEERS = "~/.cache/jaxserve/peers"  # the peers' venvs, beside jaxserve's other caches


# -- the workload and the comparison (this venv; no engine) --------------------------------------

def chats(n: int) -> list[list[dict]]:
    """n conversations: the reference fixture's 12, then MORE_CHATS, then again numbered."""
    base = [c["messages"] for c in json.loads(FIXTURE.read_text())["prompts"]]
    base += [[{"role": "user", "content": text}] for text in MORE_CHATS]
    out = []
    for i in range(n):
        messages = [dict(m) for m in base[i % len(base)]]
        if i >= len(base):  # a repeat differs from its first time after the system prompt
            messages[-1]["content"] = f"({i // len(base)}) {messages[-1]['content']}"
        out.append(messages)
    return out


def chat_prompt_ids(gguf: Path, n: int) -> list[list[int]]:
    """The n chats rendered once, with the GGUF's chat template and tokenizer (jaxserve's reader
    of them: tests/test_smollm2.py holds it to transformers'), as token ids for every engine."""
    from jaxserve.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(gguf)
    return [tokenizer.chat_prompt_ids(tokenizer.apply_chat_template(c, True)) for c in chats(n)]


def before_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Requests with identical greedy ids, and the tokens before the first difference."""
    before = [before_difference(x, y) for x, y in zip(a, b, strict=True)]
    return {"identical": sum(x == y for x, y in zip(a, b, strict=True)), "total": len(a),
            "mean_before": statistics.mean(before), "min_before": min(before)}


def row(name: str, mode: str, setting: str, startup_s: float, elapsed_s: float,
        ids: list[list[int]], ttft_s: list[float], load_avg: float) -> dict:
    out = sum(map(len, ids))
    print(f"{name} {mode} ({setting}): {elapsed_s:.2f} s, {out / elapsed_s:.1f} out tok/s",
          file=sys.stderr, flush=True)
    return {"name": name, "mode": mode, "setting": setting, "startup_s": startup_s,
            "elapsed_s": elapsed_s, "output_tokens": out, "output_tokens_per_s": out / elapsed_s,
            "ttft_median_s": statistics.median(ttft_s), "ttft_max_s": max(ttft_s),
            "load_avg": load_avg, "token_ids": ids}


def leave_bench_path() -> None:
    """Take this folder off sys.path (python put it first), so a peer's imports never find a
    benchmark script: bench/kernels.py would stand in for the `kernels` transformers imports."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]


def exchange(python: str, script: Path, request: dict,
             omp_wait_policy: str) -> list[dict]:
    """Run `script --peer-side` under another venv's python: the request in, its rows out, as
    JSON files (the peer's logs, on stdout or stderr, pass through). `omp_wait_policy`, when
    set, is the peer's OMP_WAIT_POLICY: both peers' threads are OpenMP's, which by default spin
    at each barrier, and on a machine whose other jobs take a core from them a step then waits
    for a thread that is not running (llama.cpp at n_threads 2 here: 2 tok/s active, 20
    passive)."""
    env = os.environ | ({"OMP_WAIT_POLICY": omp_wait_policy} if omp_wait_policy else {})
    with tempfile.TemporaryDirectory() as tmp:
        req, out = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        done = subprocess.run([python, str(script), "--peer-side", str(req), str(out)], env=env)
        if done.returncode or not out.is_file():
            raise SystemExit(f"the peer's side ({python} {script.name}) failed: exit code "
                             f"{done.returncode}")
        return json.loads(out.read_text())


def print_table(rows: list[dict], max_tokens: int) -> None:
    print(f"\n{'engine':<10}{'mode':<15}{'start-up s':>11}{'wall s':>9}{'out tok/s':>11}"
          f"{'TTFT median':>13}{'TTFT max':>10}{'load avg':>10}  setting")
    for r in rows:
        print(f"{r['name']:<10}{r['mode']:<15}{r['startup_s']:>11.1f}{r['elapsed_s']:>9.2f}"
              f"{r['output_tokens_per_s']:>11.1f}{1e3 * r['ttft_median_s']:>10.0f} ms"
              f"{1e3 * r['ttft_max_s']:>7.0f} ms{r['load_avg']:>10.1f}  {r['setting']}")
    reference = next(r for r in rows if r["name"] == "jaxserve" and r["mode"] == ALL)
    print(f"\ngreedy ids against jaxserve {ALL} (of {max_tokens} tokens a request):")
    for r in rows:
        if r is not reference:
            a = agreement(reference["token_ids"], r["token_ids"])
            print(f"  {r['name']} {r['mode']:<15} {a['identical']:>3}/{a['total']} identical; "
                  f"before the first difference: mean {a['mean_before']:.1f}, min "
                  f"{a['min_before']}")


# -- jaxserve's side (this venv) -------------------------------------------------------------------

def jaxserve_rows(model: str, prompts: list[list[int]], max_tokens: int, modes: list[str],
                  options: dict) -> list[dict]:
    """jaxserve on `model` (the GGUF, or an HF directory), each mode after one warm-up."""
    start = time.perf_counter()
    from jaxserve import LLM, SamplingParams

    llm = LLM(model, **options)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],
                 SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    startup = time.perf_counter() - start
    runner = llm.engine.runner
    setting = (f"{options.get('dtype', 'auto')}, max_num_seqs {options['max_num_seqs']}, "
               f"{runner.attention_impl} attention, {runner.matmul_impl} matmul")
    rows = []
    for mode in modes:
        llm.reset_prefix_cache()  # nothing of the warm-up or an earlier mode is reused
        load = os.getloadavg()[0]
        began = time.perf_counter()
        if mode == ALL:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
        else:
            outs = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
                    for p in prompts]
        elapsed = time.perf_counter() - began
        ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
        if mode == ALL:  # from the start of the run, as the peers' all-at-once runs count it
            first = min(o.metrics.arrival_time for o in outs)
            ttft = [o.metrics.first_token_time - first for o in outs]
        rows.append(row("jaxserve", mode, setting, startup, elapsed,
                        [list(o.outputs[0].token_ids) for o in outs], ttft, load))
    return rows


def jaxserve_options(args, prompts: list[list[int]]) -> dict:
    """Room for every request at once, buckets up to it (peer_hf.py's steps of 1.5x)."""
    from peer_hf import row_buckets_x15

    longest = max(map(len, prompts)) + args.max_tokens
    seqs = args.max_num_seqs or len(prompts)
    return dict(dtype=args.dtype, max_num_seqs=seqs, row_buckets=row_buckets_x15(seqs),
                max_model_len=-(-longest // 64) * 64, max_num_batched_tokens=1024,
                enable_prompt_logprobs=False)


def common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--modes", nargs="+", default=[ALL, ONE], choices=[ALL, ONE])
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="jaxserve (default: --num-prompts, every request at once)")
    parser.add_argument("--omp-wait-policy", default="PASSIVE",
                        help="the peer's OMP_WAIT_POLICY ('' leaves OpenMP's default, ACTIVE)")
    parser.add_argument("--output-json", type=Path)


def finish(args, rows: list[dict], header: dict) -> None:
    print_table(rows, args.max_tokens)
    if args.output_json:
        args.output_json.write_text(json.dumps(header | {"rows": rows}, indent=1))


# -- llama.cpp's side (its venv: llama_cpp and numpy only) -----------------------------------------

def llamacpp_side(request: dict) -> list[dict]:
    start = time.perf_counter()
    import llama_cpp

    prompts, max_tokens, threads = request["prompts"], request["max_tokens"], request["threads"]
    per_sequence = -(-(max(map(len, prompts)) + max_tokens) // 64) * 64
    llm = llama_cpp.Llama(request["model"], n_ctx=per_sequence, n_batch=request["n_batch"],
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    _one_at_a_time(llm, prompts[:1], 4)  # warm-up
    llm.reset()
    startup = time.perf_counter() - start
    version = f"llama-cpp-python {llama_cpp.__version__}, n_threads {threads}"
    rows = []
    for mode in request["modes"]:
        if mode == ONE:
            llm.reset()  # no prefix of an earlier mode's last request is reused
            load = os.getloadavg()[0]
            elapsed, ids, ttft = _one_at_a_time(llm, prompts, max_tokens)
            rows.append(row("llama.cpp", ONE, f"Llama.generate, {version}",
                            startup, elapsed, ids, ttft, load))
        else:
            began = time.perf_counter()
            batched = Batched(llm._model.model, len(prompts), per_sequence, request["n_batch"],
                              threads)
            batched.run(prompts[:2], 4)  # warm-up
            ready = time.perf_counter() - began
            load = os.getloadavg()[0]
            elapsed, ids, ttft = batched.run(prompts, max_tokens)
            batched.close()
            rows.append(row("llama.cpp", ALL, f"llama_batch of {len(prompts)} sequences, "
                            f"n_batch {request['n_batch']}, {version}", startup + ready,
                            elapsed, ids, ttft, load))
    return rows


def _one_at_a_time(llm, prompts: list[list[int]], max_tokens: int):
    """Llama.generate per prompt, greedy (temp 0: its greedy sampler; repeat_penalty 1: none)."""
    ids, ttft = [], []
    began = time.perf_counter()
    for prompt in prompts:
        start, out = time.perf_counter(), []
        for token in llm.generate(prompt, temp=0.0, repeat_penalty=1.0):
            if not out:
                ttft.append(time.perf_counter() - start)
            out.append(int(token))
            if len(out) == max_tokens:
                break
        ids.append(out)
    return time.perf_counter() - began, ids, ttft


class Batched:
    """llama.cpp's batched decoding through its C API: one context of `sequences` sequences,
    each its own `per_sequence` tokens of KV (kv_unified off, as llama.h advises for sequences
    that share no long prefix); every token greedy, the argmax of its logits."""

    def __init__(self, model, sequences: int, per_sequence: int, n_batch: int, threads: int):
        import llama_cpp

        self.lib = llama_cpp
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_seq_max = sequences * per_sequence, sequences
        params.kv_unified = False
        params.n_batch = params.n_ubatch = n_batch
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed ({sequences} sequences)")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.n_batch = n_batch
        self.batch = llama_cpp.llama_batch_init(max(n_batch, sequences), 0, 1)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """One llama_decode of (token, position, sequence, wants logits) entries: each wanting
        sequence's greedy next token."""
        import numpy as np

        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        if (rc := self.lib.llama_decode(self.ctx, b)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return {e[2]: int(np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i),
                                                 shape=(self.n_vocab,)).argmax())
                for i, e in enumerate(entries) if e[3]}

    def run(self, prompts: list[list[int]], max_tokens: int):
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        ids: list[list[int]] = [[] for _ in prompts]
        ttft = [0.0] * len(prompts)
        began = time.perf_counter()
        entries = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts)
                   for pos, t in enumerate(p)]
        for i in range(0, len(entries), self.n_batch):  # the prompts, n_batch tokens a call
            for seq, token in self.decode(entries[i:i + self.n_batch]).items():
                ids[seq].append(token)
                ttft[seq] = time.perf_counter() - began
        for step in range(1, max_tokens):  # then one token of every sequence a call
            got = self.decode([(ids[s][-1], len(p) + step - 1, s, True)
                               for s, p in enumerate(prompts)])
            for seq, token in got.items():
                ids[seq].append(token)
        return time.perf_counter() - began, ids, ttft

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


# -- the run -------------------------------------------------------------------------------------

def main() -> None:
    if sys.argv[1:2] == ["--peer-side"]:  # under the peer's python: no jaxserve here
        leave_bench_path()
        request = json.loads(Path(sys.argv[2]).read_text())
        Path(sys.argv[3]).write_text(json.dumps(llamacpp_side(request)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(parser)
    parser.add_argument("--peer-python",
                        default=os.path.expanduser(f"{PEERS}/llamacpp/bin/python"),
                        help="the python of the venv with llama-cpp-python")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's n_threads")
    parser.add_argument("--n-batch", type=int, default=512, help="llama.cpp's n_batch")
    parser.add_argument("--dtype", default="float32", help="jaxserve's activations")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from jaxserve.tools.fetch import fetch_smollm2

    gguf = fetch_smollm2()
    prompts = chat_prompt_ids(gguf, args.num_prompts)
    print(f"{gguf.name}: {len(prompts)} chat prompts, {sum(map(len, prompts))} tokens "
          f"({min(map(len, prompts))}-{max(map(len, prompts))} each), {args.max_tokens} output "
          f"tokens each; {os.cpu_count()} CPUs", flush=True)
    rows = exchange(args.peer_python, Path(__file__).resolve(),
                    {"model": str(gguf), "prompts": prompts, "max_tokens": args.max_tokens,
                     "threads": args.threads, "n_batch": args.n_batch, "modes": args.modes},
                    args.omp_wait_policy)
    rows = jaxserve_rows(str(gguf), prompts, args.max_tokens, args.modes,
                         jaxserve_options(args, prompts)) + rows
    finish(args, rows, {"model": str(gguf), "prompts": prompts})


if __name__ == "__main__":
    main()
