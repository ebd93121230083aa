"""Speculative decoding by prompt lookup (`ngram`) and by the demo's draft model (`draft`)
against none, on the demo model, one run.

    python bench/speculative.py                      # both workloads at batch 1, 8 and 32
    python bench/speculative.py --batches 1 8 --requests-scale 0.25 --json

Workloads (greedy, every request submitted at the start, `batch` of them at a time):

    code_edit  a small standard-library function (`inspect.getsource`, its docstring dropped so
               prompt and output fit the model's context), then "# The same function,
               renamed to new_<name>:" and the renamed def line; max_tokens is the body's length
               (at most --output-len), so a model that copies the body can be guessed from the
               prompt
    free       short English sentences to continue: nothing in the prompt to copy (though a
               small model's greedy text repeats itself, which prompt lookup also finds);
               max_tokens --output-len

Each batch size is one max_num_seqs, with 8 requests at batch 1, 4 per slot up to 8 and 2 per
slot above (times --requests-scale). Each (method, batch) is one `LLM`, built once and warmed up
by one generate call (both workloads' prompts, a few tokens); a batch's two LLMs then take turns,
run by run, each run's prefix cache emptied first, and a row is its best of --repeats runs. Per
row: output tokens/s, the speed-up over none at the same workload and batch, the acceptance rate
(accepted / proposed tokens), the mean acceptance length (1 + accepted / drafts: the tokens one
verification yields, vLLM's), engine steps, the weight bytes those steps read per second, and
whether the greedy ids equal none's. Above --disable-by-batch-size running requests speculation
is off (at batch 32 by default it only runs in a run's tail, once few requests are left).

What the demo model does: it does not copy the function it was shown; it starts a docstring and
falls into loops ("the string to the string"), in both workloads. Prompt lookup finds those
loops, so the acceptance here is the model repeating itself, more in free's longer outputs.

Lookup defaults (n from 2 to 4): a token is a byte, so a 1-byte n-gram matches nearly anywhere
and a draft is proposed almost every step, most of it wrong (about 30% of the proposed tokens
kept, against 50% at n >= 2 and 65% at n >= 3). A row with no proposal decodes as usual, but a
verification of k + 1 tokens costs about twice a one-token step on this CPU (the demo's
weights sit in cache: its steps are bound by compute, not bytes), so n >= 2 (fewer, better
proposals) did best on both workloads at batch 1: 1.04x and 1.90x, against 0.99x and 1.84x at
1..3 and 1.03x and 1.77x at 3..5.

The draft (`--draft-k` tokens, default 3) is the demo's shipped draft model
(jaxserve/demo/draft, 131K parameters against the demo's 3.3M).
"""

import argparse
import ast
import importlib
import inspect
import json
import random
import sys
import time

from jaxserve.llm import LLM
from jaxserve.request import SamplingParams

# modules whose small top-level functions make the code_edit prompts (a frozen module, such as
# posixpath on Python 3.11, has no source to read: skipped)
MODULES = ("textwrap", "posixpath", "json.encoder", "string", "shlex", "fnmatch", "colorsys",
           "calendar", "glob", "copy", "quopri", "html", "email.utils", "email.quoprimime",
           "urllib.parse", "base64", "locale", "gettext", "difflib", "pprint", "shutil",
           "tempfile", "re", "uuid", "tokenize", "mimetypes")
MIN_OUTPUT = 32  # a function leaving less room than this for its body is skipped
HEADER = "\n# The same function, renamed to {name}:\n"
SENTENCES = (
    "The weather this morning was", "She opened the door and saw", "In the year two thousand,",
    "My favourite thing about summer is", "The old man walked slowly towards",
    "Once upon a time there lived", "The best way to learn a language is",
    "After the long meeting, everyone", "The river ran past the village and",
    "When I was a child, I wanted to", "The city at night looks like", "He said that the train",
    "Nobody knew why the lights", "The recipe calls for two cups of", "On the first day of school,",
    "The museum was quiet except for")
