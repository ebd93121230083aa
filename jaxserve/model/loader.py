"""Weights: Hugging Face safetensors (or a GGUF file, gguf_tensors.py) -> NNX state, random
init, orbax save/restore.

Nothing is ever downloaded: a model is a local directory. An orbax checkpoint written by
`jaxserve convert` (or the demo model's training) holds `config.json` and `params/`.
"""

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxserve.config.gguf import gguf_file
from jaxserve.config.model import ModelConfig
from jaxserve.model.gguf_tensors import GGUFTensors, open_gguf, put_held
from jaxserve.model.llama import LlamaForCausalLM
from jaxserve.model.quant import array_bytes, quantize_weight
from jaxserve.model.quantized_tensors import checkpoint_scales, load_packed, narrow, unpack_int32

ORBAX_DIR = "params"
# Tensors some checkpoints carry that the model derives itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# what a pre-quantised checkpoint holds for its activations and zero points (symmetric):
# unused, the weights are dequantised inside the matmul
_WEIGHT_ONLY_SUFFIXES = ("input_scale", "input_zero_point", "weight_zero_point", "weight_shape")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json", "byte_tokenizer.json", "chat_template.jinja")


def abstract_model(cfg: ModelConfig, dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """The graph and a state of ShapeDtypeStructs; no memory is allocated."""
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype, nnx.Rngs(0)))
    return nnx.split(model)


def _flat(state: nnx.State | dict) -> dict[tuple, jax.ShapeDtypeStruct]:  # or arrays
    """The state's (or a pure dict's) leaves by path."""
    out = {}

    def walk(prefix, node):
        if isinstance(node, dict):
            for key, child in node.items():
                walk((*prefix, key), child)
        else:
            out[prefix] = node

    walk((), state if isinstance(state, dict) else nnx.to_pure_dict(state))
    return out


def _nest(flat: dict[tuple, jax.Array]) -> dict:
    root: dict = {}
    for path, value in flat.items():
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return root


def random_state(cfg: ModelConfig, dtype, seed: int, place=None,
                 shapes_only: bool = False) -> tuple[nnx.GraphDef, nnx.State]:
    """load_format="dummy": norms at 1, biases at 0, the rest N(0, 0.02), made on the device;
    with `place` (jaxserve/parallel/sharding.py's ShardPlacement) each made on its shards, the same
    values (jax's random bits do not depend on the sharding)."""
    graphdef, abstract = abstract_model(cfg, dtype)
    flat = _flat(abstract)
    shardings = None if place is None else {
        path: place.sharding(path, leaf.ndim) for path, leaf in flat.items()}

    @functools.partial(jax.jit, out_shardings=shardings)
    def init(key):
        values = {}
        # a quantised kernel's scales are made with it: the rest numbered as unquantised, so
        # a quantised model's weights are its full-precision twin's, quantised
        scales = {_scale(path) for path in flat if _quantized(path, flat, cfg)}
        weights = sorted((kv for kv in flat.items() if kv[0] not in scales),
                         key=lambda kv: str(kv[0]))
        for i, (path, leaf) in enumerate(weights):
            if _quantized(path, flat, cfg):  # full-precision noise, quantised
                noise = jax.random.normal(jax.random.fold_in(key, i), leaf.shape, jnp.float32)
                values[path], values[_scale(path)] = quantize_weight(
                    (0.02 * noise).astype(dtype), cfg.quantization)
            elif path[-1] == "weight":
                values[path] = jnp.ones(leaf.shape, leaf.dtype)
            elif path[-1] == "bias":
                values[path] = jnp.zeros(leaf.shape, leaf.dtype)
            else:
                noise = jax.random.normal(jax.random.fold_in(key, i), leaf.shape, jnp.float32)
                values[path] = (0.02 * noise).astype(leaf.dtype)
        if place is not None:
            values = {path: place.transform(path, value) for path, value in values.items()}
        return values

    values = init(jax.random.key(seed)) if not shapes_only else jax.eval_shape(
        init, jax.random.key(seed))
    nnx.replace_by_pure_dict(abstract, _nest(values))
    return graphdef, abstract


def _quantized(key: tuple, expected: dict[tuple, jax.ShapeDtypeStruct],
               cfg: ModelConfig) -> bool:
    """Whether the state's `key` is a quantised layer's kernel, which the loader quantises."""
    return (cfg.quantization is not None and key[-1] == "kernel"
            and (_scale(key) in expected or (*key[:-1], "group_scale") in expected))


