"""`jaxserve plan MODEL --target T --compile`: the engine compiled for an accelerator this machine
does not have, and what XLA says of it.

The model runner is built for the target's compile-only devices exactly as it would be to serve
there (its backend and kernels, its mesh, the donated KV pool sized from the chip's memory, the
buckets), with shapes in place of arrays (jaxserve/runner/compile_only.py); its warm-up then
compiles every step shape. Reported per device: weights, KV pool, the largest step's
temporaries and their sum against the chip's memory; compile seconds per shape; our kernels in
the compiled steps (a fallback to plain XLA attention is a problem unless asked for); the KV
pool donated (the bytes each step's outputs alias); host transfers inside a step (none belong
there); all-reduces per decode step; and a roofline estimate of decode tokens/s: a step reads
every weight and each row's KV once, at the chip's bandwidth, or is bound by its bf16 peak.
Only config.json is read.
"""

import dataclasses
import math
from pathlib import Path

from jaxserve.config.engine import EngineConfig
from jaxserve.config.model import ModelConfig
from jaxserve.tools.plan import Device, plan
from jaxserve.tools.targets import Target, parse_target, target_devices

# the steps that take the KV pool, and those whose attention is our kernels' (not the head's)
KV_STEPS = ("decode", "prefill", "prefill_with_prompt_logprobs", "ragged", "decode_hidden",
            "prefill_hidden", "verify")
ESTIMATE_CONTEXT = 8192  # tokens of context the estimate's largest batch holds


def target_plan(model: str | Path | None, config: EngineConfig, target_name: str,
                compile: bool = True) -> dict:
    """`plan` for the target's chips, and (compile) every step compiled for them."""
    target = parse_target(target_name)
    tp = config.tensor_parallel_size
    if target.count and tp > target.count:
        raise ValueError(f"tensor_parallel_size {tp}: {target.name} has {target.count} chips")
    device = Device(target.platform, target.device_kind, target.usable_bytes, 0)
    result = plan(model, config, device=device)
    result["target"] = target.name
    result["estimate"] = estimate(result, target)
    if not compile:
        return result
    from jaxserve.engine.model_files import resolve_model
    from jaxserve.runner.model_runner import ModelRunner

    devices = target_devices(target, tp)
    path = resolve_model(model)
    cfg = config.served_model(ModelConfig.from_hf_dir(path))
    sized = dataclasses.replace(config, num_pages=max(result["num_pages"], 2))
    runner = ModelRunner(path, cfg, sized, devices=devices, compile_only=True)
    runner.warmup()
    compiled = {c.name: c for c in runner.fns.compiled}.values()  # a shape compiles once
    kv_bytes = result["kv_cache_bytes"] // tp
    temp = max(c.temp_bytes for c in compiled)
    weights = result["weight_bytes_per_device"]
    sampler = result["sampler_state_bytes"]
    total = weights + kv_bytes + temp + sampler
    kv_steps = [c for c in compiled if c.name.split("[")[0] in KV_STEPS]
    problems = result["problems"]
    if runner.attention_impl == "reference" and config.attention_impl != "reference":
        problems.append(f"attention falls back to plain XLA on {target.name} (the kernels "
                        "cannot take this model's shape): slower; attention_impl=reference "
                        "says it is meant")
    missing = [c.name for c in kv_steps if runner.attention_impl != "reference" and not c.kernels]
    if missing:
        problems.append(f"steps without our attention kernels: {missing}")
    undonated = [c.name for c in kv_steps if c.alias_bytes < kv_bytes]
    if undonated:
        problems.append(f"steps that copy the KV pool instead of updating it in place: "
                        f"{undonated}")
    for name, error in runner.fns.failed.items():
        problems.append(f"{name} does not compile for {target.name}: {error}")
    if any(c.host_calls for c in compiled):
        problems.append("host transfers inside a step: "
                        f"{[c.name for c in compiled if c.host_calls]}")
    fits = total <= target.usable_bytes
    if not fits:
        problems.append(fit_advice(total, target, result))
    decode = [c for c in compiled if c.name.startswith("decode[")]
    result |= {
        "devices": [str(d) for d in devices],
        "backend": runner.backend.name, "attention_impl": runner.attention_impl,
        "scan_layers": runner.scan_layers,
        "compiled": [{"name": c.name, "seconds": round(c.seconds, 3),
                      "temp_bytes": c.temp_bytes, "alias_bytes": c.alias_bytes,
                      "kernels": c.kernels, "all_reduces": c.all_reduces,
                      "host_calls": c.host_calls, "flops": c.flops,
                      "bytes_accessed": c.bytes_accessed, "note": c.note}
                     for c in compiled],
        "compile_seconds": round(sum(c.seconds for c in compiled), 3),
        "per_device_bytes": {"weights": weights, "kv": kv_bytes, "temp": temp,
                             "sampler": sampler, "total": total,
                             "capacity": target.usable_bytes},
        "fits": fits, "failed": runner.fns.failed,
        "kernels": {"attention": runner.attention_impl,
                    "steps_with_kernels": sum(1 for c in kv_steps if c.kernels),
                    "kv_steps": len(kv_steps)},
        "all_reduces_per_decode_step": max((c.all_reduces for c in decode), default=0),
        # the model's forward alone (a decode call without its head): the sums the design
        # puts in each layer, and the embedding's
        "all_reduces_per_forward": max((c.all_reduces for c in compiled
                                        if c.name.startswith("decode_hidden[")), default=0),
    }
    result["estimate"]["xla"] = xla_costs(compiled, result)
    return result


