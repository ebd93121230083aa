"""Output-length predictors for shortest-job-first: any callable `Request -> predicted tokens`.

    oracle      the request's own max_tokens (exact when a workload runs with ignore_eos)
    prompt      a proxy: proportional to the prompt's length
    MLP         a small learned model over prompt features, numpy at inference; trained with
                optax by `jaxserve.tools.train_predictor` and saved as JSON

`resolve_predictor("oracle" | "prompt" | path)` returns one.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxserve.request import Request

Predictor = Callable[[Request], float]
NUM_TOKEN_BUCKETS = 32  # the first tokens of a prompt are hashed into this many buckets
NUM_LEADING_TOKENS = 4  # how many leading tokens the features look at (an instruction's opening)
NUM_FEATURES = 2 + NUM_TOKEN_BUCKETS


def oracle(request: Request) -> float:
    """The length the request will produce when it never stops early: for experiments."""
    return float(request.max_len - len(request.prompt_ids))


@dataclass(frozen=True)
class PromptLengthPredictor:
    """Longer prompts are predicted to produce longer outputs."""

    scale: float = 1.0
    offset: float = 0.0

    def __call__(self, request: Request) -> float:
        return self.offset + self.scale * len(request.prompt_ids)


def prompt_features(prompt_ids: list[int]) -> np.ndarray:
    """[NUM_FEATURES] float32: log length, log max token id, leading tokens hashed to buckets."""
    x = np.zeros(NUM_FEATURES, np.float32)
    x[0] = np.log1p(len(prompt_ids))
    x[1] = np.log1p(max(prompt_ids, default=0))
    for token in prompt_ids[:NUM_LEADING_TOKENS]:
        x[2 + (token * 2654435761 % 2**32) % NUM_TOKEN_BUCKETS] += 1.0
    return x


@dataclass(frozen=True)
class MLPPredictor:
    """log1p(output length) = MLP(standardised prompt features); one hidden ReLU layer."""

    mean: np.ndarray  # [F]
    std: np.ndarray  # [F]
    w1: np.ndarray  # [F, H]
    b1: np.ndarray  # [H]
    w2: np.ndarray  # [H]
    b2: float

    def predict_features(self, x: np.ndarray) -> np.ndarray:  # x: [N, F] -> [N] tokens
        h = np.maximum((x - self.mean) / self.std @ self.w1 + self.b1, 0.0)
        return np.expm1(np.maximum(h @ self.w2 + self.b2, 0.0))

    def __call__(self, request: Request) -> float:
        return float(self.predict_features(prompt_features(request.prompt_ids)[None])[0])

    def save(self, path: str | Path) -> None:
        arrays = {k: np.asarray(getattr(self, k)).tolist() for k in ("mean", "std", "w1", "b1",
                                                                    "w2", "b2")}
        Path(path).write_text(json.dumps({"kind": "mlp", "num_features": NUM_FEATURES} | arrays))

    @classmethod
    def load(cls, path: str | Path) -> "MLPPredictor":
        data = json.loads(Path(path).read_text())
        if data.get("kind") != "mlp" or data.get("num_features") != NUM_FEATURES:
            raise ValueError(f"{path} is not a saved length predictor of {NUM_FEATURES} features")
        return cls(**{k: np.asarray(data[k], np.float32) for k in ("mean", "std", "w1", "b1",
                                                                   "w2")}, b2=float(data["b2"]))


def resolve_predictor(spec: str) -> Predictor:
    """"oracle", "prompt", or the path of a learned predictor saved by MLPPredictor.save."""
    if spec == "oracle":
        return oracle
    if spec == "prompt":
        return PromptLengthPredictor()
    if not Path(spec).is_file():
        raise ValueError(f"sjf_predictor must be 'oracle', 'prompt' or a predictor file, got "
                         f"{spec!r}")
    return MLPPredictor.load(spec)
