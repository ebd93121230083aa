"""A GGUF file's tensors under the names and layouts of a Hugging Face checkpoint, so the
loader reads them as it reads safetensors (loader.load_hf_state, through `open_gguf`; the
blocks held as stored go in through `put_held`): llama.cpp's names mapped
(`blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`), each tensor [out, in] as
transformers holds it, with what llama.cpp's converter changed undone: Llama's and Mixtral's
query and key rows interleaved for its RoPE (permuted back), Gemma's norm weights stored plus
one (minus one again), the experts' projections in stacks (given as transformers 5's fused
`experts.gate_up_proj` and `experts.down_proj`).

Values: each tensor dequantised by the `gguf` package (`gguf.quants.dequantize`) to float32,
or, where the model holds its linear layers quantised as the file does (config/gguf.py's
`quantization`), its blocks split into the narrow values and their float16 scales (and
minima): Q8_0 as int8, Q4_0 as int4 (value - 8), Q4_1 as uint4 with a minimum a block, each
block of 32 weights along the input, the scale and minimum of a block its group's.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxserve.config.gguf import GEMMA, Q4_0, Q4_1, Q8_0, read_gguf
from jaxserve.config.model import ModelConfig

# llama.cpp's tensor names in a block -> transformers' (after model.layers.N.)
_BLOCK = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma 2 and 3 norm around both halves of a block
_GEMMA_BLOCK = {"post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
log = logging.getLogger("jaxserve")
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_NAME = re.compile(r"blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)")


class GGUFTensors:
    """A safetensors `safe_open`'s surface (keys(), get_tensor(name), a context manager) over
    a GGUF reader, in Hugging Face names and layouts (see the module)."""

    def __init__(self, reader, cfg: ModelConfig, arch: str, file):
        self.file, self._cfg, self._arch = file, cfg, arch
        self._tensors = {t.name: t for t in reader.tensors}
        self._names: dict[str, list[str]] = {}  # HF name -> the GGUF tensors it is made of
        for name in self._tensors:
            for hf, parts in self._hf(name):
                self._names.setdefault(hf, []).extend(parts)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def keys(self):
        return list(self._names)

    def _hf(self, name: str) -> list[tuple[str, list[str]]]:
        """The HF tensors a GGUF tensor gives ([] for those the model derives itself)."""
        if name in _TOP:
            return [(_TOP[name], [name])]
        if name == "rope_freqs.weight" or name.startswith("rope_factors_"):
            return []  # RoPE's factors: the config carries them (config/gguf.py)
        match = _NAME.fullmatch(name)
        if match is None:
            raise ValueError(f"{self.file}: tensor {name!r} has no place in the "
                             f"{self._cfg.architecture} model")
        layer, kind, leaf = match.groups()
        stem = f"model.layers.{layer}"
        if kind in _EXPERTS:  # the stacks: gate and up fused, as transformers 5 holds them
            if kind == "ffn_down_exps":
                return [(f"{stem}.mlp.experts.down_proj", [name])]
            return [(f"{stem}.mlp.experts.gate_up_proj", [name])]
        table = _GEMMA_BLOCK if self._arch in GEMMA and kind in _GEMMA_BLOCK else _BLOCK
        if kind == "ffn_up" and self._arch == "phi3":  # Phi-3's gate and up in one
            return [(f"{stem}.mlp.gate_up_proj.{leaf}", [name])]
        if kind not in table:
            raise ValueError(f"{self.file}: tensor {name!r} has no place in the "
                             f"{self._cfg.architecture} model")
        return [(f"{stem}.{table[kind]}.{leaf}", [name])]

    def get_tensor(self, hf_name: str) -> np.ndarray:
        parts = self._names[hf_name]
        if hf_name.endswith("experts.gate_up_proj"):  # [E, I, H] each -> [E, 2 I, H]
            order = sorted(parts, key=lambda n: "ffn_up_exps" in n)  # gate's rows first
            return np.concatenate([self._float(n) for n in order], axis=1)
        (name,) = parts
        tensor = self._float(name)
        if hf_name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")) \
                and self._arch == "llama":
            heads = (self._cfg.num_heads if ".q_proj." in hf_name else self._cfg.num_kv_heads)
            tensor = unpermute_rope_rows(tensor, heads)
        if self._arch in GEMMA and hf_name.endswith("norm.weight"):
            tensor = tensor - np.float32(1.0)
        if hf_name.endswith("shared_expert_gate.weight"):  # [hidden] -> transformers' [1, hidden]
            tensor = tensor.reshape(1, -1)
        return tensor

    def held(self, hf_name: str) -> list[tuple[str, dict[str, np.ndarray]]] | None:
        """A tensor the model holds quantised as the file does (ModelConfig's GGUF layout):
        [(the HF module it fills, {leaf: array})], a fused Phi-3 tensor's parts one each:
        a linear layer's `kernel` [in, out] and its `group_scale` (and `group_min`)
        [in / 32, out]; the embedding's `embedding` [vocab, hidden] and its groups' [vocab,
        hidden / 32]. None for a tensor that loads as floats."""
        if not self._held_here(hf_name):
            return None
        cfg = self._cfg
        embedding = hf_name == "model.embed_tokens.weight"
        method, offsets = ((cfg.embedding_quantization, cfg.embedding_offsets) if embedding
                           else (cfg.quantization, cfg.quantization_offsets))
        (name,) = self._names[hf_name]
        q, scale, minimum = _blocks(self._tensors[name], method, offsets, self.file)
        stem = hf_name.removesuffix(".weight")
        if embedding:
            held = {"embedding": q, "group_scale": scale}
            return [(stem, held | ({"group_min": minimum} if offsets else {}))]
        parts = [(stem, (q, scale, minimum))]
        fused = _PHI3_FUSED.get(stem.rsplit(".", 1)[-1])
        if fused is not None:  # rows: q's, k's, v's (gate's, up's)
            q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            rows = ([q_rows, kv_rows, kv_rows] if len(fused) == 3 else
                    [cfg.intermediate_size] * 2)
            ends = np.cumsum(rows)
            parent = stem.rsplit(".", 1)[0]
            parts = [(f"{parent}.{part}", tuple(None if a is None else a[end - n:end]
                                                for a in (q, scale, minimum)))
                     for part, n, end in zip(fused, rows, ends, strict=True)]
        out = []
        for part, (q, scale, minimum) in parts:
            if self._arch == "llama" and part.endswith(("q_proj", "k_proj")):
                heads = cfg.num_heads if part.endswith("q_proj") else cfg.num_kv_heads
                q, scale, minimum = (None if a is None else unpermute_rope_rows(a, heads)
                                     for a in (q, scale, minimum))
            held = {"kernel": np.ascontiguousarray(q.T), "group_scale": np.ascontiguousarray(
                scale.T)}
            if offsets:
                held["group_min"] = np.ascontiguousarray(minimum.T)
            out.append((part, held))
        return out

    def dequantised(self) -> str | None:
        """What loads as floats though the file holds it quantised (a type the model does not
        hold, as the K-quants): "N tensors (types) of X MB in the file, Y MB as float32";
        None when nothing does."""
        kinds: dict[str, int] = {}
        stored = floats = 0
        for hf_name, parts in self._names.items():
            for name in parts:
                tensor = self._tensors[name]
                if tensor.tensor_type.name in ("F32", "F16", "BF16") or (
                        len(parts) == 1 and self._held_here(hf_name)):
                    continue
                kinds[tensor.tensor_type.name] = kinds.get(tensor.tensor_type.name, 0) + 1
                stored += int(tensor.n_bytes)
                floats += int(tensor.n_elements) * 4
        if not kinds:
            return None
        types = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
        return (f"{sum(kinds.values())} tensors ({types}) dequantised as they load: "
                f"{stored / 2**20:.1f} MiB in the file, {floats / 2**20:.1f} MiB as float32")

    def _held_here(self, hf_name: str) -> bool:
        """Whether the model holds this tensor in the file's blocks (`held`'s)."""
        cfg = self._cfg
        if cfg.quantization_format != "gguf" or not hf_name.endswith(".weight"):
            return False
        if hf_name == "model.embed_tokens.weight":
            return cfg.embedding_quantization is not None
        return cfg.quantization is not None and bool(_LINEAR_HF.search(hf_name))

    def _float(self, name: str) -> np.ndarray:
        """The tensor dequantised to float32, shaped as the file lists it, slowest axis
        first (a matrix [out, in])."""
        from gguf.quants import dequantize

        tensor = self._tensors[name]
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as error:
            raise ValueError(f"{self.file}: tensor {name!r} is of type "
                             f"{tensor.tensor_type.name}, which the gguf package cannot "
                             f"dequantise ({error})") from None
        shape = tuple(int(d) for d in reversed(tensor.shape))
        return np.asarray(values, np.float32).reshape(shape)


def open_gguf(file: Path, cfg: ModelConfig) -> GGUFTensors:
    """The file's tensors for the loader, one log line naming what loads dequantised."""
    reader = read_gguf(file)
    tensors = GGUFTensors(reader, cfg, reader.fields["general.architecture"].contents(), file)
    if (dequantised := tensors.dequantised()) is not None:
        log.info("%s: %s", file.name, dequantised)
    return tensors


