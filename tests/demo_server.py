"""What jaxserve's port of vLLM's OpenAI-server tests shares: one `jaxserve serve` on the demo
model (a session fixture in conftest.py) and its helpers. The port (vllm-project/vllm,
tests/entrypoints/openai/) is test_vllm_completions.py, test_vllm_chat.py and
test_vllm_params_metrics.py, run with the official `openai` client and httpx against one
`jaxserve serve` subprocess on the built-in demo model (byte-level tokenizer, served as "demo"),
whose API key is the test server's (served.KEY), so conftest's `client` and `http` serve both.
Same checks as vLLM's, our code;
where vLLM's model does something the demo cannot (stop on its own, end samples at different
lengths), the request gets a stop string so that the assertion keeps its meaning.

Ported (vLLM file: its cases):
- basic/test_basic.py: check_health, request_cancellation, request_wrong_content_type.
- chat_completion/test_root_path.py: the API key cases (a wrong key is 401, the right one serves).
- models (`client.models.list()`): the served name, its root and max_model_len.
- completion/test_completion.py: single_completion, no/zero/some_logprobs,
  too_many_completion_logprobs, prompt_logprobs_completion (-1, 0, 1, None),
  completion_streaming, parallel_no_streaming, parallel_streaming, completion_stream_options,
  batch_completions (n=2 by seeded sampling: beam search is not ours),
  echo_logprob_completion, and truncate_prompt_tokens (its left side: the only side we have).
- completion/test_completion_text_offset.py: streamed text offsets equal the whole response's.
- completion/test_prompt_validation.py, test_empty_prompt_list.py, test_completion_error.py:
  a missing or empty prompt, token ids outside the vocabulary, negative token ids: 400.
- chat_completion/test_chat.py: no/zero/some_logprobs_chat, too_many_chat_logprobs,
  prompt_logprobs_chat, more_than_one_prompt_logprobs_chat, single_chat_session,
  chat_streaming, chat_completion_stream_options, extra_fields_allowed (in a message),
  complex_message_content, custom_role, long_seed, response_format_text, the n parameter.
- chat_completion/test_chat_echo.py: echo with continue_final_message, prompt_logprobs of -1,
  top_logprobs of -1 (the server runs with max_top_logprobs = the vocabulary, as vLLM's with
  --max-logprobs; the limit itself is tested one past it).
- chat_completion/test_chat_stop_token_ids_validation.py: valid, out of vocabulary, negative.
- chat_completion/test_non_object_body_validation.py: a body that is no JSON object is a 400.
- basic/test_chat_template.py, as the server shows it: add_generation_prompt and
  continue_final_message change the rendered prompt (counted in usage); both true is a 400.
- test_metrics.py: metrics_exist, metrics_counts, abort_metrics_reset (`jaxserve:` for `vllm:`).
- Behaviour vLLM's server has and these files assume: stop strings, stop_token_ids and
  include_stop_str_in_output, max_tokens / max_completion_tokens and their defaults, a prompt
  too long for max_model_len, a bad model name (404; "" is the served model), invalid
  sampling parameters, seeded sampling reproduces. Unknown request fields are a 400 naming
  them: jaxserve's rule (issue 36), where vLLM ignores them with a warning.

Not ported, because jaxserve does not have the feature:
- LoRA adapters (the zephyr-lora cases, test_lora_resolvers, test_default_mm_loras).
- reasoning effort, thinking budgets and harmony parsing. (Tools, tool_choice and the
  reasoning split are test_tool_calls.py's, on this server, which reads "auto" calls with the
  hermes parser, and on one that also splits thinking with the qwen3 parser.)
- min_characters, return_token_ids, logprob_token_ids, truncation_side "right", beam search,
  prompt embeds: each is refused with a 400 naming it, which test_protocol_surface.py checks.
  (Structured outputs, guided decoding, response_format json, logit_bias validation and
  min_tokens are jaxserve's now: tests/test_server_sampling.py covers them over HTTP.)
- multimodal input (vision, audio, video, image embeds; the metrics' multimodal server).
- endpoints: embeddings, score, transcription, tokenize/detokenize, /version, /load,
  /invocations, run_batch, --root-path.
- vLLM internals tested through mocks (finish_reason "error", a sampled token missing from its
  top logprobs, _usage_prompt_tokens, hidden deprecated metrics): no such objects here; where
  the behaviour shows over HTTP it is ported above.
- test_shutdown.py: SIGTERM on `jaxserve serve` (in-flight requests finish, late ones get 503
  events, exit 0) is tested in test_cli.py and test_hostile.py.
"""

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from conftest import SERVER_ENGINE_FLAGS
from served import KEY, metrics_of

ROOT = Path(__file__).resolve().parents[1]
MODEL = "demo"
VOCAB = 258  # the demo's byte vocabulary: 256 bytes, then BOS (256) and EOS (257)
MAX_MODEL_LEN = 1024
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

CHAT = [{"role": "system", "content": "you are a helpful assistant"},
        {"role": "user", "content": "what is 1+1?"}]
DIALOGUE = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Who won the world series in 2020?"},
            {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series."},
            {"role": "user", "content": "Where was it played?"}]
SAYING = "Here is a common saying about apple. An apple a day, keeps"


def num_prompt_tokens(text: str) -> int:
    """A text prompt's tokens on the demo: BOS, then one token per UTF-8 byte."""
    return 1 + len(text.encode())


def rendered(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The demo's chat prompt: it ships no template, so jaxserve's fallback renders it."""
    return ("".join(f"{m['role']}: {m['content']}\n" for m in messages)
            + ("assistant: " if add_generation_prompt else ""))


def bad_request(call, param: str | None) -> str:
    """`call()` raises openai's BadRequestError naming `param`; its message."""
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
    return info.value.body["message"]


def wait_idle(http, timeout: float = 60.0) -> dict[str, float]:
    """/metrics once no request runs or waits and no page is used (aborts take their time on a
    busy machine: `timeout` only bounds a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics_of(http)
        if (m["jaxserve:num_requests_running"] == m["jaxserve:num_requests_waiting"] == 0
                and m["jaxserve:kv_cache_usage_perc"] == 0):
            return m
        assert time.monotonic() < deadline, f"the engine is not idle: {m}"
        time.sleep(0.05)


def usage_is_sum(usage) -> bool:
    return (usage.prompt_tokens > 0 and usage.completion_tokens > 0
            and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens)


def usage_at_the_end(chunks, continuous: bool) -> None:
    """A stream with include_usage: each chunk's usage None (or, `continuous`, the running
    sums), then after the finishing chunk one with no choices and the whole usage."""
    for chunk in chunks:
        assert usage_is_sum(chunk.usage) if continuous else chunk.usage is None
        if chunk.choices[0].finish_reason is not None:
            final = next(chunks)
            assert usage_is_sum(final.usage) and final.choices == []
            return
    raise AssertionError("no chunk finished")


@contextlib.contextmanager
def demo_server(log: Path, *extra_flags: str):
    """`jaxserve serve` (the demo model) in a subprocess on a free port, with an API key and
    the test engine's small flags (and `extra_flags`); its output goes to a file (a pipe
    nobody reads would fill and stall it)."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port),
             "--api-key", KEY, "--max-top-logprobs", str(VOCAB), "--enable-prompt-logprobs",
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes", *extra_flags,
             *SERVER_ENGINE_FLAGS],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
            env=os.environ | {"PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, \
                "jaxserve serve did not start:\n" + log.read_text()[-3000:]
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            time.sleep(0.2)
        yield SimpleNamespace(url=url, proc=proc, log=log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
