"""Chat messages -> prompt text, with the model's own Jinja chat template.

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

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
               **extra: Any) -> str:
        """`extra` reaches the template as variables (tools=..., documents=..., or whatever else a
        template reads, like enable_thinking), as in transformers."""
        _validate(messages)
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                     "tools": None, "documents": None, **extra}
        try:
            return self._template.render(messages=[dict(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:  # raise_exception, undefined names, sandbox violations
            raise ValueError(f"chat template failed: {e}") from e
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:
            raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e


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
