"""The Starlette app: routes, error handlers and middleware around a set of engines.

    app = build_app(engines, api_key="...")      # then uvicorn.run(app, ...)

Handlers are thin: parse and validate the body, pick the engine, call it, shape
the answer. Every failure leaves as an OpenAI-shaped error with its status.

Bodies are JSON only (`Content-Type: application/json`, else 415): a browser sends
another site's `text/plain` POST without asking (no CORS preflight), never a JSON one.
A body over `PARSE_INLINE_BYTES` is parsed and validated on a worker thread, so one
large body does not stall the event loop and every stream on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from importlib import metadata

import anyio.to_thread
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.async_engine import AsyncEngine, Engines
from engine.sessions import SessionStore
from engine.tool_loop import ToolLoop
from server.chat import PROMPT_POOL, create_chat_completion
from server.chat_protocol import ChatCompletionRequest, TokenizeRequest
from server.completions import create_completion
from server.embeddings import EmbeddingRequest, create_embeddings
from server.errors import CLIENT_ERRORS, APIError, api_error
from server.generation import STREAM_STALL_TIMEOUT_S, check_prompt_bytes
from server.mcp_endpoint import McpEndpoint
from server.metrics import ServerMetrics
from server.middleware import APIKeyAuth, HostCheck, RequestLimits
from server.openapi import ServedModel, openapi_schema
from server.protocol import CompletionRequest, DetokenizeRequest
from server.reasoning import ReasoningParser
from server.responses import create_response, delete_response, get_response
from server.responses_protocol import ResponsesRequest
from server.strict_json import InvalidJSON, parse_json
from server.tool_rounds import chat_with_tools, offered

MAX_BODY_BYTES = 8 << 20
MAX_HEADERS = 100
BODY_READ_TIMEOUT = 60.0  # seconds from a request's headers to the end of its body
# Bodies above this are parsed and validated on a thread, so that a large body (token ids
# parse slowest) cannot hold the event loop, and every other stream, while it is read.
PARSE_INLINE_BYTES = 64 << 10
PARSE_THREADS = 2


def _version() -> str:
    try:
        return metadata.version("xlaserve")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class Server:
    """The state the handlers share: the engines, the metrics, the reasoning parser."""

    def __init__(self, engines: Engines, reasoning_parser: str | None = None,
                 api_key: bool = False, allow_special_tokens_in_messages: bool = False,
                 sessions: SessionStore | None = None, tool_loop: ToolLoop | None = None):
        self.engines = engines
        self.tool_loop = tool_loop  # the tools the server runs itself (--mcp-config)
        # Stored responses (the Responses API); the server's own, so a rebooted engine keeps it.
        self.sessions = sessions if sessions is not None else SessionStore()
        self.sessions.on_drop = self._release_session
        # Special-token text in chat requests parsed as those tokens (the old behaviour).
        self.allow_special_tokens_in_messages = allow_special_tokens_in_messages
        self.api_key = api_key  # whether requests need one (for /openapi.json)
        self.reasoning = ReasoningParser(reasoning_parser) if reasoning_parser else None
        self.metrics = ServerMetrics(engines)
        self.created = int(time.time())
        # Big bodies wait here (cancellably) for one of a few parsing threads.
        self.parsers = anyio.CapacityLimiter(PARSE_THREADS)

    def _release_session(self, response_id: str) -> None:
        for name in self.engines.names():  # (an engine that kept nothing for it ignores it)
            self.engines[name].release_session(response_id)

    def engine(self, model: str | None, task: str = "generate") -> tuple[str, AsyncEngine]:
        """The engine of the request's model, which must serve `task` ("generate" or "embed");
        a request that names none gets the only model, or the only one serving `task`."""
        names = self.engines.names()
        if model is None:  # the one model there is, or the one model doing this task
            doing = [n for n in names if self.engines[n].task == task]
            if len(names) != 1 and len(doing) != 1:
                raise APIError(400, f"model is required; served models: {', '.join(names)}",
                               param="model")
            model = names[0] if len(names) == 1 else doing[0]
        engine = self.engines[model]  # UnknownModel -> 404
        if engine.task != task:
            serves = ("embeddings (/v1/embeddings), not generation" if task == "generate" else
                      "generation, not embeddings (start it with --task embed for those)")
            raise APIError(400, f"the model {model!r} serves {serves}", param="model")
        return model, engine

    async def parse(self, request: Request, model: type[BaseModel], tools: str | None = None):
        """The body as a validated `model`: 415 unless it is JSON, 400 unless it is valid.
        `tools` ("chat" or "responses"): the server's own tools added first, in that shape."""
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise APIError(415, f"the body must be JSON, sent with 'Content-Type: "
                                f"application/json' (got {media_type or 'none'!r})",
                           code="unsupported_media_type")
        body = await request.body()
        loop = self.tool_loop if tools is not None else None
        if len(body) <= PARSE_INLINE_BYTES:
            return _validate(body, model, loop, tools == "chat")
        return await anyio.to_thread.run_sync(_validate, body, model, loop, tools == "chat",
                                              limiter=self.parsers)

    # ---- handlers -----------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        req = await self.parse(request, CompletionRequest)
        model, engine = self.engine(req.model)
        return await create_completion(request, req, model, engine, self.metrics.tracker(model))

    async def chat_completions(self, request: Request) -> Response:
        req = await self.parse(request, ChatCompletionRequest, tools="chat")
        model, engine = self.engine(req.model)
        if self.tool_loop is not None:
            return await chat_with_tools(
                request, req, model, engine, self.metrics.tracker(model), self.tool_loop,
                self.reasoning, self.allow_special_tokens_in_messages)
        return await create_chat_completion(
            request, req, model, engine, self.metrics.tracker(model), self.reasoning,
            allow_special_tokens_in_messages=self.allow_special_tokens_in_messages)

    async def responses(self, request: Request) -> Response:
        req = await self.parse(request, ResponsesRequest, tools="responses")
        model, engine = self.engine(req.model)
        return await create_response(
            request, req, model, engine, self.metrics.tracker(model), self.sessions,
            self.reasoning, self.allow_special_tokens_in_messages, self.tool_loop)

    async def embeddings(self, request: Request) -> Response:
        req = await self.parse(request, EmbeddingRequest)
        model, engine = self.engine(req.model, task="embed")
        return await create_embeddings(req, model, engine, self.metrics.tracker(model))

    async def stored_response(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if request.method == "DELETE":
            return delete_response(self.sessions, response_id)
        return get_response(self.sessions, response_id)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card(name)
                                                        for name in self.engines.names()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        self.engines[name]  # noqa: B018 (UnknownModel -> 404)
        return JSONResponse(self._model_card(name))

    def _model_card(self, name: str) -> dict:
        # `root` is the served name, never the weights' path (it would show the file system).
        return {"id": name, "object": "model", "created": self.created, "owned_by": "xlaserve",
                "root": name,
                "max_model_len": self.engines[name].max_model_len}

    async def tokenize(self, request: Request) -> Response:
        req = await self.parse(request, TokenizeRequest)
        model, engine = self.engine(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            try:
                text = await asyncio.get_running_loop().run_in_executor(
                    PROMPT_POOL, engine.render_chat, [m.for_template() for m in req.messages],
                    req.add_generation_prompt)
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
            if self.allow_special_tokens_in_messages:
                text = str(text)
            check_prompt_bytes(engine, text, chat=True)
            ids = await engine.encode(text, add_special_tokens=False)
        else:
            check_prompt_bytes(engine, req.prompt, chat=False)
            ids = await engine.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len,
                             "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        req = await self.parse(request, DetokenizeRequest)
        model, engine = self.engine(req.model)
        ids = await engine.encode(req.tokens)  # checks the ids against the vocabulary
        return JSONResponse({"prompt": engine.decode(ids)})

    async def health(self, request: Request) -> Response:
        down = [name for name in self.engines.names()
                if not (s := self.engines[name].stats()).alive or not s.warm]
        if down:
            return APIError(503, f"not ready: {', '.join(down)}").response()
        return Response(status_code=200)

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi(self, request: Request) -> Response:
        served = {name: ServedModel(self.engines[name].max_model_len,
                                    self.engines[name].vocab_size)
                  for name in self.engines.names()}
        return JSONResponse(openapi_schema(_version(), served, self.api_key))


def _validate(body: bytes, model: type[BaseModel], loop: ToolLoop | None = None,
              nested: bool = True):
    try:
        value = parse_json(body)
    except InvalidJSON as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    return model.model_validate(offered(value, loop, nested))


async def _http_error(request: Request, exc: HTTPException) -> Response:
    message = {404: f"no route for {request.method} {request.scope['path']}",
               405: f"method {request.method} is not allowed on {request.scope['path']}"}
    return APIError(exc.status_code, message.get(exc.status_code, exc.detail),
                    headers=exc.headers).response()


async def _api_error(request: Request, exc: Exception) -> Response:
    return api_error(exc).response()  # 500 for exceptions outside CLIENT_ERRORS


def profile_routes(directory: str, engines: Engines) -> list[Route]:
    """POST /start_profile and /stop_profile (vLLM's names): a jax.profiler trace of the
    whole process between the two into `directory`, and the stop's answer summarizes it per
    engine step (engine.profiling: the device's busy time, the events that take the most).
    For measuring: tracing slows the server."""
    from engine.profiling import Profiler, ProfilerError

    def steps() -> int:
        return sum(getattr(engines[n].engine, "num_steps", 0) for n in engines.names()
                   if isinstance(engines[n], AsyncEngine))

    profiler = Profiler(directory, steps)

    def route(path: str, method) -> Route:
        async def handle(request: Request) -> Response:
            try:
                return JSONResponse(await asyncio.to_thread(method))
            except ProfilerError as e:
                raise APIError(409, str(e)) from None
        return Route(path, handle, methods=["POST"])

    return [route("/start_profile", profiler.start), route("/stop_profile", profiler.stop)]


def build_app(engines: Engines, api_key: str | None = None, cors_origins: list[str] = (),
              max_body_bytes: int = MAX_BODY_BYTES, max_headers: int = MAX_HEADERS,
              reasoning_parser: str | None = None, allowed_hosts: list[str] | None = None,
              body_read_timeout: float = BODY_READ_TIMEOUT,
              allow_special_tokens_in_messages: bool = False,
              stream_stall_timeout: float = STREAM_STALL_TIMEOUT_S,
              sessions: SessionStore | None = None,
              tool_loop: ToolLoop | None = None,
              profiler_dir: str | None = None) -> Starlette:
    """`allowed_hosts`: the Host names served (None or "*": any; see HostCheck). `sessions`:
    where stored responses are kept (default: a SessionStore with its default limits).
    `tool_loop`: tools the server runs itself inside a request (its runner is started and
    stopped with the app, when it has start() and stop()). `profiler_dir`
    (XLASERVE_PROFILER_DIR): serve /start_profile and /stop_profile (profile_routes)."""
    server = Server(engines, reasoning_parser, api_key=bool(api_key),
                    allow_special_tokens_in_messages=allow_special_tokens_in_messages,
                    sessions=sessions, tool_loop=tool_loop)
    mcp = McpEndpoint(engines)
    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/responses", server.responses, methods=["POST"]),
        Route("/v1/embeddings", server.embeddings, methods=["POST"]),
        Route("/v1/responses/{response_id}", server.stored_response, methods=["GET", "DELETE"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.model, methods=["GET"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_text, methods=["GET"]),
        Route("/openapi.json", server.openapi, methods=["GET"]),
        mcp.route,
    ]
    if profiler_dir:
        routes += profile_routes(profiler_dir, engines)
    # Outermost first: a foreign Host is refused before anything else (a DNS-rebinding page
    # gets nothing, not even CORS answers); CORS answers preflights itself; limits come
    # before auth reads anything.
    middleware = []
    if allowed_hosts is not None and "*" not in allowed_hosts:
        middleware.append(Middleware(HostCheck, allowed_hosts=allowed_hosts))
    if cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins),
                                     allow_methods=["*"], allow_headers=["*"]))
    middleware.append(Middleware(RequestLimits, max_body_bytes=max_body_bytes,
                                 max_headers=max_headers, body_read_timeout=body_read_timeout))
    if api_key:
        middleware.append(Middleware(APIKeyAuth, api_key=api_key))
    handlers = {HTTPException: _http_error, Exception: _api_error,
                **dict.fromkeys(CLIENT_ERRORS, _api_error)}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        runner = tool_loop.runner if tool_loop is not None else None
        async with mcp.run():
            if hasattr(runner, "start"):
                await runner.start()  # every MCP server, or an error naming the one that failed
            try:
                yield
            finally:
                if hasattr(runner, "stop"):
                    await runner.stop()

    app = Starlette(routes=routes, middleware=middleware, exception_handlers=handlers,
                    lifespan=lifespan)
    app.state.server = server
    app.state.stream_stall_timeout = stream_stall_timeout  # read by server.generation's streams
    return app