METHODS = ("none", "ngram", "draft")
COLUMNS = ("workload", "method", "batch", "requests", "out tokens", "tok/s", "speed-up",
           "accept", "mean len", "steps", "weight GB/s", "same ids")


def without_docstring(source: str) -> str:
    """The function's source with its docstring's lines removed."""
    function = ast.parse(source).body[0]
    if ast.get_docstring(function) is None or len(function.body) == 1:
        return source
    doc = function.body[0]
    lines = source.splitlines(keepends=True)
    return "".join(lines[:doc.lineno - 1] + lines[doc.end_lineno:])


def code_edit_prompts(tokenizer, max_model_len: int, output_len: int) -> list[tuple[str, int]]:
    """(prompt, max_tokens) per small stdlib function: its source, HEADER, and its def line
    renamed; max_tokens the body's length (what to repeat), at most output_len and what
    max_model_len leaves, and at least MIN_OUTPUT."""
    prompts = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, function in sorted(vars(module).items()):
            if not inspect.isfunction(function) or function.__module__ != module.__name__:
                continue
            try:
                source = inspect.getsource(function)
            except OSError:
                continue
            if not source.startswith("def "):  # decorated, or nested in a class
                continue
            source = without_docstring(source)
            body_start = ast.parse(source).body[0].body[0].lineno - 1
            lines = source.splitlines(keepends=True)
            new_name = "new_" + name.strip("_")
            signature = "".join(lines[:body_start]).replace(f"def {name}(", f"def {new_name}(", 1)
            prompt = source + HEADER.format(name=new_name) + signature
            body = len(tokenizer.encode("".join(lines[body_start:]))) - 1  # less BOS
            max_tokens = min(body, output_len, max_model_len - len(tokenizer.encode(prompt)))
            if max_tokens >= min(MIN_OUTPUT, output_len):
                prompts.append((prompt, max_tokens))
    return prompts


def num_requests(batch: int, scale: float) -> int:
    """8 at batch 1, 4 per slot up to 8 slots, 2 per slot above; scaled, at least 1."""
    n = max(8, 4 * batch) if batch <= 8 else 2 * batch
    return max(1, round(n * scale))


def cycle(items: list, n: int) -> list:
    return [items[i % len(items)] for i in range(n)]


def timed(llm: LLM, prompts: list[tuple[str, int]]) -> dict:
    """Generate the prompts greedily; the run's figures and the token ids."""
    params = [SamplingParams(max_tokens=m, temperature=0.0) for _, m in prompts]
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in prompts], params, use_tqdm=False)
    duration = time.perf_counter() - start
    after = llm.stats()
    delta = {k: after[k] - before[k] for k in (
        "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens", "num_steps", "num_compilations_after_warmup")}
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    tokens = sum(map(len, ids))
    drafts, proposed = delta["spec_decode_num_drafts"], delta["spec_decode_num_draft_tokens"]
    accepted = delta["spec_decode_num_accepted_tokens"]
    per_pos = [a - b for a, b in zip(after["spec_decode_num_accepted_tokens_per_pos"],
                                     before["spec_decode_num_accepted_tokens_per_pos"],
                                     strict=False)]
    weight_bytes = llm.engine.runner.weight_bytes
    return {"requests": len(prompts), "output_tokens": tokens, "duration_s": duration,
            "output_tokens_per_s": tokens / duration,
            "acceptance_rate": accepted / proposed if proposed else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
            "accepted_per_position": per_pos, "steps": delta["num_steps"],
            "weight_gb_per_s": delta["num_steps"] * weight_bytes / duration / 1e9,
            "compilations": delta["num_compilations_after_warmup"], "token_ids": ids}


def speculative_config(args, method: str) -> dict | None:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": args.k,
                "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max,
                "disable_by_batch_size": args.disable_by_batch_size}
    if method == "draft":
        return {"method": "draft_model", "model": args.draft_model,
                "num_speculative_tokens": args.draft_k,
                "disable_by_batch_size": args.disable_by_batch_size}
    return None


