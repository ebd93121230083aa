"""What the benchmarks send: prompts (token ids or text) with the output length each asks for.

    random       vLLM's random dataset: lengths uniform in [len * (1 - r), len * (1 + r)]
    sharegpt     a synthetic ShareGPT-like mix: lognormal prompt and output lengths (long tails)
    batching     the engine issue's workload: prompts uniform in [32, 256] tokens, outputs
                 lognormal with median 48, capped at 256 (bench/batching.py, bench/peer_hf.py)
    prefix_repetition  vLLM's: `num_prefixes` shared prefixes of `prefix_len` tokens, each
                 request one of them (in turn) and a suffix of its own (input_len tokens)
    multiturn    chats that resend the whole conversation each turn: `turns` turns per chat,
                 each a user message of input_len tokens and (in the next turns' prompts) a
                 reply of output_len; the requests go turn by turn (every chat's first turn,
                 then every second turn, ...), so a turn comes after the one it extends
    FILE         JSON or JSONL: strings, {"prompt": text | ids, "output_len": n}, or ShareGPT
                 records ({"conversations": [{"from": "human", "value": ...}, {"from": "gpt"...}]};
                 as vLLM's sharegpt dataset, pairs with a prompt or reply under 4 tokens, a
                 prompt over 1024 or both over 2048 are skipped)

Synthetic prompts are random ids in [3, vocab_size): never the usual pad/bos/eos ids 0-2.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxserve.sim.workload import lengths

SYNTHETIC = ("random", "sharegpt", "batching", "prefix_repetition", "multiturn")
FIRST_ID = 3


@dataclass(frozen=True)
class Sample:
    """One request: its prompt (text or token ids) and how many tokens it asks for."""

    prompt: str | list[int]
    prompt_len: int  # tokens; for text without a tokenizer, an estimate (the server counts)
    output_len: int

    @property
    def engine_prompt(self) -> str | dict:
        """The prompt as `LLM.generate` / `LLMEngine.add_request` take it."""
        return self.prompt if isinstance(self.prompt, str) else {"prompt_token_ids": self.prompt}


def _ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    low = FIRST_ID if vocab_size > FIRST_ID else 0
    return rng.integers(low, vocab_size, size=int(n)).tolist()


def random_samples(n: int, input_len: int, output_len: int, range_ratio: float,
                   vocab_size: int, seed: int = 0) -> list[Sample]:
    """vLLM's random dataset: each length uniform in [len * (1 - r), len * (1 + r)]."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)

    def draw(length: int) -> np.ndarray:
        low = max(1, int(np.floor(length * (1 - range_ratio))))
        high = max(low, int(np.ceil(length * (1 + range_ratio))))
        return rng.integers(low, high + 1, size=n)

    prompt_lens, output_lens = draw(input_len), draw(output_len)
    return [Sample(_ids(rng, p, vocab_size), int(p), int(o))
            for p, o in zip(prompt_lens, output_lens, strict=True)]


def sharegpt_samples(n: int, input_len: int, output_len: int, vocab_size: int,
                     seed: int = 0) -> list[Sample]:
    """ShareGPT-like lengths: lognormal (sigma 0.8) with medians input_len and output_len."""
    rng = np.random.default_rng(seed)
    prompt_lens = lengths(n, rng, "lognormal", input_len, 0.8, low=4)
    output_lens = lengths(n, rng, "lognormal", output_len, 0.8, low=1)
    return [Sample(_ids(rng, p, vocab_size), int(p), int(o))
            for p, o in zip(prompt_lens, output_lens, strict=True)]


