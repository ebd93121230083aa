"""`LLM`, the offline API, as vLLM's: a model loaded for generation, prompts (or chats) in,
every request's final output back in input order."""

import dataclasses
from pathlib import Path
from typing import Any

from jaxserve.config.checks import show
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine, PromptType
from jaxserve.engine.model_files import DEMO
from jaxserve.request import LoRARequest, RequestOutput, RequestOutputKind, SamplingParams
from jaxserve.text.tool_specs import check_tools


class LLM:
    """A model loaded for offline generation, as vLLM's `LLM`."""

    def __init__(self, model: str | Path | None = DEMO, **overrides: Any):
        self.engine = LLMEngine(model, EngineConfig.from_overrides(**overrides))

    @property
    def llm_engine(self) -> LLMEngine:  # vLLM's name for it
        return self.engine

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no params: SamplingParams with the model's own
        defaults from generation_config.json (temperature, top_p, top_k, max_new_tokens), as
        vLLM's generation_config="auto"."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order. `lora_request`: the
        adapter every prompt runs with, or one a prompt (None: the base model), as vLLM's
        (an adapter new to the engine is loaded first; enable_lora must be on). A prompt whose params ask
        for n > 1 samples runs as n requests (`SamplingParams.for_sample`); its output holds
        the n completions in `outputs`, indexed 0..n-1, with the first request's id and
        metrics. Only final outputs are returned, so every request runs as FINAL_ONLY (as
        vLLM's LLM does): no step builds an output nobody reads."""
        from tqdm import tqdm

        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if not isinstance(prompts, list | tuple):
            raise ValueError("prompts must be a string, a dict ({'prompt_token_ids': [...]} or "
                             f"{{'prompt': text}}) or a list of them, got {show(prompts)}")
        params = (self.get_default_sampling_params() if sampling_params is None
                  else sampling_params)
        params = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} "
                             "prompts")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params must be a SamplingParams or a list of them, "
                                 f"got {show(p)}")
        loras = (list(lora_request) if isinstance(lora_request, list | tuple)
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts")
        ids: list[list[str]] = []  # per prompt, its samples' request ids
        try:
            for prompt, p, lora in zip(prompts, params, loras, strict=True):
                ids.append([])
                for i in range(p.n):
                    sample = dataclasses.replace(p.for_sample(i),
                                                 output_kind=RequestOutputKind.FINAL_ONLY)
                    ids[-1].append(self.engine.add_request(
                        None, prompt, sample, cap_max_tokens=True,
                        lora_request=lora).request_id)
        except Exception:  # nothing of this call stays queued
            for rid in (r for group in ids for r in group):
                self.engine.abort(rid)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=sum(map(len, ids)), desc="generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():  # FINAL_ONLY: each one a request's last
                    finished[output.request_id] = output
                    bar.update(1)
        results = []
        for group in ids:
            completions = [dataclasses.replace(finished[rid].outputs[0], index=i)
                           for i, rid in enumerate(group)]
            results.append(dataclasses.replace(finished[group[0]], outputs=completions))
        return results

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """As vLLM's `LLM.chat`: one conversation ([{"role", "content"}, ...]) or a list of
        them, rendered with the model's chat template (as the server's /v1/chat/completions
        renders them), then generated; outputs in input order. `continue_final_message`:
        the model continues the final message (`add_generation_prompt` must be False).
        `tools`: OpenAI's function tools, rendered by the template (its `tools`); messages may
        carry an assistant's `tool_calls` and the tools' results (role "tool"). The text comes
        back as generated: jaxserve/text/tool_parsers.py reads calls out of it.
        `chat_template_kwargs`: more of the template's variables (Qwen3's enable_thinking)."""
        if tools is not None:
            check_tools(tools)
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("messages: this model has no tokenizer, so no chat template")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt,
                                                 continue_final_message, tools=tools or None,
                                                 template_kwargs=chat_template_kwargs)
            prompts.append({"prompt_token_ids": tokenizer.chat_prompt_ids(text), "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's `LLM.reset_prefix_cache`): the next prompts are
        computed from their first token. False, and nothing forgotten, while requests run."""
        return self.engine.reset_prefix_cache()

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()