def workloads_of(llm: LLM, args) -> dict[str, list[tuple[str, int]]]:
    engine = llm.engine
    code = code_edit_prompts(engine.tokenizer, engine.max_model_len, args.output_len)
    random.Random(args.seed).shuffle(code)  # every batch's share mixes the modules
    print(f"code_edit: {len(code)} stdlib functions", file=sys.stderr)
    return {"code_edit": code, "free": [(s, args.output_len) for s in SENTENCES]}


def run(args) -> list[dict]:
    """Every batch, both methods, both workloads; the rows in table order. A batch's two LLMs
    take turns, run by run, so a busy moment of the machine falls on both; each row is its
    best of --repeats runs."""
    rows, workloads = [], None
    for batch in args.batches:
        n = num_requests(batch, args.requests_scale)
        llms = {}
        for method in args.methods:
            start = time.perf_counter()
            llms[method] = llm = LLM(args.model, max_num_seqs=batch, seed=args.seed,
                                     speculative_config=speculative_config(args, method))
            workloads = workloads or workloads_of(llm, args)
            warm = [p for w in workloads.values() for p, _ in w[:batch]]
            llm.generate(warm, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
            print(f"batch {batch} {method}: built and warmed up in "
                  f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        best = {}
        for _ in range(args.repeats):
            for workload, prompts in workloads.items():
                for method, llm in llms.items():
                    llm.reset_prefix_cache()  # every run computes its prompts
                    result = timed(llm, cycle(prompts, n))
                    kept = best.get((workload, method))
                    if kept is None or result["output_tokens_per_s"] > kept["output_tokens_per_s"]:
                        best[workload, method] = result
        for workload in workloads:
            none = best[workload, "none"]
            for method in args.methods:
                result = best[workload, method]
                same = None if method == "none" else result["token_ids"] == none["token_ids"]
                rows.append({"workload": workload, "method": method, "batch": batch} | result
                            | {"speed_up": result["output_tokens_per_s"]
                               / none["output_tokens_per_s"], "same_ids": same})
        del llms
    for row in rows:
        del row["token_ids"]
    rows.sort(key=lambda r: list(workloads).index(r["workload"]))  # stable: batch, method
    return rows


def table(rows: list[dict]) -> str:
    def show(value, form: str) -> str:
        return "-" if value is None else format(value, form)

    lines = [COLUMNS]
    for r in rows:
        same = None if r["same_ids"] is None else ("yes" if r["same_ids"] else "NO")
        lines.append((r["workload"], r["method"], str(r["batch"]), str(r["requests"]),
                      str(r["output_tokens"]), f"{r['output_tokens_per_s']:.1f}",
                      f"{r['speed_up']:.2f}x", show(r["acceptance_rate"], ".1%"),
                      show(r["mean_acceptance_length"], ".2f"), str(r["steps"]),
                      f"{r['weight_gb_per_s']:.2f}", show(same, "")))
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(line, widths, strict=True)))
                     for line in lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--draft-k", type=int, default=3, help="the draft's tokens a step")
    parser.add_argument("--draft-model", help="the draft's directory (default: the demo's)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--disable-by-batch-size", type=int, default=8,
                        help="speculation off above this many running requests; 0: never off")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-scale", type=float, default=1.0,
                        help="scale the requests per batch size (at least 1 each)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="max_tokens of free; the cap on code_edit's")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each row; the best")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="the table as JSON")
    args = parser.parse_args(argv)
    args.disable_by_batch_size = args.disable_by_batch_size or None
    if "none" not in args.methods:
        parser.error("--methods must include none (the speed-ups are against it)")
    rows = run(args)
    if args.json:
        print(json.dumps({"model": args.model, "speculative_config": {
            m: speculative_config(args, m) for m in args.methods}, "rows": rows}, indent=2))
    else:
        print(f"{args.model}, ngram k={args.k} lookup {args.lookup_min}..{args.lookup_max}, "
              f"draft k={args.draft_k} {args.draft_model or 'the demo draft'}, "
              f"off above {args.disable_by_batch_size} running, greedy")
        print(table(rows))
    return rows


if __name__ == "__main__":
    main()
