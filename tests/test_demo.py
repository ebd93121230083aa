"""The built-in demo model: the shipped checkpoint loads offline and writes Python-ish text, its
prompt logprobs equal a direct forward pass, its report meets the goal, and training still runs."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.config.model import ModelConfig
from jaxserve.demo import demo_model_dir
from jaxserve.demo.data import is_validation, source_files, stdlib_root
from jaxserve.demo.train import REPORT_FILE, causal_logits
from jaxserve.demo.train import main as train_main
from jaxserve.engine.model_files import resolve_model
from jaxserve.model.loader import load_state

# One row bucket keeps the warm-up to five compiles.
SMALL = dict(max_num_seqs=1, prefill_chunk_sizes=(16, 64), page_size=16, num_pages=32,
             max_num_batched_tokens=64, max_model_len=256)
GREEDY_64 = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
SNIPPET = ("import os\n\n\ndef read_lines(path):\n    \"\"\"Return the lines of a file.\"\"\"\n"
           "    with open(path) as f:\n        return f.read().splitlines()\n")


@pytest.fixture(scope="module")
def llm():
    return LLM(**SMALL)


def test_none_and_demo_name_the_shipped_checkpoint():
    assert resolve_model(None) == resolve_model("demo") == demo_model_dir()
    cfg = ModelConfig.from_hf_dir(demo_model_dir())
    assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_ids) == (258, 256, (257,))


# Bare, as a user would type it: the model must start the body on a new, indented line (trained
# on prompt-shaped windows, see jaxserve/demo/data.py), not fall into a run of spaces.
FIB = "def fibonacci(n):"


def test_greedy_text_for_a_python_prompt(llm):
    out = llm.generate(FIB, GREEDY_64)[0].outputs[0]
    assert len(out.token_ids) == 64
    ids = [t for t in out.token_ids if t < 256]
    assert out.text == bytes(ids).decode("utf-8")  # valid UTF-8, nothing replaced
    assert sum(c.isalpha() for c in out.text) >= 10
    assert re.match(r"\n +\S", out.text), out.text
    # LLM(model="demo") is the same model: the same greedy text.
    again = LLM(model="demo", **SMALL).generate(FIB, GREEDY_64)[0].outputs[0]
    assert again.token_ids == out.token_ids


def test_prompt_logprobs_equal_a_direct_forward(llm):
    """What users measure perplexity with: prompt_logprobs through the paged engine (two prefill
    chunks) against log-softmax of the training forward on the same ids."""
    ids = llm.get_tokenizer().encode(SNIPPET)
    assert len(ids) > 64
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    assert out.prompt_logprobs[0] is None
    ours = np.array([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], ids[1:],
                                                    strict=True)])

    cfg = ModelConfig.from_hf_dir(demo_model_dir())
    graphdef, state = load_state(demo_model_dir(), cfg, jnp.float32)
    logits = causal_logits(nnx.merge(graphdef, state), jnp.array([ids]))[0]
    direct = jax.nn.log_softmax(logits, axis=-1)[np.arange(len(ids) - 1), np.array(ids[1:])]
    np.testing.assert_allclose(ours, np.asarray(direct), atol=1e-4, rtol=0)


def test_training_report_meets_the_goal():
    report = json.loads((demo_model_dir() / REPORT_FILE).read_text())
    assert report["val_bits_per_byte"] <= 2.0
    assert report["steps"] > 0 and report["tokens_seen"] > 0
    config = json.loads((demo_model_dir() / "config.json").read_text())
    assert report["model"] == config


def test_validation_split_is_a_stable_twentieth_of_the_files():
    files = source_files(stdlib_root())
    held_out = [f for f in files if is_validation(f)]
    assert 0.02 < len(held_out) / len(files) < 0.1
    assert is_validation("json/decoder.py") == is_validation("json/decoder.py")


def test_training_script_runs_and_its_checkpoint_serves(tmp_path):
    assert train_main(["--config", "tiny", "--steps", "3", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / REPORT_FILE).read_text())
    assert report["steps"] == 3 and np.isfinite(report["val_bits_per_byte"])
    out = LLM(tmp_path, **(SMALL | dict(max_model_len=None))).generate("def f(x):", SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8


def test_no_compilation_after_warmup_with_requests_joining_and_leaving():
    """Every shape a mixed workload reaches is compiled at start-up: the carries and KV cache the
    steps return are committed to the device, and so are the ones the runner starts from (an
    uncommitted start made jit compile each step a second time)."""
    llm = LLM(**(SMALL | dict(max_num_seqs=4, num_pages=128, max_num_batched_tokens=128)))
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 256, size=int(n)).tolist()}
               for n in (5, 60, 17, 33, 2, 64, 40, 9)]
    params = [SamplingParams(max_tokens=int(m), temperature=0.0, ignore_eos=True)
              for m in (3, 9, 1, 6, 12, 2, 5, 8)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    assert llm.stats()["num_compilations_after_warmup"] == 0
