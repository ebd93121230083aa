"""A bf16 checkpoint on the CPU computed in bf16 vs float32: decode and prefill step times.

    python bench/weights_dtype_cpu.py

XLA on the CPU has no fast 16-bit matmul: a bf16 model's step converts its weights every time
it runs. `dtype="auto"` therefore loads a 16-bit checkpoint in float32 on the CPU when float32
weights fit in half the host's memory (`jaxserve.config.engine.compute_dtype`); `dtype="bfloat16"`
keeps it. Model: a 156M-parameter Llama shape (8 layers of 1024, 32k vocabulary), dummy weights.
"""

import json
import tempfile
from pathlib import Path

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.tools.calibrate import profile_output, time_iteration

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 1024,
          "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
          "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 1024,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16"}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(CONFIG))
        print(f"{'dtype':<22}{'2-row decode ms':>16}{'1 x 256 prefill ms':>20}")
        for dtype in ("bfloat16", "auto"):
            engine = LLMEngine(tmp, EngineConfig(
                dtype=dtype, load_format="dummy", max_num_seqs=2, max_num_batched_tokens=256,
                prefill_chunk_sizes=(256,), num_pages=128, enable_prompt_logprobs=False),
                progress=False)
            name = f"{dtype} ({engine.runner.dtype.__name__})"
            decode = 1e3 * time_iteration(engine, profile_output(engine, (2, 200, 1, 0, 0)),
                                          budget_s=1.0)
            prefill = 1e3 * time_iteration(engine, profile_output(engine, (0, 0, 1, 1, 256)),
                                           budget_s=1.0)
            print(f"{name:<22}{decode:>16.1f}{prefill:>20.1f}", flush=True)


if __name__ == "__main__":
    main()
