"""Throughput with 0%, 50% and 100% of requests constrained by a JSON schema, one engine, one run.

    python bench/structured_output.py                       # the demo model
    python bench/structured_output.py --model bench/models/llama-20m --load-format dummy

Workload: N requests, all submitted at once, `--max-num-seqs` at a time, greedy. A plain request
generates `--output-len` tokens (ignore_eos). A constrained one follows a JSON schema (an
application's one schema; `--distinct-schemas`: one of its own per request, each a new grammar
whose lexer starts cold): an object with one string of exactly `--output-len` - 12
characters, without flexible whitespace, so it ends (EOS) after about as many tokens as a
plain one. Throughput is output tokens per second over the run; each constrained output is
checked to parse and validate (jsonschema). Printed: the three runs side by side, 50% and 100%
against 0%, and the grammar compile time per new schema (of the distinct schemas the runs
compiled, or of 100 varied ones compiled apart).
"""

import argparse
import json
import statistics
import time

import jsonschema

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.request import SamplingParams, StructuredOutputsParams

PROMPT = "Write the record as JSON: "


def schema(i: int, length: int) -> dict:
    return {"type": "object", "properties": {f"field_{i}": {
        "type": "string", "minLength": length, "maxLength": length, "pattern": "^[a-z ]*$"}},
        "required": [f"field_{i}"], "additionalProperties": False}


def varied_schemas(n: int) -> list[dict]:
    """n different schemas: nested objects, arrays, enums, ranges and patterns."""
    out = []
    for i in range(n):
        item = [{"type": "integer", "minimum": i, "maximum": i + 100},
                {"enum": ["red", "green", f"c{i}"]},
                {"type": "string", "pattern": f"^[a-z]{{1,{2 + i % 7}}}$"},
                {"type": "array", "items": {"type": "number"}, "maxItems": 1 + i % 4}][i % 4]
        out.append({"type": "object", "properties": {
            f"k{i}": item, "nested": {"type": "object", "properties": {
                "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {
                    "type": "string", "maxLength": 8}, "maxItems": 3}},
                "required": ["ok"]}}, "required": [f"k{i}", "nested"]})
    return out


def run(engine: LLMEngine, n: int, fraction: float, output_len: int, offset: int,
        distinct: bool = False) -> dict:
    """Generate n requests, round(n * fraction) of them constrained; the figures."""
    constrained = set(range(0, n, round(1 / fraction)) if fraction else ()) if fraction < 1 \
        else set(range(n))
    schemas, compile_seconds = {}, []
    start = time.perf_counter()
    for i in range(n):
        if i in constrained:
            schemas[i] = schema(offset + i if distinct else 0, max(1, output_len - 12))
            structured = StructuredOutputsParams(json=schemas[i], disable_any_whitespace=True)
            compile_seconds.append(engine.grammars.compile(structured).compile_seconds)
            params = SamplingParams(max_tokens=output_len + 32, temperature=0.0,
                                    structured_outputs=structured)
        else:
            params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        engine.add_request(str(offset + i), PROMPT, params)
    added = time.perf_counter() - start
    texts, tokens = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[int(out.request_id) - offset] = out.outputs[0].text
                tokens += len(out.outputs[0].token_ids)
    duration = time.perf_counter() - start
    invalid = 0
    for i, sch in schemas.items():
        try:
            jsonschema.validate(json.loads(texts[i]), sch)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            invalid += 1
    return {"constrained": fraction, "requests": n, "output_tokens": tokens,
            "duration_s": duration, "output_tokens_per_s": tokens / duration,
            "add_seconds": added, "invalid_outputs": invalid, "compile_seconds": compile_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mix; the best")
    parser.add_argument("--distinct-schemas", action="store_true")
    args = parser.parse_args()
    engine = LLMEngine(args.model, EngineConfig(max_num_seqs=args.max_num_seqs,
                                                load_format=args.load_format))
    run(engine, args.max_num_seqs, 0.5, 16, offset=10**6)  # warm the grammar path
    results, offset = {}, 0
    for _ in range(args.repeats):
        for fraction in (0.0, 0.5, 1.0):
            r = run(engine, args.num_requests, fraction, args.output_len, offset,
                    args.distinct_schemas)
            offset += args.num_requests
            best = results.get(fraction)
            if best is None or r["output_tokens_per_s"] > best["output_tokens_per_s"]:
                results[fraction] = r
    times = [t for r in results.values() for t in r.pop("compile_seconds")]
    if not args.distinct_schemas:  # the runs' one schema compiled once: time varied ones
        times = [engine.grammars.compile(StructuredOutputsParams(json=s)).compile_seconds
                 for s in varied_schemas(100)]
    base = results[0.0]["output_tokens_per_s"]
    for r in results.values():
        r["vs_unconstrained"] = r["output_tokens_per_s"] / base
        print(json.dumps(r))
    print(json.dumps({"grammar_compile_ms_per_new_schema": {
        "median": 1e3 * statistics.median(times), "max": 1e3 * max(times),
        "schemas": len(times)} if times else None}))
    print(f"50% constrained: {results[0.5]['vs_unconstrained']:.2f}x of unconstrained "
          f"throughput (goal >= 0.8x); 100%: {results[1.0]['vs_unconstrained']:.2f}x")


if __name__ == "__main__":
    main()