def xla_costs(compiled, p: dict) -> list[dict]:
    """XLA's cost analysis of the model's forward per decode bucket beside the estimate's own
    counts (flops: 2 a parameter a row; bytes: the weights and each row's KV at 8,192 tokens).
    The estimate keeps its own: XLA counts a scanned layer stack's body once (its flops are
    the forward's / num_layers then: scaled back here) and every byte of the operands our
    kernels take, the whole KV pool included, as read. None where XLA gives nothing (GPUs)."""
    tp, layers = p["tensor_parallel_size"], p["layers"]
    active = p["num_params"] - p.get("expert_params", 0) * (
        1 - p["experts_per_token"] / p["num_experts"] if p.get("num_experts") else 0)
    rows = []
    for c in sorted(compiled, key=lambda c: c.name):
        if not c.name.startswith("decode_hidden[") or c.flops is None:
            continue
        batch = int(c.name.split("[")[1].split("]")[0])
        flops = c.flops * (layers if p["scan_layers"] else 1)
        rows.append({"rows": batch, "xla_flops": flops, "model_flops": 2 * active * batch / tp,
                     "xla_bytes": c.bytes_accessed,
                     "model_bytes": p["weight_bytes_per_device"]
                     + batch * p["estimate"]["context"] * p["kv_bytes_per_token"] / tp})
    return rows


