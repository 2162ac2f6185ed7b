"""GET /openapi.json: the API description, with request schemas generated from the pydantic
models the handlers validate with (so the two cannot drift apart)."""

from __future__ import annotations

from pydantic import BaseModel

from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

_ERROR = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}

# path -> (method, summary, request model or None, response description)
_ROUTES = {
    "/v1/completions": ("post", "Text completions (stream: text/event-stream).", CompletionRequest,
                        "A text_completion object, or SSE chunks ending in [DONE]."),
    "/v1/chat/completions": ("post", "Chat completions (stream: text/event-stream).",
                             ChatCompletionRequest,
                             "A chat.completion object, or SSE chunks ending in [DONE]."),
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


def openapi_schema(version: str) -> dict:
    schemas: dict = {"ErrorResponse": _ERROR}
    paths: dict = {}
    for path, (method, summary, model, response) in _ROUTES.items():
        op: dict = {"summary": summary, "responses": {
            "200": {"description": response},
            **{code: {"description": text, "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
               for code, text in _ERRORS.items()}}}
        if model is not None:
            schemas.update(_schemas(model))
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        paths[path] = {method: op}
    return {"openapi": "3.1.0",
            "info": {"title": "xlaserve", "version": version,
                     "description": "An OpenAI-compatible API served by xlaserve."},
            "components": {"schemas": schemas,
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
            "security": [{"bearer": []}], "paths": paths}


def _schemas(model: type[BaseModel]) -> dict:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    return {**defs, model.__name__: schema}
