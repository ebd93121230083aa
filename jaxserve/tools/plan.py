"""`jaxserve plan MODEL`: the memory arithmetic of serving a model, without loading it.

    weights      parameter bytes in float32 / bfloat16 / float16 (from the model's abstract
                 shapes: the same leaves the runner loads, nothing allocated)
    KV cache     bytes per token = 2 (K and V) x layers x kv_heads x head_dim x dtype bytes;
                 a page holds page_size tokens; page 0 is the null page
    sizing       as the runner does it: num_pages, else (GPU) free memory after the weights x
                 kv_cache_memory_fraction, (CPU) kv_cache_bytes_cpu x the fraction
    concurrency  sequences of a given context that fit at once: usable pages // pages per
                 sequence, and what max_num_seqs lets run
"""

import math
from dataclasses import dataclass
from pathlib import Path

from jaxserve.config.engine import (
    EngineConfig,
    compute_dtype,
    host_memory_bytes,  # the cgroup's limit when lower: what the engine sizes itself by
    kv_cache_dtype,
)
from jaxserve.config.model import SUPPORTED_DTYPES, ModelConfig
from jaxserve.request import MAX_LOGIT_BIAS


@dataclass(frozen=True)
class Device:
    backend: str
    name: str
    bytes_limit: int | None  # accelerator memory (None on CPU)
    bytes_in_use: int | None


def this_device() -> Device:
    import jax

    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform in ("gpu", "tpu") else None
    return Device(device.platform, getattr(device, "device_kind", str(device)),
                  stats["bytes_limit"] if stats else None, stats["bytes_in_use"] if stats else None)


def weight_bytes(cfg: ModelConfig, dtype: str) -> int:
    from jaxserve.model.loader import abstract_model, state_bytes
    from jaxserve.runner.model_runner import DTYPES

    return state_bytes(abstract_model(cfg, DTYPES[dtype])[1])


def weight_bytes_per_device(cfg: ModelConfig, dtype: str, tp: int) -> int:
    """One device's weights under tensor_parallel_size `tp` (jaxserve/parallel/sharding.py): each split
    weight's 1/tp (k_proj and v_proj with their heads repeated where fewer than tp), the
    norms whole."""
    import jax

    from jaxserve.model.loader import abstract_model
    from jaxserve.model.quant import array_bytes
    from jaxserve.parallel.sharding import path_names, weight_spec
    from jaxserve.runner.model_runner import DTYPES

    repeats = max(tp // cfg.num_kv_heads, 1)
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_model(cfg, DTYPES[dtype])[1]):
        names = path_names(path)
        size = array_bytes(leaf.shape, leaf.dtype)
        if any(n in ("k_proj", "v_proj") for n in names):
            size *= repeats
        split = any(weight_spec(names, leaf.ndim))
        total += size // tp if split else size
    return total


def kv_bytes_per_token(cfg: ModelConfig, dtype: str, tp: int = 1,
                       head_dim: int | None = None) -> int:
    """All devices' shares together (KV heads repeated to one a device where fewer than tp);
    `head_dim`: the pool's where it pads the model's."""
    from jaxserve.backends import REFERENCE
    from jaxserve.model.kv_cache import KVCache
    from jaxserve.parallel.sharding import kv_heads_per_device

    heads = cfg.num_kv_heads if tp == 1 else kv_heads_per_device(cfg, tp) * tp
    return KVCache.bytes_per_page(cfg.num_layers, 1, heads, head_dim or cfg.head_dim,
                                  REFERENCE.attention.pool_dtype(dtype))


def sampler_state_bytes(vocab_size: int, max_num_seqs: int) -> int:
    """The device state of the sampler controls (runner.sampler_state): per slot (max_num_seqs
    and the padding slot), token counts (int32) and prompt-token flags (bool) over the
    vocabulary, and logit_bias's MAX_LOGIT_BIAS ids (int32) and values (float32)."""
    return (max_num_seqs + 1) * (vocab_size * (4 + 1) + MAX_LOGIT_BIAS * (4 + 4))


