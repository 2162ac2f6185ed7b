"""POST /v1/completions: text prompts (or token ids, or a batch of either) continued; the
choices' text, with the prompt in front when `echo` asks."""

from __future__ import annotations

from collections.abc import Iterator

from starlette.requests import Request
from starlette.responses import Response

from engine.async_engine import AsyncEngine
from engine.outputs import CompletionOutput, TokenLogprob
from server.generation import FINISH, Generation, check_prompt_bytes, finite
from server.metrics import RequestTracker
from server.protocol import CompletionRequest


class CompletionGeneration(Generation):
    ID_PREFIX = "cmpl"
    OBJECT = CHUNK_OBJECT = "text_completion"
    CHUNK_CONTENT = "text"

    def __init__(self, *args, echo: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.echo = echo
        self.prompt_texts: list[str] = []  # (with echo) each prompt's text, in front of its choices

    def _check_prompt(self, prompt: str) -> None:
        check_prompt_bytes(self.engine, prompt, chat=False)

    def _accepted(self, prompt: str | list[int]) -> None:
        if self.echo:
            self.prompt_texts.append(prompt if isinstance(prompt, str)
                                     else self.engine.decode(prompt))

    def _choice(self, i: int, index: int, c: CompletionOutput) -> dict:
        prefix = self.prompt_texts[i] if self.echo else ""
        return {"index": index, "text": prefix + c.text,
                "logprobs": self._completion_logprobs(c.logprobs, len(prefix)),
                "finish_reason": FINISH.get(c.finish_reason)}

    def _logprobs(self, lps: list[TokenLogprob]) -> dict:
        return self._completion_logprobs(lps, 0)

    def _completion_logprobs(self, lps: list[TokenLogprob] | None, offset: int) -> dict | None:
        """`offset`: where the first token's text starts in the choice's text."""
        if lps is None:
            return None
        tokens = self.engine.token_texts([lp.token_id for lp in lps])
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [finite(lp.logprob) for lp in lps],
                "top_logprobs": [
                    {text: finite(v) for text, (_, v) in zip(
                        self.engine.token_texts([t for t, _ in lp.top]), lp.top, strict=True)}
                    for lp in lps],
                "text_offset": offsets}

    def _opening(self) -> Iterator[str]:
        # With echo, each choice's prompt comes first.
        n = self.params.n
        for i, text in enumerate(self.prompt_texts):
            for j in range(n):
                yield self._chunk(i * n + j, text, None, None)

    def _delta(self, index: int, c: CompletionOutput) -> tuple[str, str | None]:
        return c.text, FINISH.get(c.finish_reason)


async def create_completion(request: Request, req: CompletionRequest, model: str,
                            engine: AsyncEngine, tracker: RequestTracker) -> Response:
    gen = CompletionGeneration(model, engine, req.to_sampling_params(engine.sampling_defaults),
                               tracker, echo=req.echo,
                               include_usage=req.include_usage,
                               return_token_ids=req.return_token_ids,
                               cache_salt=req.cache_salt)  # (a grammar: from structured_outputs)
    await gen.start(req.prompts(), add_special_tokens=True)
    return gen.stream_response() if req.stream else await gen.response(request)
