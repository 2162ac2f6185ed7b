"""Chat messages -> prompt text, with the model's own Jinja chat template, or one of ours
(`BUILTIN_TEMPLATES`) for a model whose files carry none.

Templates come from model files, so they are untrusted code: they run in Jinja's immutable
sandbox, set up the way transformers sets it up (trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, a `tojson` that keeps non-ASCII and takes indent/separators, `strftime_now`), so
a template renders here exactly as `apply_chat_template(..., tokenize=False)` renders it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, '), which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


# -- our own templates, by name ------------------------------------------------------------------
# For models whose files carry no chat template (a base model's GGUF, say); the caller names one
# (`Tokenizer.from_path(path, default_chat_template="gemma")`), the model's own always wins. Each
# writes what the model's format needs and no more; `text` reads a message's content, a string or
# a list of parts (the text parts, joined).

_TEXT = r"""{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is not none -%}
{%- for part in content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
"""

# Gemma: BOS, then turns `<start_of_turn>{user|model}\n{text}<end_of_turn>\n`, text trimmed. Gemma
# has no system role: a first system message opens the first user turn, then a blank line.
_GEMMA = _TEXT + r"""{{- bos_token -}}
{%- set ns = namespace(prefix='') -%}
{%- for message in messages -%}
{%- if message.role == 'system' and loop.first -%}
{%- set ns.prefix = text(message.content) + '\n\n' -%}
{%- elif message.role == 'user' or message.role == 'assistant' -%}
{{- '<start_of_turn>' + ('user' if message.role == 'user' else 'model') + '\n' -}}
{%- if message.role == 'user' -%}{{- ns.prefix -}}{%- set ns.prefix = '' -%}{%- endif -%}
{{- text(message.content) | trim -}}
{{- '<end_of_turn>\n' -}}
{%- else -%}
{{- raise_exception("the gemma chat template takes user and assistant messages, and a system "
                    "message only first; got role '" + message.role + "'") -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""

# ChatML (Qwen, SmolLM2 and many others): `<|im_start|>{role}\n{text}<|im_end|>\n`, no BOS.
_CHATML = _TEXT + r"""{%- for message in messages -%}
{{- '<|im_start|>' + message.role + '\n' + text(message.content) + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""

BUILTIN_TEMPLATES: dict[str, str] = {"gemma": _GEMMA, "chatml": _CHATML}


def builtin_template(name: str) -> str:
    """The source of our template `name` (a key of BUILTIN_TEMPLATES)."""
    try:
        return BUILTIN_TEMPLATES[name]
    except KeyError:
        raise ValueError(f"no built-in chat template {name!r} "
                         f"(known: {', '.join(sorted(BUILTIN_TEMPLATES))})") from None


class ChatTemplate:
    def __init__(self, template: str, bos_token: str | None = None, eos_token: str | None = None):
        if not isinstance(template, str) or not template:
            raise ValueError(f"chat template must be a non-empty string, got {template!r}")
        try:
            self._template = _ENV.from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not parse: {e.message} (line {e.lineno})") from e
        self.source = template
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def for_tokenizer(cls, tokenizer) -> ChatTemplate:
        if not tokenizer.chat_template:
            raise ValueError(f"{tokenizer.source}: the model files carry no chat template")
        return cls(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)

    @property
    def handles_tools(self) -> bool:
        """Whether the template renders `tools` itself (else `render` writes them, see there)."""
        return "tools" in self.source

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
               **extra: Any) -> str:
        """`extra` reaches the template as variables (tools=..., documents=..., or whatever else a
        template reads, like enable_thinking), as in transformers.

        A template that knows nothing of tools (SmolLM2's, plain ChatML) gets them the way
        Hermes-style templates write them, as llama.cpp does for such models: the tool
        signatures and the calling convention in the system message, earlier calls as
        `<tool_call>` blocks in the assistant's content, results as `<tool_response>` blocks in
        a user turn (server/tool_parsers.py reads the calls back)."""
        _validate(messages)
        if not self.handles_tools:
            messages = _hermes_tools(messages, extra.pop("tools", None))
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                     "tools": None, "documents": None, **extra}
        try:
            return self._template.render(messages=[dict(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:  # raise_exception, undefined names, sandbox violations
            raise ValueError(f"chat template failed: {e}") from e
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:
            raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e


TOOL_PROMPT = """# Tools

You may call functions to answer the user. Their signatures, one JSON object per line:
<tools>
{signatures}
</tools>

To call a function, reply with a JSON object holding its name and arguments between
<tool_call></tool_call> tags, one block per call:
<tool_call>
{{"name": <function name>, "arguments": <arguments as a JSON object>}}
</tool_call>"""


def _hermes_tools(messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Mapping[str, Any]] | None) -> list[dict]:
    """Messages with tools, calls and results written out as text (see ChatTemplate.render)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            blocks = [_tojson({"name": c["function"]["name"],
                               "arguments": c["function"].get("arguments", {})})
                      for c in m["tool_calls"]]
            text = m.get("content") or ""
            m["content"] = "\n".join(([text] if text else [])
                                     + [f"<tool_call>\n{b}\n</tool_call>" for b in blocks])
            del m["tool_calls"]
        elif m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n"
                                            f"</tool_response>"}
        out.append(m)
    if tools:
        prompt = TOOL_PROMPT.format(signatures="\n".join(_tojson(dict(t)) for t in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _validate(messages: Sequence[Mapping[str, Any]]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a chat needs at least one message")
    for n, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {n} must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {n} has no 'role' (a non-empty string): {dict(message)!r}")
        # An assistant turn that only calls tools may have content None; it must still say so.
        if "content" not in message and "tool_calls" not in message:
            raise ValueError(f"message {n} (role {role!r}) has no 'content'")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"message {n} (role {role!r}): 'content' must be a string or a list "
                             f"of parts, got {type(content).__name__}")