def batching_samples(n: int, vocab_size: int, seed: int = 0) -> list[Sample]:
    """The engine issue's workload; the same draws as bench/batching.py's, seed for seed."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(32, 257, size=n)
    output_lens = np.minimum(np.round(rng.lognormal(np.log(48), 0.8, size=n)), 256).astype(int)
    return [Sample(rng.integers(FIRST_ID, vocab_size, size=int(p)).tolist(), int(p),
                   max(1, int(o))) for p, o in zip(prompt_lens, output_lens, strict=True)]


def load_samples(path: str | Path, n: int, default_output_len: int, tokenizer=None,
                 seed: int = 0, max_model_len: int | None = None) -> list[Sample]:
    """n samples from a JSON/JSONL file (shuffled with `seed`, repeated when the file is short).
    A text prompt of max_model_len tokens or more is skipped, with a note: text cannot be cut
    at a token boundary here (token-id prompts are trimmed by `fit_to_context`)."""
    path = Path(path)
    text = path.read_text()
    try:
        rows = json.loads(text)
        rows = rows if isinstance(rows, list) else [rows]
    except json.JSONDecodeError:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    samples = [s for s in (_from_row(r, default_output_len, tokenizer) for r in rows) if s]
    if not samples:
        raise ValueError(f"{path}: no prompts found (expected strings, {{'prompt': ...}} or "
                         "ShareGPT 'conversations' records)")
    if max_model_len is not None:
        fits = [s for s in samples if not isinstance(s.prompt, str)
                or s.prompt_len < max_model_len]
        if not fits:
            raise ValueError(f"{path}: every prompt has max_model_len {max_model_len} tokens "
                             "or more")
        if len(fits) < len(samples):
            print(f"note: skipped {len(samples) - len(fits)} of {len(samples)} text prompts of "
                  f"max_model_len {max_model_len} tokens or more", file=sys.stderr)
        samples = fits
    order = np.random.default_rng(seed).permutation(len(samples))
    return [samples[order[i % len(samples)]] for i in range(n)]


def _from_row(row, default_output_len: int, tokenizer) -> Sample | None:
    def count(text: str) -> int:
        return len(tokenizer.encode(text)) if tokenizer is not None else max(1, len(text) // 4)

    if isinstance(row, str):
        return Sample(row, count(row), default_output_len)
    if not isinstance(row, dict):
        return None
    if "conversations" in row:
        turns = row["conversations"]
        if len(turns) < 2 or not turns[0].get("value") or not turns[1].get("value"):
            return None
        prompt, reply = turns[0]["value"], turns[1]["value"]
        prompt_len, reply_len = count(prompt), count(reply)
        if prompt_len < 4 or reply_len < 4 or prompt_len > 1024 or prompt_len + reply_len > 2048:
            return None  # vLLM's is_valid_sequence
        return Sample(prompt, prompt_len, reply_len)
    prompt = row.get("prompt")
    if prompt is None:
        return None
    output_len = int(row.get("output_len") or row.get("max_tokens") or default_output_len)
    length = len(prompt) if isinstance(prompt, list) else count(prompt)
    return Sample(prompt, length, output_len)


def prefix_repetition_samples(n: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                              output_len: int, vocab_size: int, seed: int = 0) -> list[Sample]:
    """vLLM's prefix_repetition dataset: request i is prefix i % num_prefixes + its own
    suffix, shuffled."""
    rng = np.random.default_rng(seed)
    prefixes = [_ids(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    samples = [Sample(prefixes[i % num_prefixes] + _ids(rng, suffix_len, vocab_size),
                      prefix_len + suffix_len, output_len) for i in range(n)]
    order = rng.permutation(n)
    return [samples[i] for i in order]


def multiturn_samples(n: int, turns: int, message_len: int, reply_len: int, vocab_size: int,
                      seed: int = 0) -> list[Sample]:
    """n requests: ceil(n / turns) chats of `turns` turns, turn t's prompt the conversation so
    far (t user messages and t - 1 replies), in turn order."""
    rng = np.random.default_rng(seed)
    chats = -(-n // turns)
    prompts: list[list[list[int]]] = []  # [chat][turn]
    for _ in range(chats):
        history, prompts_of_chat = [], []
        for _ in range(turns):
            history = history + _ids(rng, message_len, vocab_size)
            prompts_of_chat.append(history)
            history = history + _ids(rng, reply_len, vocab_size)  # the reply, as resent
        prompts.append(prompts_of_chat)
    samples = [Sample(prompts[c][t], len(prompts[c][t]), reply_len)
               for t in range(turns) for c in range(chats)]
    return samples[:n]


def dataset_of(args) -> str:
    """The dataset the flags name: --dataset-path if given, else --dataset."""
    return getattr(args, "dataset_path", None) or args.dataset or "random"


def get_samples(dataset: str | None, n: int, *, input_len: int, output_len: int,
                range_ratio: float = 0.0, vocab_size: int, seed: int = 0, tokenizer=None,
                max_model_len: int | None = None, prefix_len: int = 256, num_prefixes: int = 8,
                turns: int = 4) -> list[Sample]:
    """The samples a benchmark's flags describe, fitted within max_model_len."""
    name = dataset or "random"
    if name == "prefix_repetition":
        samples = prefix_repetition_samples(n, prefix_len, input_len, num_prefixes, output_len,
                                            vocab_size, seed)
    elif name == "multiturn":
        samples = multiturn_samples(n, turns, input_len, output_len, vocab_size, seed)
    elif name == "random":
        samples = random_samples(n, input_len, output_len, range_ratio, vocab_size, seed)
    elif name == "sharegpt":
        samples = sharegpt_samples(n, input_len, output_len, vocab_size, seed)
    elif name == "batching":
        samples = batching_samples(n, vocab_size, seed)
    else:
        samples = load_samples(name, n, output_len, tokenizer, seed, max_model_len)
    return fit_to_context(samples, max_model_len) if max_model_len else samples