def estimate(p: dict, target: Target) -> dict:
    """Decode tokens/s by the roofline: a step of b rows reads the device's weights once and
    each row's KV of `context` tokens, at the chip's bandwidth; or takes 2 flops a parameter
    a row at its bf16 peak, whichever is longer. A MoE step reads only the experts its rows
    route to (b rows choosing k of E each touch E * (1 - (1 - k/E)^b) of them, expected) and
    a row multiplies by k of them. At batch 1, and at the largest batch whose KV fits at
    min(8,192, max_model_len) tokens (and max_num_seqs)."""
    tp = p["tensor_parallel_size"]
    context = min(ESTIMATE_CONTEXT, p["max_model_len"])
    fit = next((r["sequences_that_fit"] for r in p["concurrency"] if r["context"] == context),
               p["usable_pages"] // max(math.ceil(context / p["page_size"]), 1))
    max_batch = max(min(fit, p["max_num_seqs"]), 0)
    experts, k = p.get("num_experts", 0), p.get("experts_per_token", 0)
    share = p.get("expert_params", 0) / p["num_params"] if experts else 0.0
    expert_bytes = p["weight_bytes_per_device"] * share  # (the weights' bytes a parameter alike)

    def tok_s(batch: int) -> float:
        if batch <= 0:
            return 0.0
        touched = 1 - (1 - k / experts) ** batch if experts else 1.0
        read = (p["weight_bytes_per_device"] - expert_bytes * (1 - touched)
                + batch * context * p["kv_bytes_per_token"] / tp)
        active = p["num_params"] - p.get("expert_params", 0) * (1 - k / experts if experts else 0)
        flops = 2 * active * batch / tp
        return batch / max(read / target.bandwidth, flops / target.peak_flops)

    return {"context": context, "decode_tok_s_batch1": round(tok_s(1), 1),
            "decode_tok_s_max": round(tok_s(max_batch), 1), "max_batch": max_batch,
            "bandwidth": target.bandwidth, "peak_flops": target.peak_flops}


def fit_advice(total: int, target: Target, p: dict) -> str:
    """How far over the chip's memory, and what would bring it under."""
    over = total - target.usable_bytes
    tp = p["tensor_parallel_size"]
    ways = [f"tensor_parallel_size {tp * 2}"]
    if p["max_model_len"] > 2048:
        ways.append(f"max_model_len {p['max_model_len'] // 2}")
    if not p["quantization"]:
        ways.append("quantization int8 or fp8 (half the weights)")
    return (f"needs {total / 2**30:.2f} GiB a device, {over / 2**30:.2f} GiB more than "
            f"the {target.usable_bytes / 2**30:.2f} GiB a process has of {target.name}: try {', or '.join(ways)}")


def format_target_plan(p: dict) -> str:
    lines = [f"target     {p['target']} ({p['device']['name']}, "
             f"{p['device']['bytes_limit'] / 2**30:.1f} GiB a chip), tensor_parallel_size "
             f"{p['tensor_parallel_size']}"]
    if "compiled" in p:
        b = p["per_device_bytes"]
        lines.append(f"compiled   {len(p['compiled'])} step shapes in {p['compile_seconds']:.1f} s; "
                     f"backend {p['backend']} (attention {p['attention_impl']}), kernels in "
                     f"{p['kernels']['steps_with_kernels']} of {p['kernels']['kv_steps']} "
                     f"steps that attend; all-reduces: {p['all_reduces_per_forward']} in the "
                     f"model's forward, {p['all_reduces_per_decode_step']} in a decode step "
                     "with sampling")
        lines.append("per device " + ", ".join(
            f"{k} {v / 2**30:.2f} GiB" for k, v in b.items()) + (
            " (fits)" if p["fits"] else " (does not fit)"))
        for c in p["compiled"]:
            lines.append(f"  {c['name']:<44} {c['seconds']:7.2f} s  temp "
                         f"{c['temp_bytes'] / 2**20:8.1f} MiB  kernels {c['kernels']}"
                         + (f"  ({c['note']})" if c["note"] else ""))
    e = p["estimate"]
    lines.append(f"estimate   decode {e['decode_tok_s_batch1']:.1f} tok/s at batch 1, "
                 f"{e['decode_tok_s_max']:.1f} at batch {e['max_batch']} ({e['context']} "
                 "tokens of context; the roofline of the chip's bandwidth and bf16 peak)")
    for x in e.get("xla", []):
        lines.append(f"  XLA's cost of the forward at {x['rows']} rows: "
                     f"{x['xla_flops'] / 1e9:.2f} GFLOP (the estimate's "
                     f"{x['model_flops'] / 1e9:.2f}), {x['xla_bytes'] / 2**30:.2f} GiB accessed "
                     f"(the estimate's {x['model_bytes'] / 2**30:.2f}: XLA counts the whole "
                     "KV pool)")
    return "\n".join(lines)  # (the problems: format_plan's lines)
