"""config.json's quantization_config: which pre-quantised layout a checkpoint's linear layers
hold (compressed-tensors, GPTQ, AWQ) and whether jaxserve reads it, as vLLM reads them; what
`ModelConfig` records of it. Host only: no jax here."""

from typing import Any, NamedTuple


class CheckpointQuantization(NamedTuple):
    """What ModelConfig records of a checkpoint's quantization_config."""

    quantization: str | None = None  # what its weights carry; None: float weights
    group_size: int | None = None  # its group-wise scales' rows; None: a scale per column
    format: str | None = None  # its layout (ModelConfig.quantization_format)
    bits: int | None = None  # GPTQ's and AWQ's packed values' width
    zero_points: bool = False  # GPTQ's and AWQ's zero points
    act_order: bool = False  # GPTQ desc_act: each group's rows scattered over the input
    # compressed-tensors' kv_cache_scheme: each attention layer's per-tensor scales of an fp8
    # KV cache (k_scale, v_scale), used when kv_cache_dtype is fp8
    kv_cache_scales: bool = False
    offsets: bool = False  # GGUF's Q4_1: a minimum a group added (w = q * scale + min)
    embedding: str | None = None  # GGUF: the token embedding's narrow type (None: float)
    embedding_offsets: bool = False


# GGUF's block types the model holds as they are (config/gguf.py decides which a file uses)
GGUF_METHODS = ("int8", "int4")


def _read_gguf(quant: dict) -> CheckpointQuantization:
    """config/gguf.py's quantization_config for a GGUF file whose blocks stay quantised:
    {"quant_method": "gguf", "weights": int8|int4|null, "offsets": bool,
    "embedding": int8|int4|null, "embedding_offsets": bool}, groups of 32."""
    weights, embedding = quant.get("weights"), quant.get("embedding")
    for key, value in (("weights", weights), ("embedding", embedding)):
        if value not in (None, *GGUF_METHODS):
            raise ValueError(f"quantization_config {key} {value!r}: GGUF blocks are held as "
                             f"{' or '.join(GGUF_METHODS)}")
    return CheckpointQuantization(weights, 32, "gguf", None, False, False, False,
                                  bool(quant.get("offsets")), embedding,
                                  bool(quant.get("embedding_offsets")))


def _read_kv_cache_scheme(scheme: Any) -> bool:
    """compressed-tensors' kv_cache_scheme, as vLLM reads it: 8-bit floats, one static
    symmetric scale per tensor (each layer's k_scale and v_scale); None: no scales."""
    if scheme is None:
        return False
    if not isinstance(scheme, dict) or scheme.get("type") != "float" or (
            scheme.get("num_bits") != 8 or scheme.get("strategy") != "tensor"
            or scheme.get("symmetric") is False or scheme.get("dynamic")):
        raise ValueError(f"quantization_config kv_cache_scheme {scheme!r} is not read; "
                         "supported: 8-bit float, strategy tensor, symmetric, static (one "
                         "k_scale and v_scale per layer)")
    return True

# compressed-tensors' (format, weights' type, bits) -> the quantization they carry
_COMPRESSED_WEIGHTS = {("float-quantized", "float", 8): "fp8", ("int-quantized", "int", 8): "int8",
                       ("pack-quantized", "int", 8): "int8", ("pack-quantized", "int", 4): "int4"}


def _read_packed(quant: dict) -> CheckpointQuantization:
    """A GPTQ (AutoGPTQ's, GPTQModel's) or AWQ (AutoAWQ's GEMM) checkpoint's
    quantization_config: 4- or 8-bit weights in groups of input rows (group_size; -1: a scale
    per column), GPTQ's symmetric or with zero points (sym false, 4 bits) and maybe in
    act-order (desc_act: a row's group is its g_idx), AWQ's with zero points. Weights with
    zero points are held as uint4 beside their uint4 zero points (GPTQ's "gptq" format's: as
    int8, value - zero)."""
    method = quant["quant_method"]
    bits, group = quant.get("bits", quant.get("w_bit")), quant.get(
        "group_size", quant.get("q_group_size", -1))
    if method == "gptq":
        fmt, zero_points = quant.get("checkpoint_format") or "gptq", quant.get("sym") is False
    else:
        fmt, zero_points = "awq", bool(quant.get("zero_point", True))
    problem = None
    if bits not in (4, 8):
        problem = f"bits {bits!r} (4 or 8 are read)"
    elif not isinstance(group, int) or not (group == -1 or group > 0):
        problem = f"group_size {group!r}"
    elif fmt not in ("gptq", "gptq_v2", "awq"):
        problem = f"checkpoint_format {fmt!r}"
    elif method == "awq" and (quant.get("version") or "gemm").lower() != "gemm":
        problem = f"version {quant.get('version')!r} (gemm is read)"
    elif method == "awq" and not zero_points:
        problem = "zero_point false"
    elif zero_points and bits != 4:
        problem = f"{bits}-bit weights with zero points"
    if problem:
        raise ValueError(f"quantization_config ({method}): {problem}: not read; supported: GPTQ "
                         "checkpoints with 4- or 8-bit weights (4-bit with zero points too), "
                         "act-order or not, format gptq or gptq_v2; AWQ GEMM checkpoints with "
                         "4-bit weights and zero points")
    # 4-bit weights with zero points are held as uint4 values and uint4 zero points, except
    # the "gptq" format's: its zero points are stored minus one, so a zero point of 0 reads back
    # as 16, which only value - zero held in int8 keeps
    held = "int4" if bits == 4 and (not zero_points or fmt != "gptq") else "int8"
    # act-order over one group (a scale per column) orders nothing
    act_order = bool(quant.get("desc_act")) and method == "gptq" and group != -1
    return CheckpointQuantization(held, None if group == -1 else group, fmt, bits, zero_points,
                                  act_order)