def fit_to_context(samples: list[Sample], max_model_len: int) -> list[Sample]:
    """Trim prompt and output so each request fits max_model_len (with a note on stderr)."""
    fitted = []
    for s in samples:
        prompt = s.prompt
        if s.prompt_len >= max_model_len and not isinstance(prompt, str):
            prompt = prompt[:max_model_len // 2]
        prompt_len = len(prompt) if not isinstance(prompt, str) else s.prompt_len
        output_len = max(1, min(s.output_len, max_model_len - prompt_len))
        fitted.append(Sample(prompt, prompt_len, output_len))
    trimmed = sum(a != b for a, b in zip(samples, fitted, strict=True))
    if trimmed:
        print(f"note: {trimmed} of {len(samples)} requests trimmed to fit max_model_len "
              f"{max_model_len}", file=sys.stderr)
    return fitted


def check_args(args) -> None:
    """The workload and load flags a bench command was given, checked before any model loads:
    a ValueError naming the flag (`getattr`: each command has its own subset)."""
    def need(ok: bool, flag: str, rule: str, value) -> None:
        if not ok:
            raise ValueError(f"{flag} must be {rule}, got {value}")

    num = getattr(args, "num_prompts", None)
    need(num is None or num >= 1, "--num-prompts", "at least 1", num)
    for dest in ("input_len", "output_len"):
        if hasattr(args, dest):
            flag = getattr(args, f"{dest}_flag", "--" + dest.replace("_", "-"))
            need(getattr(args, dest) >= 1, flag, "at least 1", getattr(args, dest))
    for dest, flag in (("prefix_len", "--prefix-repetition-prefix-len"),
                       ("num_prefixes", "--prefix-repetition-num-prefixes"),
                       ("turns", "--multiturn-turns")):
        need(getattr(args, dest, 1) >= 1, flag, "at least 1", getattr(args, dest, 1))
    ratio = getattr(args, "random_range_ratio", 0.0)
    need(0.0 <= ratio < 1.0, "--random-range-ratio", "in [0, 1)", ratio)
    name = dataset_of(args) if hasattr(args, "dataset") else "random"
    if name not in SYNTHETIC and not Path(name).is_file():
        raise ValueError(f"--dataset {name!r} is neither one of {', '.join(SYNTHETIC)} nor a "
                         "file")
    rate = getattr(args, "request_rate", None)
    need(rate is None or rate > 0, "--request-rate", "above 0 (inf: all at once)", rate)
    burst = getattr(args, "burstiness", 1.0)
    need(0 < burst < float("inf"), "--burstiness", "a finite number above 0", burst)
    limit = getattr(args, "max_concurrency", None)
    need(limit is None or limit >= 1, "--max-concurrency", "at least 1", limit)


def workload_options(args) -> dict:
    """get_samples' options for the synthetic workloads, from the flags."""
    return {name: getattr(args, name) for name in ("prefix_len", "num_prefixes", "turns")
            if hasattr(args, name)}


def add_dataset_arguments(parser, input_flag: str = "--input-len",
                          output_flag: str = "--output-len", input_len: int = 128,
                          output_len: int = 64) -> None:
    """--dataset, the length flags, --random-range-ratio and --seed."""
    group = parser.add_argument_group("workload")
    group.add_argument("--dataset", "--dataset-name", dest="dataset", default="random",
                       help=f"one of {', '.join(SYNTHETIC)}, or a JSON/JSONL file of prompts")
    group.add_argument("--dataset-path", default=None,
                       help="a JSON/JSONL file of prompts (vLLM's spelling; wins over --dataset)")
    group.add_argument(input_flag, type=int, default=input_len, dest="input_len",
                       help="prompt tokens (random: the centre; sharegpt: the median)")
    group.add_argument(output_flag, type=int, default=output_len, dest="output_len",
                       help="output tokens (random: the centre; sharegpt: the median)")
    group.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="random: lengths uniform in [len * (1 - r), len * (1 + r)]")
    group.add_argument("--prefix-repetition-prefix-len", dest="prefix_len", type=int,
                       default=256, help="prefix_repetition: each shared prefix's tokens (the "
                       "suffix: the input length)")
    group.add_argument("--prefix-repetition-num-prefixes", dest="num_prefixes", type=int,
                       default=8, help="prefix_repetition: how many shared prefixes")
    group.add_argument("--multiturn-turns", dest="turns", type=int, default=4,
                       help="multiturn: turns per chat (the input length: each user message; "
                       "the output length: each reply)")
    group.add_argument("--seed", type=int, default=None, help="the workload's seed (and the "
                       "engine's, offline; default: the --config file's seed, else 0)")
    parser.set_defaults(input_len_flag=input_flag, output_len_flag=output_flag)
