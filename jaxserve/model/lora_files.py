"""A LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors) read as
the banks of model/lora.py hold it: per (layer, module) A [in, rank] and B [rank, out] in
float32, B times the adapter's scaling, both padded with zeros to max_lora_rank.

PEFT's keys name the module each pair adapts, `base_model.model.model.layers.{i}.{self_attn|mlp}
.{module}.lora_{A|B}[.{adapter}].weight`, with A [r, in] and B [out, r]. The scaling is
lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora; rank_pattern and alpha_pattern give
modules their own (PEFT's rule: a key matches a module whose name ends with it). Phi-3's fused
qkv_proj and gate_up_proj split as the base's weights do (their B by rows; A shared).

Refused, each with the module or field named: DoRA, trained biases, modules_to_save, the
embedding and lm_head, modules the model does not have, shapes that do not fit the base, ranks
past max_lora_rank, and the MLP of a mixture of experts.
"""

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxserve.config.checks import read_json_object
from jaxserve.config.model import ModelConfig
from jaxserve.model.lora import ATTENTION_MODULES, MLP_MODULES, MODULES, module_shapes

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.*?)\.(?P<factor>lora_A|lora_B)"
                  r"(?:\.[^.]+)?\.weight$")
_LAYER = re.compile(r"^(?:model\.)?layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\."
                    r"(?P<name>[a-z_]+)$")
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter's weights as the banks take them."""

    name: str
    path: Path
    rank: int  # its largest module's
    # (layer, module) -> (A [in, max_rank], scaling * B [max_rank, out]) float32
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    @property
    def modules(self) -> list[str]:
        return sorted({m for _, m in self.weights}, key=MODULES.index)


def _pattern(pattern: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key a module's name ends
    with (as a regex), else the default."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_config(path: Path) -> dict:
    """adapter_config.json, checked for what the banks cannot hold."""
    file = path / "adapter_config.json"
    if not file.is_file():
        raise ValueError(f"LoRA adapter {path}: no adapter_config.json (PEFT's format: "
                         "adapter_config.json and adapter_model.safetensors)")
    config = read_json_object(file)
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise ValueError(f"LoRA adapter {file}: peft_type {kind!r}; only LORA adapters are "
                         "served")
    if config.get("use_dora"):
        raise ValueError(f"LoRA adapter {file}: use_dora: DoRA adapters are not served")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {file}: bias {config['bias']!r}: adapters with trained "
                         "biases are not served (bias 'none')")
    if config.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {file}: modules_to_save {config['modules_to_save']}: "
                         "adapters that replace whole modules are not served")
    for field, what in (("lora_bias", "a trained bias on B"),
                        ("trainable_token_indices", "trained embedding rows"),
                        ("target_parameters", "adapted parameters (not modules)"),
                        ("layer_replication", "replicated layers"),
                        ("use_qalora", "QA-LoRA's pooled inputs")):
        if config.get(field):
            raise ValueError(f"LoRA adapter {file}: {field} {config[field]!r}: adapters with "
                             f"{what} are not served")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {file}: fan_in_fan_out is for Conv1D bases (GPT-2); "
                         "this model's layers are linear")
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"LoRA adapter {file}: {field} {value!r}: expected a positive "
                             "number")
    return config


def read_adapter(path: str | Path, cfg: ModelConfig, max_rank: int,
                 name: str | None = None) -> LoraAdapter:
    """The adapter at `path` (a PEFT directory) for a base of config `cfg`."""
    from safetensors.numpy import load_file

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {path}: not a directory")
    config = read_config(path)
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        extra = " (adapter_model.bin is PyTorch's pickle: save it with safetensors)" if (
            path / "adapter_model.bin").is_file() else ""
        raise ValueError(f"LoRA adapter {path}: no adapter_model.safetensors{extra}")
    try:
        tensors = load_file(str(file))
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"LoRA adapter {file}: unreadable ({e})") from None
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _KEY.match(key)
        if match is None:
            if "lora_embedding" in key or "embed_tokens" in key or "lm_head" in key:
                raise ValueError(f"LoRA adapter {file}: {key}: adapters of the embedding and "
                                 "lm_head are not served")
            raise ValueError(f"LoRA adapter {file}: tensor {key} is not a LoRA factor "
                             "(lora_A / lora_B of a linear layer)")
        pairs.setdefault(match["module"], {})[match["factor"]] = value
    if not pairs:
        raise ValueError(f"LoRA adapter {file}: no LoRA weights")
    shapes = module_shapes(cfg)
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    rank = 0
    for module, factors in pairs.items():
        found = _LAYER.match(module.removeprefix("model."))
        if found is None:
            what = ("the embedding and lm_head" if "embed" in module or "lm_head" in module
                    else "only the layers' attention and MLP projections")
            raise ValueError(f"LoRA adapter {file}: module {module}: {what} are served")
        layer, block, target = int(found["layer"]), found["block"], found["name"]
        if set(factors) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {file}: module {module} has {sorted(factors)} "
                             "only: needs lora_A and lora_B")
        if layer >= cfg.num_layers:
            raise ValueError(f"LoRA adapter {file}: module {module}: the model has "
                             f"{cfg.num_layers} layers")
        parts = _FUSED.get(target, (target,))
        expected = ATTENTION_MODULES if block == "self_attn" else MLP_MODULES
        if any(p not in expected for p in parts):
            raise ValueError(f"LoRA adapter {file}: module {module}: target {target!r} is not "
                             f"among the {block} projections {', '.join(expected)}")
        if block == "mlp" and cfg.num_experts:
            raise ValueError(f"LoRA adapter {file}: module {module}: the model's MLPs are "
                             "mixtures of experts, which adapters do not target here")
        a, b = (np.asarray(factors[f], np.float32) for f in ("lora_A", "lora_B"))
        r = a.shape[0]
        n_in = shapes[parts[0]][0]
        n_out = [shapes[p][1] for p in parts]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != n_in or b.shape != (sum(n_out), r):
            raise ValueError(
                f"LoRA adapter {file}: module {module}: lora_A {list(a.shape)} and lora_B "
                f"{list(b.shape)} do not fit the base's {target} (in {n_in}, out "
                f"{sum(n_out)}): expected [r, {n_in}] and [{sum(n_out)}, r]")
        if r > max_rank:
            raise ValueError(f"LoRA adapter {file}: module {module} has rank {r}, past "
                             f"max_lora_rank {max_rank}")
        name_in_model = f"model.layers.{layer}.{block}.{target}"
        alpha = _pattern(config.get("alpha_pattern"), name_in_model, config["lora_alpha"])
        scaling = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
        a_padded = np.zeros((n_in, max_rank), np.float32)
        a_padded[:, :r] = a.T
        at = 0
        for part, n in zip(parts, n_out, strict=True):
            b_padded = np.zeros((max_rank, n), np.float32)
            b_padded[:r] = b[at:at + n].T * np.float32(scaling)
            at += n
            weights[(layer, part)] = (a_padded, b_padded)
        rank = max(rank, r)
    return LoraAdapter(name=name or path.name, path=path, rank=rank, weights=weights)