def put_held(name: str, held: list, expected: dict, values: dict, place) -> None:
    """A GGUF tensor's quantised blocks (GGUFTensors.held) into the loader's `values` as they
    are (`place`: as load_hf_state's)."""
    for stem, leaves in held:
        key = tuple(int(p) if p.isdigit() else p for p in stem.split("."))
        for leaf, array in leaves.items():
            at = (*key, leaf)
            if at not in expected:
                raise ValueError(f"GGUF tensor for {name!r} has no place in the model ({stem}."
                                 f"{leaf})")
            want = expected[at]
            if tuple(array.shape) != tuple(want.shape) or jnp.dtype(array.dtype) != want.dtype:
                raise ValueError(f"GGUF tensor for {name!r}: {stem}.{leaf} is {array.dtype} "
                                 f"{tuple(array.shape)}, the model expects {want.dtype} "
                                 f"{tuple(want.shape)}")
            values[at] = jnp.asarray(array) if place is None else place(at, array)


_LINEAR_HF = re.compile(r"\.(self_attn\.(q|k|v|o|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj)"
                        r"\.weight$")
_PHI3_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj",
                                                                          "up_proj")}
# GGML's block types held as stored: their bytes a block of 32 weights
_BLOCK_BYTES = {Q8_0: 34, Q4_0: 18, Q4_1: 20}


