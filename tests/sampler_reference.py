"""The independent numpy reference of the sampler controls, written from vLLM's definitions (V1
sampler), for test_sampler_controls.py and test_sampler_controls_e2e.py; and the demo model's
vocabulary."""

import numpy as np


def reference_logits(logits, prompt_ids, output_ids, presence, frequency, repetition,
                     bias: dict, allowed: set | None, banned: set) -> np.ndarray:
    """One row's logits [V] as vLLM's sampler sees them before temperature (float32)."""
    x = np.array(logits, np.float32)
    vocab = x.shape[0]
    ok = np.zeros(vocab, bool) if allowed is not None else np.ones(vocab, bool)
    if allowed is not None:
        ok[sorted(allowed)] = True
    ok[sorted(banned)] = False
    x[~ok] = -np.inf
    for token, value in bias.items():
        x[token] += np.float32(value)
    counts = np.bincount(np.asarray(output_ids, np.int64), minlength=vocab)
    seen = counts > 0
    in_prompt = np.zeros(vocab, bool)
    in_prompt[list(prompt_ids)] = True
    r = np.float32(repetition)
    penalised = in_prompt | seen
    x = np.where(penalised & (x > 0), x / r, np.where(penalised, x * r, x))
    x = x - np.float32(frequency) * counts.astype(np.float32)
    return (x - np.float32(presence) * seen.astype(np.float32)).astype(np.float32)


def reference_support(processed, temperature, min_p, top_k, top_p, slack):
    """The tokens a draw may give: temperature -> min_p -> top-k -> top-p over `processed`
    (float64). `slack` > 0 widens every cut by that relative margin (a superset of what
    float32 keeps), < 0 narrows it (a subset)."""
    z = processed.astype(np.float64) / temperature
    finite = np.isfinite(z)
    p = np.where(finite, np.exp(z - z[finite].max()), 0.0)
    keep = finite & ((p >= min_p * (1 - slack)) | (p == 1))  # p is relative to the max
    kth = np.sort(z[finite])[::-1][min(top_k, finite.sum()) - 1]
    keep &= z >= kth - max(slack, 0) * (1 + abs(kth))  # ties at the cut stay in
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    order = np.argsort(-q, kind="stable")
    before = np.cumsum(q[order]) - q[order]
    kept = np.zeros_like(keep)
    kept[order] = before < top_p + slack
    return keep & kept, q


def _explained(ref: np.ndarray, token: int, tol: float = 1e-5) -> bool:
    """The greedy `token` is the reference's argmax (or ties it within `tol`, relative)."""
    top = ref.max()
    return int(token) == int(np.argmax(ref)) or ref[token] >= top - tol * (1 + abs(top))


def _log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


VOCAB = 258  # the demo's bytes, BOS 256, EOS 257
EOS = 257
