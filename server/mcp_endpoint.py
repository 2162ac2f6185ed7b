"""xlaserve's own MCP server at `/mcp` (streamable HTTP, through the official `mcp` SDK):
each served model is a tool that an MCP client calls with a prompt and gets the model's
reply back, rendered with the model's chat template.

    endpoint = McpEndpoint(engines)
    routes.append(endpoint.route)                   # POST /mcp (405 for other methods)
    async with endpoint.run():                       # in the app's lifespan
        ...serve...

The SDK's session manager runs stateless (no session ids: any POST is a whole call) and
answers a call as an event stream, not the SDK's JSON-response mode: in JSON mode a client
that leaves is never noticed and its model runs on to `max_tokens`; with the stream, the
SDK cancels the call and the engine request is aborted. A mounted app's own lifespan is
never run by Starlette, so the manager is entered by the outer app's (`run()`); without it
a request fails with a 500. The app's middleware (Host check, limits, API key) sees `/mcp` as it
sees every other path: with `--api-key`, an MCP client sends `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from contextlib import AbstractAsyncContextManager
from importlib import metadata

import mcp_types
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.shared.exceptions import MCPError
from starlette.routing import Route

from engine.async_engine import AsyncEngine, Engines
from engine.sampling_params import SamplingParams
from server.chat import PROMPT_POOL
from server.errors import api_error
from server.generation import check_prompt_bytes
from server.protocol import MODEL_DEFAULTS

ARGUMENTS = {"prompt", "system", "max_tokens", "temperature"}


def tool_names(models: list[str]) -> dict[str, str]:
    """Tool name -> served model: the model's name with every character outside
    [A-Za-z0-9_.-] as '_', at most 64 long, numbered where two would be the same."""
    names: dict[str, str] = {}
    for model in models:
        name = base = re.sub(r"[^A-Za-z0-9_.-]", "_", model)[:64] or "model"
        n = 1
        while name in names:
            n += 1
            name = f"{base[:64 - len(str(n)) - 1]}_{n}"
        names[name] = model
    return names


def _tool(name: str, model: str, engine: AsyncEngine) -> mcp_types.Tool:
    return mcp_types.Tool(
        name=name,
        description=(f"Ask the language model {model!r} (served by xlaserve): the prompt is "
                     f"its user message, the reply is its answer. Context: "
                     f"{engine.max_model_len} tokens."),
        input_schema={
            "type": "object",
            "properties": {
                "prompt": {"type": "string", "minLength": 1,
                           "description": "The user message."},
                "system": {"type": "string",
                           "description": "A system message before it (instructions)."},
                "max_tokens": {"type": "integer", "minimum": 1,
                               "maximum": max(1, engine.max_model_len - 1),
                               "description": "At most this many tokens in the reply "
                                              "(default: up to the context length)."},
                "temperature": {"type": "number", "minimum": 0,
                                "description": "Sampling temperature; 0 is greedy "
                                               "(default: the model's)."},
            },
            "required": ["prompt"],
            "additionalProperties": False,
        },
        annotations=mcp_types.ToolAnnotations(read_only_hint=True, destructive_hint=False,
                                              open_world_hint=False),
    )


def _request(engine: AsyncEngine, args: dict) -> tuple[list[dict], SamplingParams]:
    """The chat and sampling parameters of a call's arguments; ValueError says what is
    wrong with them."""
    unknown = set(args) - ARGUMENTS
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(sorted(unknown))}; the arguments "
                         f"are {', '.join(sorted(ARGUMENTS))}")
    prompt, system = args.get("prompt"), args.get("system")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt: a non-empty string is required")
    if system is not None and not isinstance(system, str):
        raise ValueError("system: must be a string")
    max_tokens, temperature = args.get("max_tokens"), args.get("temperature")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < 1):
        raise ValueError(f"max_tokens: must be a positive integer, got {max_tokens!r}")
    chosen = {k: v for k, v in engine.sampling_defaults.items() if k in MODEL_DEFAULTS}
    if temperature is not None:
        chosen["temperature"] = temperature
    params = SamplingParams(**chosen, max_tokens=max_tokens)  # SamplingParamsError: a ValueError
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    return messages, params


async def _reply(engine: AsyncEngine, messages: list[dict], params: SamplingParams) -> str:
    loop = asyncio.get_running_loop()
    try:  # chat templates run off the event loop, as for /v1/chat/completions
        prompt = await loop.run_in_executor(PROMPT_POOL, engine.render_chat, messages, True)
    except ValueError as e:
        raise ValueError(f"the chat template refused the messages: {e}") from None
    check_prompt_bytes(engine, prompt, chat=True)
    # The template writes the special tokens itself.
    stream = await engine.add_request(prompt, params, f"mcp-{uuid.uuid4().hex}",
                                      add_special_tokens=False)
    texts = []
    try:
        async for out in stream:
            texts.append(out.outputs[0].text)
    finally:
        stream.close()  # a call cancelled (its client gone) aborts the request
    return "".join(texts)


class McpEndpoint:
    """The MCP server over a set of engines: `route` to add to the app, `run()` to enter in
    its lifespan (once)."""

    def __init__(self, engines: Engines, path: str = "/mcp"):
        self.engines = engines
        # tool name -> served model (a model that embeds generates no replies)
        self.models = tool_names([name for name in engines.names()
                                  if engines[name].task == "generate"])
        try:
            version = metadata.version("xlaserve")
        except metadata.PackageNotFoundError:
            version = "0+unknown"
        self.server = Server("xlaserve", version=version, on_list_tools=self._list_tools,
                             on_call_tool=self._call_tool)
        self.manager = StreamableHTTPSessionManager(self.server, stateless=True)
        # POST only: stateless, there is no session to DELETE, and a GET would open an event
        # stream that never carries anything and holds its connection until the client
        # leaves (405 is the spec's answer for a server without one).
        self.route = Route(path, endpoint=StreamableHTTPASGIApp(self.manager), methods=["POST"])

    def run(self) -> AbstractAsyncContextManager[None]:
        """The SDK's session manager, running: enter it in the app's lifespan, once."""
        return self.manager.run()

    async def _list_tools(self, ctx, params) -> mcp_types.ListToolsResult:
        return mcp_types.ListToolsResult(
            tools=[_tool(name, model, self.engines[model]) for name, model in self.models.items()])

    async def _call_tool(self, ctx, params: mcp_types.CallToolRequestParams
                         ) -> mcp_types.CallToolResult:
        model = self.models.get(params.name)
        if model is None:  # a protocol error, as the spec has it
            raise MCPError(code=mcp_types.INVALID_PARAMS, message=f"Unknown tool: {params.name}")
        engine = self.engines[model]
        try:
            messages, sampling = _request(engine, params.arguments or {})
            text = await _reply(engine, messages, sampling)
        except ValueError as e:  # the arguments (SamplingParamsError is one too)
            return _error(str(e))
        except Exception as e:  # the engine's refusals; anything else is logged
            return _error(api_error(e).message)
        return mcp_types.CallToolResult(content=[mcp_types.TextContent(type="text", text=text)])


def _error(message: str) -> mcp_types.CallToolResult:
    return mcp_types.CallToolResult(content=[mcp_types.TextContent(type="text", text=message)],
                                    is_error=True)