def _blocks(tensor, method: str, offsets: bool, file) -> tuple:
    """A Q8_0, Q4_0 or Q4_1 matrix's blocks -> (values [rows, cols] of the held type, float16
    scales and minima [rows, cols / 32]; minima None without offsets), such that w = values *
    scale (+ minimum): int8 (Q8_0's values; Q4_0's minus 8), int4 (Q4_0's minus 8), uint4 with
    offsets (Q4_1's values and minima; Q4_0's values with a minimum of -8 * scale)."""
    import ml_dtypes

    kind = int(tensor.tensor_type)
    if kind not in _BLOCK_BYTES:
        raise ValueError(f"{file}: tensor {tensor.name!r} is {tensor.tensor_type.name}, but "
                         "the model holds its layers as Q8_0, Q4_0 or Q4_1 blocks")
    size = _BLOCK_BYTES[kind]
    raw = np.asarray(tensor.data, np.uint8)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, size)  # [rows, blocks, bytes]
    scale = blocks[..., :2].copy().view(np.float16)[..., 0]
    minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0] if kind == Q4_1 else None
    if kind == Q8_0:
        values = blocks[..., 2:].copy().view(np.int8).astype(np.int16)
    else:  # 16 bytes: weight j in byte j's low half, weight j + 16 in its high half
        packed = blocks[..., 4:] if kind == Q4_1 else blocks[..., 2:]
        values = np.concatenate([packed & 0xF, packed >> 4], axis=-1).astype(np.int16)
        if kind == Q4_0 and not offsets:
            values = values - 8  # symmetric, as int8 or int4 holds it
        elif kind == Q4_0:
            minimum = (np.float16(-8) * scale).astype(np.float16)
    if offsets and minimum is None:  # Q8_0 beside Q4_1 blocks
        minimum = np.zeros_like(scale)
    dtype = {"int8": np.int8, "int4": ml_dtypes.uint4 if offsets else ml_dtypes.int4}[method]
    return values.reshape(rows, -1).astype(dtype), scale, minimum


def unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's query (key) rows from transformers' halves
    (the first half of a head's dimensions rotating with the second) into interleaved pairs:
    row 2i of a head came from its row i, 2i + 1 from i + d/2. Put them back."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
