"""GET /openapi.json: the API description, with request schemas generated from the pydantic
models the handlers validate with (so the two cannot drift apart), and the bounds that depend
on the served models (their names, context lengths, vocabularies) filled in from them."""

from __future__ import annotations

from typing import Any, NamedTuple

from pydantic import BaseModel

from server.chat_protocol import ChatCompletionRequest, TokenizeRequest
from server.embeddings import EmbeddingRequest
from server.protocol import CompletionRequest, DetokenizeRequest
from server.responses_protocol import ResponsesRequest

_ERROR = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}

# path -> (method, summary, request model or None, response description), or a list of them
_ROUTES = {
    "/v1/completions": ("post", "Text completions (stream: text/event-stream).", CompletionRequest,
                        "A text_completion object, or SSE chunks ending in [DONE]."),
    "/v1/chat/completions": ("post", "Chat completions (stream: text/event-stream).",
                             ChatCompletionRequest,
                             "A chat.completion object, or SSE chunks ending in [DONE]."),
    "/v1/responses": ("post", "Responses (stream: text/event-stream of response events).",
                      ResponsesRequest, "A response object, or SSE events ending in "
                                        "response.completed (or .incomplete, .failed)."),
    "/v1/responses/{response_id}": [
        ("get", "A stored response.", None, "The response object."),
        ("delete", "Delete a stored response.", None, "{id, object, deleted}")],
    "/v1/embeddings": ("post", "Embeddings of texts or token ids (a model that embeds).",
                       EmbeddingRequest, "A list of embedding objects with usage."),
    "/v1/models": ("get", "The served models.", None, "A list of model objects."),
    "/tokenize": ("post", "Token ids of a prompt or a chat.", TokenizeRequest,
                  "{count, max_model_len, tokens}"),
    "/detokenize": ("post", "Text of token ids.", DetokenizeRequest, "{prompt}"),
    "/health": ("get", "200 once warm and alive, 503 otherwise (no API key needed).", None,
                "Empty body."),
    "/metrics": ("get", "Prometheus metrics.", None, "Prometheus text format."),
}

_ERRORS = {"400": "Invalid parameters or prompt.", "401": "Missing or wrong API key.",
           "404": "Unknown model or route.", "413": "Request body over the limit.",
           "429": "The waiting queue is full.", "503": "The engine is down or rebooting."}


class ServedModel(NamedTuple):
    max_model_len: int
    vocab_size: int | None  # None: the engine does not check token ids against one


def openapi_schema(version: str, served: dict[str, ServedModel], api_key: bool) -> dict:
    """The description of this server: its models' bounds, and the bearer key where it has
    one (everywhere but /health)."""
    schemas: dict = {"ErrorResponse": _ERROR}
    paths: dict = {}
    errors = {code: text for code, text in _ERRORS.items() if api_key or code != "401"}
    for path, method, summary, model, response in _operations():
        op: dict = {"summary": summary, "responses": {
            "200": {"description": response},
            **{code: {"description": text, "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
               for code, text in errors.items()}}}
        if model is not None:
            schemas.update(_schemas(model))
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        if "{response_id}" in path:
            op["parameters"] = [{"name": "response_id", "in": "path", "required": True,
                                 "schema": {"type": "string"}}]
        if api_key and path == "/health":
            op["security"] = []
        paths.setdefault(path, {})[method] = op
    _fill_served(schemas, served)
    components: dict = {"schemas": schemas}
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return {"openapi": "3.1.0",
            "info": {"title": "xlaserve", "version": version,
                     "description": "An OpenAI-compatible API served by xlaserve."},
            "components": components, "paths": paths,
            **({"security": [{"bearer": []}]} if api_key else {})}


def _operations():
    for path, ops in _ROUTES.items():
        for op in ops if isinstance(ops, list) else [ops]:
            yield path, *op


def _schemas(model: type[BaseModel]) -> dict:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    return {**defs, model.__name__: schema}


def _fill_served(node: Any, served: dict[str, ServedModel]) -> None:
    """Replace the "x-served" marks (server/protocol.py) with the served models' bounds: with
    several models, the loosest of them (the request's model decides the rest)."""
    if isinstance(node, list):
        for item in node:
            _fill_served(item, served)
        return
    if not isinstance(node, dict):
        return
    if len(served) > 1 and node.get("properties", {}).get("model", {}).get("x-served"):
        node.setdefault("required", []).append("model")  # null picks the only model
    for value in node.values():
        _fill_served(value, served)
    what = node.pop("x-served", None)
    if not served:
        return
    vocab = [m.vocab_size for m in served.values()]
    if what == "model":
        names = {"enum": sorted(served)}
        node.pop("anyOf", None)
        node.update({"anyOf": [names, {"type": "null"}]} if len(served) == 1 else names)
    elif what == "max_tokens":  # a prompt takes at least one token of the context
        most = max(m.max_model_len for m in served.values()) - 1
        node["maxItems" if node.get("type") == "array" else "maximum"] = most
    elif what == "token_id" and None not in vocab:
        node["maximum"] = max(vocab) - 1
    elif what == "token_key" and None not in vocab:  # a token id as an object key
        node["pattern"] = integer_pattern(max(vocab) - 1)


def integer_pattern(most: int) -> str:
    """A regular expression of the decimal integers 0 .. `most` (no sign, no leading zero):
    a key pattern as strict as a vocabulary check."""
    digits = str(most)
    # fewer digits than `most`, none leading with 0 (0 itself apart)
    shorter = ([r"[1-9]" + (rf"[0-9]{{0,{len(digits) - 2}}}" if len(digits) > 2 else "")]
               if len(digits) > 1 else [])
    # as many digits as `most`: its first i digits, a smaller one, then any
    same = [digits]
    for i, d in enumerate(digits):
        low = 1 if i == 0 else 0
        if int(d) > low:
            top = int(d) - 1
            rest = len(digits) - i - 1
            same.append(digits[:i] + (f"[{low}-{top}]" if top > low else str(low))
                        + (f"[0-9]{{{rest}}}" if rest else ""))
    alternatives = ["0"] * (most > 0) + shorter + same
    return "^(" + "|".join(dict.fromkeys(alternatives)) + ")$"
