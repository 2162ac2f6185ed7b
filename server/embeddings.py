"""POST /v1/embeddings: OpenAI's embeddings API over a pooling model's engine
(engine/embedding_engine.py).

`input` is a text, texts, token ids or lists of them (each one input, embedded on its own);
`encoding_format` float or base64 (little-endian float32, as OpenAI's clients decode it);
`dimensions` only for a model whose files say it was trained to be truncated (Matryoshka:
`matryoshka_dimensions` in its config.json), then the first `dimensions` values,
normalised again when the model normalises. An input longer than the model takes is a 400
naming the limit.
"""

from __future__ import annotations

import base64
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator
from starlette.responses import JSONResponse, Response

from engine.embedding_engine import EmbeddingEngine
from engine.scheduler import RequestRejected
from server.errors import APIError
from server.protocol import as_batch, batch_schema, check_batch, served

MAX_INPUTS = 2048  # inputs in one request, as OpenAI's API
# A text longer in bytes than this many per token cannot fit the model (server/generation.py
# refuses prompts the same way): it is refused before it is tokenized.
MAX_BYTES_PER_TOKEN = 64

_INPUT = batch_schema(MAX_INPUTS, "A text, texts, token ids, or lists of token ids: each one "
                                  "input.")


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Served model name; optional with one model.",
                              json_schema_extra=served("model"))
    input: Annotated[str | list[str] | list[int] | list[list[int]], WithJsonSchema(_INPUT)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=1 << 16,
                                   description="Truncate each vector to this many values "
                                               "(only models trained for it).")
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _inputs_given(cls, value):
        return check_batch(value, MAX_INPUTS, "input")

    def inputs(self) -> list[str | list[int]]:
        return as_batch(self.input)


async def create_embeddings(req: EmbeddingRequest, model: str, engine: EmbeddingEngine,
                            tracker) -> Response:
    if req.dimensions is not None and req.dimensions not in engine.truncations:
        allowed = (f"one of {', '.join(map(str, engine.truncations))}" if engine.truncations
                   else f"not set: {model} was not trained for shorter vectors")
        raise APIError(400, f"dimensions must be {allowed}", param="dimensions")
    inputs = req.inputs()
    for i, item in enumerate(inputs):
        if isinstance(item, str) and (len(item.encode()) >
                                      MAX_BYTES_PER_TOKEN * engine.max_model_len):
            raise APIError(400, f"input {i} is longer than this model's maximum context "
                                f"length of {engine.max_model_len} tokens",
                           param="input", code="context_length_exceeded")
    texts = iter(await engine.encode([x for x in inputs if isinstance(x, str)]))
    ids = [next(texts) if isinstance(x, str) else x for x in inputs]
    try:
        vectors = await engine.embed(ids)
    except RequestRejected as e:
        code = "context_length_exceeded" if "context length" in str(e) else None
        raise APIError(400, str(e), param="input", code=code) from None
    if req.dimensions is not None:
        vectors = vectors[:, :req.dimensions]
        if engine.normalizes:
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True),
                                           1e-12)
    num_tokens = sum(map(len, ids))
    tracker.accepted(num_tokens)
    tracker.embedded()
    data = [{"object": "embedding", "index": i,
             "embedding": (base64.b64encode(v.astype("<f4").tobytes()).decode()
                           if req.encoding_format == "base64" else v.tolist())}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})