def _scale(kernel: tuple) -> tuple:  # a quantised kernel's path -> its scales'
    return (*kernel[:-1], "scale")


def _hf_path(name: str, expected: dict[tuple, jax.ShapeDtypeStruct]) -> tuple[tuple, bool] | None:
    """HF tensor name -> (state path, transpose?) or None when the model has no such tensor."""
    parts = tuple(int(p) if p.isdigit() else p for p in name.split("."))
    stem, leaf = parts[:-1], parts[-1]
    if leaf == "weight_scale":  # a pre-quantised layer's scales (compressed-tensors)
        scales = [(*stem, kind) for kind in ("scale", "group_scale") if (*stem, kind) in expected]
        return (scales[0], False) if scales else None
    if leaf == "weight_packed":  # its weights packed into int32 words (pack-quantized)
        quantised = any((*stem, scale) in expected for scale in ("scale", "group_scale"))
        return ((*stem, "kernel"), True) if quantised else None
    if leaf == "weight":
        for candidate, transpose in (("kernel", True), ("embedding", False), ("weight", False)):
            if (*stem, candidate) in expected:
                return (*stem, candidate), transpose
        return None
    return (parts, False) if parts in expected else None


def _kv_scale_path(name: str, expected: dict) -> tuple | None:
    """A layer's fp8 KV cache scale, as compressed-tensors writes it (self_attn.k_scale,
    v_scale; older checkpoints: self_attn.k_proj.output_scale, v_proj's) -> its state path."""
    parts = tuple(int(p) if p.isdigit() else p for p in name.split("."))
    if parts[-2:] in ((f"{kv}_proj", "output_scale") for kv in "kv"):
        parts = (*parts[:-2], f"{parts[-2][0]}_scale")
    return parts if parts[-1] in ("k_scale", "v_scale") and parts in expected else None


def _kv_scale(name: str, tensor, place, key: tuple) -> jax.Array:
    values = np.asarray(tensor, np.float32).reshape(-1)
    if values.size != 1 or not np.isfinite(values[0]) or values[0] <= 0:
        raise ValueError(f"tensor {name!r}: a KV cache scale must be one positive number, got "
                         f"{values.tolist()[:4]}")
    scale = values.reshape(())
    return jnp.asarray(scale) if place is None else place(key, scale)


# Phi-3's fused tensors -> the model's own, in the checkpoint's row order
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _fused_parts(name: str, cfg: ModelConfig) -> list[tuple[str, int | None]]:
    """[(tensor name, rows)]: a fused tensor's parts, each its rows of the fused one; any other
    tensor is its own one part (rows None)."""
    stem, _, leaf = name.rpartition(".")
    parent, _, proj = stem.rpartition(".")
    if leaf not in ("weight", "weight_scale", "weight_packed") or proj not in _FUSED:
        return [(name, None)]
    q, kv, i = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                cfg.intermediate_size)
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": i, "up_proj": i}
    return [(f"{parent}.{part}.{leaf}", rows[part]) for part in _FUSED[proj]]


def _split_rows(name: str, tensor, parts: list[tuple[str, int | None]], hidden: int) -> list:
    """The tensor's parts (_fused_parts'), a fused [rows, hidden] one split by rows (its
    scales [rows, 1] too; one scale for the whole tensor is each part's)."""
    if parts[0][1] is None:
        return [tensor]
    if name.endswith("weight_scale"):
        if tensor.size == 1:
            return [tensor] * len(parts)
        hidden = tensor.shape[-1] if tensor.ndim == 2 else 1  # [rows, 1] or [rows, groups]
    if name.endswith("weight_packed"):  # [rows, words]: packed along the input
        hidden = tensor.shape[-1]
    want = (sum(rows for _, rows in parts), hidden)
    if tuple(tensor.shape) != want:
        layout = " + ".join(f"{rows} {part.split('.')[-2]} rows" for part, rows in parts)
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)} in the checkpoint but "
                         f"the model expects {want} ({layout})")
    ends = np.cumsum([rows for _, rows in parts])
    return [tensor[end - rows:end] for (_, rows), end in zip(parts, ends, strict=True)]


