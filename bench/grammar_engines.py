"""Structured output's grammar engines, xgrammar and llguidance, on jaxserve's tokenizers (issue 32).

    python bench/grammar_engines.py                        # all engines x tokenizers, ~10 s
    python bench/grammar_engines.py --tokenizers bpe --bpe-vocab 32768   # a bigger BPE (~15 s)
    python bench/grammar_engines.py --engines llguidance --tokenizers stories --json out.json

llguidance is measured through jaxserve's own adapter, jaxserve/structured/grammar.py (the code
the engine runs); xgrammar through an adapter here that makes the calls jaxserve would. Needs
`pip install xgrammar jsonschema` (xgrammar pulls in torch and transformers: it imports both);
without xgrammar, llguidance (a jaxserve dependency) is measured alone.

The tokenizers (demo, stories, bpe) and grammars are bench/grammar_workloads.py's. For each
engine x tokenizer it measures the tokenizer info's build time (llguidance: jaxserve's
GrammarCompiler, its warm-up mask included), then for each grammar:
  compile   grammar source -> a matcher's ready state, with the cache cleared (median of --reps),
            and `hit`: the same call answered by the cache; `matcher`: a fresh matcher for one
            request. xgrammar: GrammarCompiler.compile_*, GrammarMatcher(compiled). llguidance:
            GrammarCompiler.compile(StructuredOutputsParams), which builds the parser (its lexer
            is built lazily, during the masks: see `first`), and .matcher(compiled), a copy.
  walk      a seeded random walk: at each step fill the int32 bitmask (ceil(V/32) words, in
            place), pick a random allowed token, accept it; after --soft-steps it steers to an
            end (EOS when allowed, else a closing token) and stops at --max-steps. `first` is the
            first mask's time, `mask` the mean and p99 of the others, `accept` the mean time to
            advance by one token; all in microseconds.
  check     the walk's text (the tokens' bytes as jaxserve's `token_bytes` gives them) must
            parse as JSON and validate against the schema (jsonschema), fully match the regex,
            be one of the choices, or parse as the arithmetic grammar; "replay": the matcher
            accepts a known valid text's tokens (greedy longest-match tokenization) with each
            token allowed by the mask before it, and then EOS; "rollback": rolling back 5
            tokens and accepting them again works.

Prints a table and, last, the whole result as one JSON line (or to --json).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizers' trainer, llguidance: one core
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # jaxserve, from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # grammar_workloads, from anywhere

from grammar_workloads import (
    GRAMMARS,
    canonical_tokenize,
    check_text,
    example_text,
    grammar_spec,
    greedy_tokenize,
    load_tokenizers,
    special_ids,
)

from jaxserve.request import StructuredOutputsParams
from jaxserve.structured.bitmask import bitmask_width
from jaxserve.text.tokenizer import ByteTokenizer

# ---------------------------------------------------------------------------------------------
# Engines: one adapter each, the calls jaxserve would make


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, threads: int):
        import xgrammar as xgr
        self.xgr, self.threads = xgr, threads

    @staticmethod
    def version() -> str:
        return importlib.metadata.version("xgrammar")

    def build_info(self, tok) -> None:
        """TokenizerInfo from the vocabulary (no transformers wrapper). Workaround: xgrammar
        takes a special token's text ("<unk>", "<s>") as text and would allow it inside a JSON
        string; an empty string makes it special (never allowed). EOS ids are its stop tokens."""
        xgr = self.xgr
        specials = special_ids(tok)
        if isinstance(tok, ByteTokenizer):
            vocab = [bytes([i]) for i in range(tok.NUM_BYTES)] + [b""] * (
                tok.vocab_size - tok.NUM_BYTES)
            vocab_type, prefix_space = xgr.VocabType.RAW, False
        else:
            hf = tok._tk
            vocab = [""] * tok.vocab_size
            for piece, i in hf.get_vocab(with_added_tokens=True).items():
                if i < tok.vocab_size and i not in specials:
                    vocab[i] = piece
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(hf.to_str())
            vocab_type, prefix_space = meta["vocab_type"], meta["add_prefix_space"]
        self.info = xgr.TokenizerInfo(vocab, vocab_type, vocab_size=tok.vocab_size,
                                      stop_token_ids=sorted(tok.eos_token_ids),
                                      add_prefix_space=prefix_space)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=self.threads,
                                            cache_enabled=True)
        self.vocab_type = vocab_type.name

    def compile(self, kind: str, source, cached: bool = False):
        if not cached:
            self.compiler.clear_cache()
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(json.dumps(source), any_whitespace=True)
        if kind == "regex":
            return c.compile_regex(source)
        if kind == "choice":  # as vLLM's xgrammar backend writes a choice
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in source))
        return c.compile_grammar(source)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    @staticmethod
    def fill(m, bitmask) -> None:
        m.fill_next_token_bitmask(bitmask, 0)  # DLPack: a numpy int32 (1, ceil(V/32)) array

    @staticmethod
    def accept(m, token: int) -> bool:
        return m.accept_token(token)

    @staticmethod
    def finished(m) -> bool:
        return m.is_terminated()

    @staticmethod
    def rollback(m, n: int) -> None:
        m.rollback(n)

    @staticmethod
    def error(m) -> str:
        return ""


class LLGuidanceEngine:
    """jaxserve's own llguidance adapter (jaxserve/structured/grammar.py), called as the engine
    calls it."""

    name = "llguidance"

    def __init__(self, threads: int):  # --threads is xgrammar's: jaxserve compiles in place
        from jaxserve.structured.grammar import GrammarCompiler  # timed as the import
        self.compiler_class = GrammarCompiler

    @staticmethod
    def version() -> str:
        return importlib.metadata.version("llguidance")

    def build_info(self, tok) -> None:
        """jaxserve's GrammarCompiler: an LLTokenizer from the token bytes (the byte tokenizer)
        or tokenizer.json's text, and the first mask that builds llguidance's lazy tables."""
        self.compiler = self.compiler_class(tok, tok.vocab_size, tok.eos_token_ids)
        self.vocab_type = "token bytes" if isinstance(tok, ByteTokenizer) else "tokenizer.json"

    def compile(self, kind: str, source, cached: bool = False):
        if not cached:
            self.compiler._cache.clear()  # time the build, not the cache
        field = "grammar" if kind == "ebnf" else kind  # json, regex, choice: the same names
        return self.compiler.compile(StructuredOutputsParams(**{field: source}))

    def matcher(self, compiled):
        return self.compiler.matcher(compiled)

    @staticmethod
    def fill(m, bitmask) -> None:
        m.fill(bitmask[0])

    @staticmethod
    def accept(m, token: int) -> bool:
        return m.accept((token,))

    @staticmethod
    def finished(m) -> bool:
        return m.is_terminated

    @staticmethod
    def rollback(m, n: int) -> None:
        m.rollback(n)

    @staticmethod
    def error(m) -> str:
        return m.error or ""


ENGINES = {"xgrammar": XGrammarEngine, "llguidance": LLGuidanceEngine}


# ---------------------------------------------------------------------------------------------
# Measurements


def _ms(t0: int) -> float:
    return (time.perf_counter_ns() - t0) / 1e6


# steering to an end: a quote closes a string (or opens a short one that closes next), then
# brackets close what is open, then a digit ends a number
CLOSERS = [b'"', b"}", b"]", b")", b"0", b"1", b"5"]


def walk(engine, compiled, tok, name: str, rng: random.Random, soft: int, hard: int) -> dict:
    """A seeded random walk through the grammar; masks and accepts timed."""
    from jaxserve.structured.grammar import allowed as unpack_row
    vocab, eos = tok.vocab_size, sorted(tok.eos_token_ids)
    eos_set = set(eos)
    closer_ids = {}
    for i in range(vocab):
        b = tok.token_bytes(i)
        if b in CLOSERS and i not in special_ids(tok):
            closer_ids.setdefault(b, i)
    blank = np.array([i not in eos_set and not tok.token_bytes(i).strip()
                      for i in range(vocab)])
    bitmask = np.full((1, bitmask_width(vocab)), -1, dtype=np.int32)
    m = engine.matcher(compiled)
    masks, accepts, tokens, sizes = [], [], [], []
    status = "max steps"
    for step in range(hard):
        t0 = time.perf_counter_ns()
        engine.fill(m, bitmask)
        masks.append(time.perf_counter_ns() - t0)
        allowed = np.flatnonzero(unpack_row(bitmask[0], vocab))
        sizes.append(len(allowed))
        if len(allowed) == 0:
            status = "empty mask"
            break
        allowed_set = set(allowed.tolist())
        choice = None
        if step >= soft:  # steer to an end
            if eos_set & allowed_set:
                choice = min(eos_set & allowed_set)
            else:
                for b in CLOSERS:
                    if closer_ids.get(b) in allowed_set:
                        choice = closer_ids[b]
                        break
        if choice is None:
            # as a model would: whitespace-only tokens rarely (JSON's whitespace is unbounded)
            pool = allowed[~blank[allowed]]
            if len(pool) == 0 or rng.random() < 0.05:
                pool = allowed
            choice = int(pool[rng.randrange(len(pool))])
        t0 = time.perf_counter_ns()
        ok = engine.accept(m, choice)
        accepts.append(time.perf_counter_ns() - t0)
        if not ok:
            status = f"rejected an allowed token {choice}: {engine.error(m)[:200]}"
            break
        tokens.append(choice)
        if choice in eos_set:
            status = "eos"
            break
    finished = status == "eos" and engine.finished(m)
    text = b"".join(tok.token_bytes(t) for t in tokens if t not in eos_set)
    check = check_text(name, text) if finished else status
    rollback = rollback_eos = "n/a"
    if finished and len(tokens) > 5:
        rollback = rollback_check(engine, compiled, tokens[:-1], 5, 5, tokens[-1])
        # undo 5 tokens, the final EOS among them, and accept them again
        rollback_eos = rollback_check(engine, compiled, tokens, 5, 5)
        if rollback_eos != "ok" and rollback_check(engine, compiled, tokens, 4, 5) == "ok":
            rollback_eos = "EOS not counted"  # rollback(n) after EOS undoes EOS and n tokens
    us = [x / 1000 for x in masks]
    rest = us[1:] or us
    return {
        "steps": len(tokens), "finished": finished, "check": check, "rollback": rollback,
        "rollback_eos": rollback_eos,
        "text": text.decode("utf-8", "replace")[:300],
        "first_mask_us": round(us[0], 1),
        "mask_mean_us": round(statistics.fmean(rest), 1),
        "mask_p50_us": round(statistics.median(rest), 1),
        "mask_p99_us": round(float(np.percentile(rest, 99)), 1),
        "mask_max_us": round(max(rest), 1),
        "accept_mean_us": round(statistics.fmean(accepts) / 1000, 1) if accepts else None,
        "allowed_mean": round(statistics.fmean(sizes), 1),
    }


def rollback_check(engine, compiled, tokens: list[int], undo: int, redo: int,
                   eos: int | None = None) -> str:
    """On a fresh matcher: accept `tokens`, roll back `undo`, accept the last `redo` of them
    again (then `eos`, when given); the matcher must end finished."""
    m = engine.matcher(compiled)
    try:
        ok = all(engine.accept(m, t) for t in tokens)
        engine.rollback(m, undo)
        ok = ok and all(engine.accept(m, t) for t in tokens[-redo:])
        if eos is not None:
            ok = ok and engine.accept(m, eos)
        return "ok" if ok and engine.finished(m) else f"failed: {engine.error(m)[:100]}"
    except Exception as e:
        return f"failed: {e}"[:120]


def replay(engine, compiled, tok, name: str, canonical: bool = True) -> dict:
    """The tokens of a known valid text, each checked against the mask before it, then EOS.
    `canonical`: the tokenizer's own tokenization, else a longest-match one."""
    vocab, eos = tok.vocab_size, min(tok.eos_token_ids)
    data = example_text(name).encode()
    ids = canonical_tokenize(tok, data) if canonical else greedy_tokenize(tok, data)
    if ids is None:
        return {"check": "no canonical tokenization found"}
    ids = [*ids, eos]
    bitmask = np.full((1, bitmask_width(vocab)), -1, dtype=np.int32)
    m = engine.matcher(compiled)
    masks = []
    for n, t in enumerate(ids):
        t0 = time.perf_counter_ns()
        engine.fill(m, bitmask)
        masks.append(time.perf_counter_ns() - t0)
        if not (bitmask[0, t // 32] >> (t % 32)) & 1:
            return {"check": f"token {n} ({tok.token_bytes(t)!r}) masked out", "tokens": len(ids)}
        if not engine.accept(m, t):
            return {"check": f"token {n} rejected: {engine.error(m)[:200]}", "tokens": len(ids)}
    ok = engine.finished(m)
    return {"check": "ok" if ok else "not finished after EOS", "tokens": len(ids),
            "mask_mean_us": round(statistics.fmean(masks[1:]) / 1000, 1)}


def median_ms(fn, reps: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        out = fn()
        times.append(_ms(t0))
    return statistics.median(times), out


def bench_engine(engine, tok_name: str, tok, args) -> dict:
    t_info, _ = median_ms(lambda: engine.build_info(tok), args.reps)
    engine.compile("json", {"type": "string"})  # warm up the engine's first-call costs
    result = {"engine": engine.name, "tokenizer": tok_name, "vocab": tok.vocab_size,
              "vocab_type": engine.vocab_type, "info_ms": round(t_info, 2), "grammars": {}}
    for gi, name in enumerate(GRAMMARS):
        kind, source = grammar_spec(name)
        row: dict = {}
        try:
            t_compile, compiled = median_ms(lambda k=kind, s=source: engine.compile(k, s), args.reps)
        except Exception as e:
            result["grammars"][name] = {"error": f"compile: {e}"[:300]}
            continue
        row["compile_ms"] = round(t_compile, 3)
        t_hit, compiled = median_ms(lambda k=kind, s=source: engine.compile(k, s, cached=True),
                                    args.reps)
        row["cache_hit_ms"] = round(t_hit, 4)
        t_matcher, _ = median_ms(lambda c=compiled: engine.matcher(c), args.reps)
        row["matcher_ms"] = round(t_matcher, 4)
        rng = random.Random(args.seed * 1000 + gi)
        row["walk"] = walk(engine, compiled, tok, name, rng, args.soft_steps, args.max_steps)
        row["replay"] = replay(engine, compiled, tok, name)
        row["replay_noncanonical"] = replay(engine, compiled, tok, name, canonical=False)
        result["grammars"][name] = row
    return result


# ---------------------------------------------------------------------------------------------


def print_table(results: list[dict]) -> None:
    head = (f"{'engine':10} {'tokenizer':9} {'V':>5} {'grammar':11} {'compile':>8} {'hit':>6} "
            f"{'first':>7} {'mask':>7} {'p99':>7} {'max':>7} {'accept':>6} {'steps':>5}  walk / replay / non-canonical")
    print(head)
    print(f"{'':10} {'':9} {'':>5} {'':11} {'ms':>8} {'ms':>6} {'us':>7} {'us':>7} {'us':>7} "
          f"{'us':>7} {'us':>6}")
    print("-" * len(head))
    for r in results:
        print(f"{r['engine']:10} {r['tokenizer']:9} {r['vocab']:>5} {'(info)':11} "
              f"{r['info_ms']:>8.2f}   tokenizer info ({r['vocab_type']})")
        for name, g in r["grammars"].items():
            if "error" in g:
                print(f"{'':10} {'':9} {'':>5} {name:11} {g['error']}")
                continue
            w = g["walk"]
            hit = f"{g['cache_hit_ms']:.3f}" if "cache_hit_ms" in g else "-"
            notes = w["check"] if w["check"] == "ok" else f"[{w['check'][:40]}]"
            notes += " / " + ("ok" if g["replay"]["check"] == "ok"
                              else f"[{g['replay']['check'][:40]}]")
            notes += " / " + ("ok" if g["replay_noncanonical"]["check"] == "ok" else "masked")
            for key in ("rollback", "rollback_eos"):
                if w[key] not in ("ok", "n/a"):
                    notes += f"; {key}: {w[key][:40]}"
            print(f"{'':10} {'':9} {'':>5} {name:11} {g['compile_ms']:>8.2f} {hit:>6} "
                  f"{w['first_mask_us']:>7.1f} {w['mask_mean_us']:>7.1f} {w['mask_p99_us']:>7.1f} {w['mask_max_us']:>7.1f} "
                  f"{w['accept_mean_us']:>6.1f} {w['steps']:>5}  {notes}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="xgrammar,llguidance")
    ap.add_argument("--tokenizers", default="demo,stories,bpe")
    ap.add_argument("--bpe-vocab", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3, help="compile timings: median of this many")
    ap.add_argument("--soft-steps", type=int, default=150, help="walk: steer to an end after")
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="xgrammar's compiler threads (the machine has 2 cores)")
    ap.add_argument("--json", help="write the results here instead of printing the JSON line")
    args = ap.parse_args(argv)

    engines = []
    for name in args.engines.split(","):
        t0 = time.perf_counter_ns()
        try:
            engine = ENGINES[name](args.threads)
        except ImportError as e:
            print(f"skipping {name}: {e}", file=sys.stderr)
            continue
        engines.append((engine, _ms(t0)))
    toks = load_tokenizers(args.tokenizers.split(","), args.bpe_vocab)

    results = [bench_engine(engine, tname, tok, args)
               for engine, _ in engines for tname, tok in toks.items()]
    meta = {"versions": {e.name: e.version() for e, _ in engines},
            "import_ms": {e.name: round(t, 1) for e, t in engines},
            "python": sys.version.split()[0], "xgrammar_threads": args.threads,
            "seed": args.seed}
    print(f"versions {meta['versions']}; import ms {meta['import_ms']}")
    print_table(results)
    out = {"meta": meta, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    else:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
