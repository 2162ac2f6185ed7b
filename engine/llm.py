"""`LLM`: the offline entry point, shaped like vLLM's.

    llm = LLM("smollm2-135m", max_model_len=1024)
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "Hi!"}])

The model and its KV pool are set up as `python -m server` sets them up (a known model's
name, a path, or nothing for the default model; the same KV budget; the model's sampling
defaults), and every step shape is compiled before the first call returns. Requests run on
the calling thread, in one `LLMEngine`: for many callers at once use the server, or
`engine.async_engine.AsyncEngine` from asyncio.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.device import size_kv
from engine.launch import parse_model_arg, sampling_defaults
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from models.chat_template import ChatTemplate

Prompt = str | Mapping[str, Any]  # text, {"prompt": text} or {"prompt_token_ids": [...]}
Conversation = Sequence[Mapping[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, *, generation_config: str = "auto",
                 override_generation_config: dict | None = None,
                 kv_memory_bytes: int | None = None, **engine_args: Any):
        """`model`: as `python -m server --model` takes it ([name=]path or a known model's
        name; None: the default model). `engine_args`: EngineConfig's fields
        (max_model_len, dtype, quantization, kv_cache_dtype, ...); `generation_config` and
        `override_generation_config` as the server's flags of those names."""
        spec = parse_model_arg(model)
        config = EngineConfig(model=spec.path, name=spec.name, **engine_args)
        self.llm_engine = LLMEngine(size_kv(config, kv_memory_bytes=kv_memory_bytes))
        self.llm_engine.warmup()
        self.model_name = spec.name
        self._defaults = sampling_defaults(spec, generation_config, override_generation_config)
        self._chat_template: ChatTemplate | None = None

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling parameters samples with: the model's recommended
        values (docs/serving.md, "Sampling defaults"), OpenAI's elsewhere."""
        return SamplingParams(**self._defaults)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Whole outputs, one per prompt, in order. The prompts run together, batched
        continuously; one SamplingParams for all or one each."""
        if isinstance(prompts, str | Mapping):
            prompts = [prompts]
        return self.llm_engine.generate([_tokens_or_text(p) for p in prompts],
                                        sampling_params or self.get_default_sampling_params())

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, rendered with the model's chat
        template as the server renders them (special-token text in a message stays text)."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        extra = dict(chat_template_kwargs or {})
        if tools is not None:
            extra["tools"] = tools
        ids = [self._chat_ids(c, add_generation_prompt, extra) for c in conversations]
        return self.llm_engine.generate(ids,
                                        sampling_params or self.get_default_sampling_params())

    def _chat_ids(self, conversation: Conversation, add_generation_prompt: bool,
                  extra: dict[str, Any]) -> list[int]:
        if self._chat_template is None:
            self._chat_template = ChatTemplate.for_tokenizer(self.llm_engine.tokenizer)
        text = self._chat_template.render(conversation, add_generation_prompt, **extra)
        return self.llm_engine.encode(text, add_special_tokens=False)


def _tokens_or_text(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError(f"a prompt is a str, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, "
                     f"got the keys {sorted(prompt)}")