def plan(model: str | Path | None, config: EngineConfig, contexts: list[int] | None = None,
         device: Device | None = None) -> dict:
    """The numbers `jaxserve plan` prints, as a dict."""
    from jaxserve.engine.model_files import resolve_model

    path = resolve_model(model)
    cfg = config.served_model(ModelConfig.from_hf_dir(path))
    device = device or this_device()
    from jaxserve.backends import resolve_attention_impl
    from jaxserve.parallel.sharding import check_tensor_parallel
    from pallas_kernels.tpu_attention import lane_padded

    dtype = compute_dtype(config.dtype, cfg.dtype, device.backend, cfg.num_params,
                          config.kv_cache_bytes_cpu)
    attention = resolve_attention_impl(config.attention_impl, device.backend, cfg.head_dim,
                                       config.page_size)
    kv_dtype = kv_cache_dtype(dtype, device.backend, attention, config.kv_cache_dtype)
    weights = {dt: weight_bytes(cfg, dt) for dt in SUPPORTED_DTYPES}
    tp = config.tensor_parallel_size
    problems = []
    try:  # the devices are the serving machine's, not necessarily this one's
        check_tensor_parallel(cfg, tp, tp, config.enable_expert_parallel)
    except ValueError as error:
        problems.append(str(error))
        tp = 1
    held = cfg  # the model as the backend holds it
    if device.backend == "cpu" and (cfg.quantization_group_size is not None
                                    or cfg.embedding_quantization is not None):
        from jaxserve.backends.select import resolve_matmul_impl

        try:
            cpu_kernels = resolve_matmul_impl(config.matmul_impl, "cpu", dtype) != "xla"
        except ValueError:  # the engine would refuse it: say nothing more here
            cpu_kernels = False
        if cpu_kernels:  # its kernels take float weights: group-wise layers dequantised once
            held = cfg.unquantized()
            weights = {dt: weight_bytes(held, dt) for dt in SUPPORTED_DTYPES}
    weights_per_device = weight_bytes_per_device(held, dtype, tp)
    # the TPU kernel's pool pads a head to whole lanes (backends/tpu.py)
    kv_head_dim = lane_padded(cfg.head_dim) if attention == "tpu" else cfg.head_dim
    per_token = kv_bytes_per_token(cfg, kv_dtype, tp, kv_head_dim)
    per_page = per_token * config.page_size
    max_len = config.resolve_max_model_len(cfg)
    if device.bytes_limit is not None:  # the runner sizes after loading the weights
        # each device holds its 1/tp share of every page
        free = (device.bytes_limit - device.bytes_in_use - weights_per_device) * tp
        source = "free accelerator memory after the weights"
    else:
        free = config.kv_cache_bytes_cpu
        source = "kv_cache_bytes_cpu"
    budget = int(max(free, 0) * config.kv_cache_memory_fraction)
    num_pages = config.num_pages or budget // per_page
    usable = max(num_pages - 1, 0)
    pages_per_seq = config.pages_per_seq(max_len)
    contexts = sorted(set(contexts or _default_contexts(max_len)))
    for ctx in contexts:
        if not 1 <= ctx <= max_len:  # the engine refuses a longer request outright
            raise ValueError(f"context {ctx} (--context) must be between 1 and max_model_len "
                             f"{max_len}")
    rows = []
    for ctx in contexts:
        need = math.ceil(ctx / config.page_size)
        fit = usable // need
        rows.append({"context": ctx, "pages_per_sequence": need, "sequences_that_fit": fit,
                     "sequences_running": min(fit, config.max_num_seqs)})
    if config.num_pages:  # a pool the memory cannot hold fails at start-up
        if device.bytes_limit is not None:
            room, where = free, ("free accelerator memory after the weights" if tp == 1 else
                                 f"{tp} devices' free memory after their weights")
        else:
            room, where = host_memory_bytes() - weights[dtype], "host memory after the weights"
        if num_pages * per_page > room:
            problems.append(f"num_pages {num_pages} x {per_page} bytes a page = "
                            f"{_size(num_pages * per_page)} exceeds the {where} "
                            f"({_size(max(room, 0))}): the engine could not allocate it")
    if free <= 0:
        problems.append(f"the weights ({weights[dtype]} bytes) do not fit in this device's "
                        "free memory")
    elif usable < pages_per_seq:
        problems.append(f"{usable} usable pages hold fewer than the {pages_per_seq} pages one "
                        f"sequence of max_model_len {max_len} needs: the engine would refuse "
                        "to start")
    return {
        "model": str(path), "architecture": cfg.architecture, "num_params": cfg.num_params,
        # the routed experts' parameters, of which a token reads experts_per_token of num_experts
        "expert_params": cfg.num_layers * cfg.hidden_size * 3 * cfg.num_experts
        * cfg.moe_intermediate_size,
        "num_experts": cfg.num_experts, "experts_per_token": cfg.num_experts_per_tok,
        "layers": cfg.num_layers, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "kv_head_dim": kv_head_dim,
        "quantization_scales": (
            f"float16 scales{' and minima' if cfg.quantization_offsets else ''} a group of "
            f"{cfg.quantization_group_size} (GGUF blocks; the embedding "
            f"{cfg.embedding_quantization or 'in the dtype'})"
            if cfg.quantization_format == "gguf" else
            "float32 column scales (embedding and LM head in the dtype)")
        + (f"; the CPU kernels hold them dequantised to {dtype}, once at load"
           if held is not cfg else ""),
        "dtype": dtype, "checkpoint_dtype": cfg.dtype, "kv_dtype": kv_dtype,
        "quantization": cfg.quantization, "weight_bytes": weights, "tensor_parallel_size": tp,
        "weight_bytes_per_device": weights_per_device,
        "kv_bytes_per_page_per_device": per_page // tp,
        "kv_bytes_per_token": per_token, "page_size": config.page_size,
        "kv_bytes_per_page": per_page,
        "device": {"backend": device.backend, "name": device.name,
                   "bytes_limit": device.bytes_limit, "bytes_in_use": device.bytes_in_use},
        "kv_budget_source": "num_pages" if config.num_pages else source,
        "kv_budget_bytes": num_pages * per_page if config.num_pages else budget,
        "num_pages": num_pages, "usable_pages": usable, "kv_tokens": usable * config.page_size,
        "kv_cache_bytes": num_pages * per_page, "max_model_len": max_len,
        "pages_per_max_len_sequence": pages_per_seq, "max_num_seqs": config.max_num_seqs,
        "sampler_state_bytes": sampler_state_bytes(cfg.vocab_size, config.max_num_seqs),
        "concurrency": rows, "problems": problems,
        "data_parallel_size": config.data_parallel_size,
        "devices": config.data_parallel_size * tp,
    }