def _safetensor_files(path: Path) -> list[Path]:
    """The shards an index names; else model.safetensors alone, as transformers reads it (an
    adapter_model.safetensors or consolidated.safetensors beside it is another format's copy);
    else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' (tensor name -> shard file)")
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard file(s) missing from {path}: "
                                    f"{', '.join(missing)}")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model directory {path}")
    return files


# safetensors dtypes its numpy and flax readers cannot make (numpy has no float8): read from
# the file's bytes as ml_dtypes' types, which jax takes
_NARROW_FLOATS = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def _get_tensor(f, file: Path, name: str):
    """safe_open's tensor `name`, or for a float8 one its bytes viewed as ml_dtypes' float8."""
    try:
        return f.get_tensor(name)
    except (AttributeError, TypeError) as error:  # numpy.float8_*: the readers' missing dtype
        unread = error
    with open(file, "rb") as raw:
        size = int.from_bytes(raw.read(8), "little")
        entry = json.loads(raw.read(size))[name]
        if entry["dtype"] not in _NARROW_FLOATS:
            raise unread
        start, end = entry["data_offsets"]
        raw.seek(8 + size + start)
        data = np.frombuffer(raw.read(end - start), np.uint8)
    return data.view(_NARROW_FLOATS[entry["dtype"]]).reshape(entry["shape"])


def _open_safetensors(safe_open, file: Path, framework: str = "flax"):
    """safe_open, with an error that names the file when it is not a safetensors file."""
    try:
        return safe_open(file, framework=framework)
    except Exception as error:
        head = file.read_bytes()[:64] if file.is_file() else b""
        hint = (" (a git-lfs pointer: fetch the weights with `git lfs pull`)"
                if head.startswith(b"version https://git-lfs") else
                " (truncated or not a safetensors file?)")
        raise ValueError(f"{file}: cannot read it as safetensors{hint}: {error}") from None


def load_hf_state(path: str | Path, cfg: ModelConfig, dtype,
                  place=None) -> tuple[nnx.GraphDef, nnx.State]:
    """Read a local Hugging Face directory's safetensors (single or sharded) into the state.
    `place(path, tensor)`: the array a checkpoint tensor (host memory, the model's layout)
    becomes, e.g. put straight onto its shards (jaxserve/parallel/sharding.py); else on the device."""
    from safetensors import safe_open

    path = Path(path)
    graphdef, abstract = abstract_model(cfg, dtype)
    expected = _flat(abstract)
    values: dict[tuple, jax.Array] = {}
    experts: dict[tuple, tuple[np.ndarray, set[int]]] = {}  # a stack being filled, expert by expert
    # GPTQ's and AWQ's values waiting for their zero points (GPTQ act-order: its g_idx)
    pending: dict[tuple, dict] = {}
    gguf = gguf_file(path)
    # placed: read into host memory, each device then sent its part
    sources = ([(gguf, lambda: open_gguf(gguf, cfg))] if gguf is not None else [
        (file, functools.partial(_open_safetensors, safe_open, file,
                                 "flax" if place is None else "numpy"))
        for file in _safetensor_files(path)])
    for file, open_file in sources:
        with open_file() as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if cfg.num_experts and _load_experts(f, file, name, cfg, expected, experts,
                                                     values, place):
                    continue
                if cfg.quantization_format in ("gptq", "gptq_v2", "awq") and load_packed(
                        name, functools.partial(_get_tensor, f, file, name), cfg, expected, values,
                        pending, place):
                    continue
                if cfg.kv_cache_scales and (at := _kv_scale_path(name, expected)) is not None:
                    values[at] = _kv_scale(name, _get_tensor(f, file, name), place, at)
                    continue
                if isinstance(f, GGUFTensors) and (held := f.held(name)) is not None:
                    put_held(name, held, expected, values, place)
                    continue
                parts = _fused_parts(name, cfg)
                targets = [_hf_path(part, expected) for part, _ in parts]
                if None in targets:
                    if name.endswith(_IGNORED_SUFFIXES) or (
                        cfg.quantization is not None and name.endswith(_WEIGHT_ONLY_SUFFIXES)
                    ) or (
                        name == "lm_head.weight" and cfg.tie_word_embeddings
                    ):
                        continue
                    raise ValueError(f"checkpoint tensor {name!r} in {file.name} has no place in "
                                     f"the {cfg.architecture} model")
                pieces = _split_rows(name, _get_tensor(f, file, name), parts, cfg.hidden_size)
                for (part, _), (key, transpose), tensor in zip(parts, targets, pieces,
                                                               strict=True):
                    if key[-1] in ("scale", "group_scale"):  # (checkpoint_scales)
                        values[key] = checkpoint_scales(part, tensor, expected[key].shape,
                                                        place, key)
                        continue
                    if part.endswith("weight_packed"):  # -> [out, in] of the narrow type
                        tensor = unpack_int32(part, tensor, expected[key].dtype,
                                              expected[key].shape[0])
                    # shapes compared in the checkpoint's layout ([out, in] for a linear layer)
                    want = (tuple(expected[key].shape)[::-1] if transpose
                            else tuple(expected[key].shape))
                    if tuple(tensor.shape) != want:
                        raise ValueError(
                            f"tensor {part!r} has shape {tuple(tensor.shape)} in the checkpoint "
                            f"but the model expects {want}"
                        )
                    tensor = tensor.T if transpose else tensor
                    if _quantized(key, expected, cfg) and tensor.dtype.itemsize == 1:
                        values[key] = narrow(part, tensor, expected[key].dtype, place, key)
                        continue
                    if _quantized(key, expected, cfg):  # quantised as it arrives (quant.py)
                        full = jnp.asarray(tensor) if place is None else place(key, tensor)
                        values[key], values[_scale(key)] = quantize_weight(full, cfg.quantization)
                        full.delete()
                        continue
                    values[key] = (jnp.asarray(tensor, dtype=expected[key].dtype) if place is None
                                   else place(key, tensor).astype(expected[key].dtype))
    for key, parts in pending.items():
        apart = cfg.quantization == "int4" and cfg.quantization_zero_points
        lacking = ("qweight" if "q" not in parts else "qzeros" if (
            cfg.quantization_zero_points and not apart and "z" not in parts) else "g_idx")
        raise ValueError(f"checkpoint {path} is missing {'.'.join(map(str, key))}.{lacking}")
    for key, (_, filled) in experts.items():
        lacking = sorted(set(range(cfg.num_experts)) - filled)
        raise ValueError(f"checkpoint {path} is missing experts {lacking} of "
                         f"{'.'.join(str(p) for p in key[:-1])}")
    missing = [_hf_name(k) for k in expected if k not in values]
    if missing:
        raise ValueError(f"checkpoint {path} is missing tensor(s): {', '.join(missing)}")
    nnx.replace_by_pure_dict(abstract, _nest(values))
    return graphdef, abstract


# Mixtral's names for the MoE block and its experts' projections -> the model's (transformers')
_MIXTRAL_NAMES = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj",
                  "w2": "down_proj"}


def _load_experts(f, file: Path, name: str, cfg: ModelConfig, expected: dict, experts: dict,
                  values: dict, place) -> bool:
    """Whether `name` is a mixture-of-experts tensor, read here: the router (Mixtral's names
    mapped), one expert's projection ([out, in] at experts.E.<proj>.weight, gathered into the
    model's stack [E, in, out], placed once every expert has arrived) or transformers 5's fused
    stacks (experts.gate_up_proj [E, 2 I, H], experts.down_proj [E, H, I])."""
    renamed = [_MIXTRAL_NAMES.get(p, p) for p in name.split(".")]
    if "mlp" not in renamed:
        return False
    where = renamed.index("mlp")
    tail = renamed[where + 1:]
    stem = tuple(int(p) if p.isdigit() else p for p in renamed[:where + 1])

    def put(key: tuple, tensor: np.ndarray) -> None:
        want = tuple(expected[key].shape)
        if tuple(tensor.shape) != want:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)} in the checkpoint "
                             f"but the model expects {want} (as [experts, in, out])")
        values[key] = (jnp.asarray(tensor, dtype=expected[key].dtype) if place is None
                       else place(key, tensor).astype(expected[key].dtype))

    if tail == ["gate", "weight"]:  # the router [E, H]
        key = (*stem, "gate", "kernel")
        put(key, np.asarray(_get_tensor(f, file, name)).T)
        return True
    if len(tail) == 4 and tail[0] == "experts" and tail[1].isdigit() and tail[3] == "weight":
        key = (*stem, "experts", tail[2], "kernel")
        index = int(tail[1])
        if key not in expected or index >= cfg.num_experts:
            raise ValueError(f"checkpoint tensor {name!r} in {file.name} has no place in the "
                             f"{cfg.architecture} model ({cfg.num_experts} experts)")
        tensor = np.asarray(_get_tensor(f, file, name))
        shape = tuple(expected[key].shape)
        if tensor.shape[::-1] != shape[1:]:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)} in the checkpoint "
                             f"but the model expects {shape[1:][::-1]}")
        stack, filled = experts.setdefault(
            key, (np.empty(shape, np.dtype(tensor.dtype)), set()))
        stack[index] = tensor.T
        filled.add(index)
        if len(filled) == cfg.num_experts:
            put(key, experts.pop(key)[0])
        return True
    if tail == ["experts", "gate_up_proj"]:
        fused = np.asarray(_get_tensor(f, file, name))  # [E, 2 I, H]: gate's rows, then up's
        half = fused.shape[1] // 2
        put((*stem, "experts", "gate_proj", "kernel"), fused[:, :half].transpose(0, 2, 1))
        put((*stem, "experts", "up_proj", "kernel"), fused[:, half:].transpose(0, 2, 1))
        return True
    if tail == ["experts", "down_proj"]:  # [E, H, I]
        put((*stem, "experts", "down_proj", "kernel"),
            np.asarray(_get_tensor(f, file, name)).transpose(0, 2, 1))
        return True
    return False


def _hf_name(path: tuple) -> str:
    if path[-1] in ("scale", "group_scale"):
        return ".".join(str(p) for p in (*path[:-1], "weight_scale"))
    if path[-1] in ("zero", "group_zero"):  # GPTQ's and AWQ's zero points
        return ".".join(str(p) for p in (*path[:-1], "qzeros"))
    leaf = "weight" if path[-1] in ("kernel", "embedding") else path[-1]
    return ".".join(str(p) for p in (*path[:-1], leaf))


def is_orbax_checkpoint(path: str | Path) -> bool:
    return (Path(path) / ORBAX_DIR).is_dir()


def save_orbax(path: str | Path, cfg: ModelConfig, state: nnx.State,
               extra_files_from: str | Path | None = None) -> None:
    """Write config.json + params/ (orbax), and copy tokenizer files from `extra_files_from`."""
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    if (path / ORBAX_DIR).exists():
        shutil.rmtree(path / ORBAX_DIR)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path / ORBAX_DIR, nnx.to_pure_dict(state))
    if extra_files_from is not None:
        for name in _TOKENIZER_FILES:
            src = Path(extra_files_from) / name
            if src.is_file():
                shutil.copyfile(src, path / name)  # not the mode: a read-only source stays ours


def load_orbax_state(path: str | Path, cfg: ModelConfig, dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """The checkpoint's full-precision weights; quantised afterwards, one layer at a time,
    where `cfg` says so."""
    import orbax.checkpoint as ocp

    graphdef, abstract = abstract_model(dataclasses.replace(cfg, quantization=None), dtype)
    target = nnx.to_pure_dict(abstract)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(Path(path).resolve() / ORBAX_DIR, target)
    restored = jax.tree.map(lambda x, t: jnp.asarray(x, t.dtype), restored, target)
    if cfg.quantization is not None:
        return _quantize_values(_flat(restored), cfg, dtype)
    nnx.replace_by_pure_dict(abstract, restored)
    return graphdef, abstract


def _quantize_values(values: dict[tuple, jax.Array], cfg: ModelConfig,
                     dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """Full-precision weights by state path -> the quantised model's graph and state, each
    full-precision kernel deleted as its quantised one is made."""
    graphdef, abstract = abstract_model(cfg, dtype)
    expected = _flat(abstract)
    for key in [key for key in values if _quantized(key, expected, cfg)]:
        full = values.pop(key)
        values[key], values[_scale(key)] = quantize_weight(full, cfg.quantization)
        full.delete()
    nnx.replace_by_pure_dict(abstract, _nest(values))
    return graphdef, abstract


def abstract_state(cfg: ModelConfig, dtype, place=None) -> tuple[nnx.GraphDef, nnx.State]:
    """The weights a checkpoint would load, as ShapeDtypeStructs (on their shards, with
    `place`): quantised layers as they are held, nothing allocated. What a compile for a device
    this machine lacks takes (jaxserve/runner/compile_only.py)."""
    return random_state(cfg, dtype, 0, place, shapes_only=True)


def load_state(path: str | Path, cfg: ModelConfig, dtype, load_format: str = "auto",
               seed: int = 0, place=None) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and weights from a directory (HF or orbax) or random ("dummy");
    `place`: as load_hf_state's and random_state's (orbax's arrays are made on the device)."""
    if load_format == "dummy":
        return random_state(cfg, dtype, seed, place)
    if is_orbax_checkpoint(path):
        return load_orbax_state(path, cfg, dtype)
    return load_hf_state(path, cfg, dtype, place)


def state_bytes(state: nnx.State) -> int:
    return sum(array_bytes(x.shape, x.dtype) for x in jax.tree.leaves(state))