def read_quantization(quant: Any) -> CheckpointQuantization:
    """config.json's quantization_config -> what its weights carry (all None: float weights).
    GPTQ and AWQ checkpoints: `_read_packed`.
    Else read as vLLM reads them:
    compressed-tensors checkpoints whose linear layers hold weights with a scale per output
    channel or per tensor ("float-quantized": fp8 e4m3; "int-quantized": int8;
    "pack-quantized": int4 or int8 packed into int32 words, as W4A16 checkpoints hold them,
    whose scales may also be group-wise), symmetric, the LM head left in float. Their
    activation settings are not applied: the weights are dequantised inside the matmul
    (weight-only). Anything else is a clear error naming what it holds."""
    if not quant:
        return CheckpointQuantization()
    if isinstance(quant, dict) and quant.get("quant_method") in ("gptq", "awq"):
        return _read_packed(quant)
    if isinstance(quant, dict) and quant.get("quant_method") == "gguf":
        return _read_gguf(quant)
    supported = ("supported: compressed-tensors checkpoints with fp8, int8 or int4 weights "
                 "per channel or per tensor (int4 also per group), symmetric; GPTQ and AWQ "
                 "checkpoints (see their errors); or float weights with the quantization "
                 "option")
    if not isinstance(quant, dict) or quant.get("quant_method") != "compressed-tensors":
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(f"quantization_config quant_method {method!r} is not read; {supported}")
    kv_scales = _read_kv_cache_scheme(quant.get("kv_cache_scheme"))
    groups = quant.get("config_groups") or {}
    if kv_scales and not groups:  # float weights, the KV cache's scales alone
        return CheckpointQuantization(kv_cache_scales=True)
    fmt = quant.get("format")
    if fmt not in ("float-quantized", "int-quantized", "pack-quantized"):
        raise ValueError(f"quantization_config format {fmt!r} is not read; {supported}")
    method, group_size = None, None
    if not isinstance(groups, dict):
        raise ValueError(f"quantization_config config_groups must be a mapping, got {groups!r}")
    for name, group in groups.items():
        group = group if isinstance(group, dict) else {}
        weights = group.get("weights") if isinstance(group.get("weights"), dict) else {}
        if group.get("format", fmt) != fmt:
            raise ValueError(f"quantization_config config_groups.{name}.format "
                             f"{group.get('format')!r} differs from the checkpoint's {fmt!r}; "
                             f"{supported}")
        found = _COMPRESSED_WEIGHTS.get((fmt, weights.get("type"), weights.get("num_bits")))
        grouped = weights.get("strategy") == "group"
        size = weights.get("group_size") if grouped else None
        if grouped and (fmt != "pack-quantized" or not isinstance(size, int) or size <= 0
                        or weights.get("actorder")):
            raise ValueError(f"quantization_config config_groups.{name}.weights: group-wise "
                             f"scales are read for pack-quantized weights with a positive "
                             f"group_size and no actorder, got {weights}; {supported}")
        if (found is None or found != (method or found) or (method and size != group_size)
                or weights.get("strategy") not in ("channel", "tensor", "group")
                or weights.get("symmetric") is False or weights.get("dynamic")):
            raise ValueError(f"quantization_config config_groups.{name}.weights {weights} is "
                             f"not read; {supported}")
        method, group_size = found, size
    if not groups:
        raise ValueError(f"quantization_config has no config_groups; {supported}")
    ignore = quant.get("ignore") or []
    ignored = [name for name in (ignore if isinstance(ignore, list) else [ignore])
               if not str(name).endswith("lm_head")]
    if ignored:
        raise ValueError(f"quantization_config ignore leaves {ignored} unquantised: only lm_head "
                         f"may be; {supported}")
    return CheckpointQuantization(method, group_size, "compressed-tensors",
                                  kv_cache_scales=kv_scales)