def _default_contexts(max_len: int) -> list[int]:
    return [c for c in (512, 2048, 8192, 32768) if c < max_len] + [max_len]


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_plan(p: dict) -> str:
    lines = [f"model      {p['model']} ({p['architecture']}, {p['num_params'] / 1e6:.1f}M "
             f"parameters, {p['layers']} layers, {p['kv_heads']} KV heads x {p['head_dim']})"]
    lines.append("weights    " + ", ".join(
        f"{dt} {_size(b)}" + (" (used)" if dt == p["dtype"] else "")
        for dt, b in p["weight_bytes"].items())
        + (f"; the checkpoint is {p['checkpoint_dtype']}"
           if p["checkpoint_dtype"] != p["dtype"] else "")
        + (f"; linear layers {p['quantization']} with {p['quantization_scales']}"
           if p["quantization"] else ""))
    padded = (f" padded to {p['kv_head_dim']} lanes" if p["kv_head_dim"] != p["head_dim"]
              else "")
    lines.append(f"KV cache   {_size(p['kv_bytes_per_token'])} per token ({p['kv_dtype']}: 2 x "
                 f"{p['layers']} layers x {p['kv_heads']} heads x {p['head_dim']}{padded}), "
                 f"{_size(p['kv_bytes_per_page'])} per page of {p['page_size']} tokens")
    if p["tensor_parallel_size"] > 1:
        lines.append(f"tensor par {p['tensor_parallel_size']} devices, each holding "
                     f"{_size(p['weight_bytes_per_device'])} of the weights and "
                     f"{_size(p['kv_bytes_per_page_per_device'])} of each page")
    if p["data_parallel_size"] > 1:
        dp = p["data_parallel_size"]
        lines.append(f"data par   {dp} replicas on {p['devices']} devices, each with the pool "
                     f"below: {dp * p['kv_tokens']} tokens and {dp * p['max_num_seqs']} "
                     "sequences at once in all")
    d = p["device"]
    memory = (f", {_size(d['bytes_limit'])} total, {_size(d['bytes_in_use'])} in use"
              if d["bytes_limit"] is not None else "")
    lines.append(f"device     {d['backend']} ({d['name']}{memory})")
    lines.append(f"sizing     {_size(p['kv_budget_bytes'])} from {p['kv_budget_source']} -> "
                 f"{p['num_pages']} pages ({p['usable_pages']} usable, page 0 is null) = "
                 f"{p['kv_tokens']} tokens, {_size(p['kv_cache_bytes'])}")
    lines.append(f"           max_model_len {p['max_model_len']} = "
                 f"{p['pages_per_max_len_sequence']} pages per sequence; max_num_seqs "
                 f"{p['max_num_seqs']}")
    lines.append(f"sampler    {_size(p['sampler_state_bytes'])} of per-slot state for the "
                 "sampler controls (token counts, prompt tokens, logit_bias), beside the KV "
                 "cache")
    lines.append(f"{'context':>10} {'pages/seq':>10} {'seqs that fit':>14} {'seqs running':>13}")
    for r in p["concurrency"]:
        lines.append(f"{r['context']:>10} {r['pages_per_sequence']:>10} "
                     f"{r['sequences_that_fit']:>14} {r['sequences_running']:>13}")
    lines += [f"problem    {msg}" for msg in p["problems"]]
    return "\n".join(lines)
