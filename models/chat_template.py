"""Chat messages -> prompt text, with the model's own Jinja chat template, or one of ours
(`BUILTIN_TEMPLATES`) for a model whose files carry none.

Templates come from model files, so they are untrusted code: they run in Jinja's immutable
sandbox, set up the way transformers sets it up (trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, a `tojson` that keeps non-ASCII and takes indent/separators, `strftime_now`), so
a template renders here exactly as `apply_chat_template(..., tokenize=False)` renders it.

Only the template writes control tokens. Text from the request (message content, names, tool
calls and definitions, extra variables) that spells a special token (`<|im_end|>` typed into a
message) is text: the rendered chat is then a `ChatPrompt`, which tells `Tokenizer.encode` where
the template's own special tokens are, and the rest is tokenized as plain text.
"""

from __future__ import annotations

import bisect
import itertools
import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
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


class ChatPrompt(str):
    """A rendered chat whose request text spells special tokens. `template_specials`: the
    (start, end) spans of the special tokens the template wrote, the only ones that
    `Tokenizer.encode` makes real; everything else is tokenized as plain text. A plain `str` of
    it (`str(prompt)`) parses every special token's text again, wherever it came from."""

    template_specials: tuple[tuple[int, int], ...]

    def __new__(cls, text: str, template_specials: Iterable[tuple[int, int]]) -> ChatPrompt:
        prompt = super().__new__(cls, text)
        prompt.template_specials = tuple(template_specials)
        return prompt


class ChatTemplate:
    def __init__(self, template: str, bos_token: str | None = None, eos_token: str | None = None,
                 special_tokens: Iterable[str] = ()):
        """`special_tokens`: the texts the tokenizer turns into special tokens; request text
        that spells one of them renders as plain text (see ChatPrompt)."""
        if not isinstance(template, str) or not template:
            raise ValueError(f"chat template must be a non-empty string, got {template!r}")
        try:
            self._template = _ENV.from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not parse: {e.message} (line {e.lineno})") from e
        self.source = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        texts = [t for t in special_tokens if t]
        self._specials = SpecialText(texts) if texts else None

    @classmethod
    def for_tokenizer(cls, tokenizer) -> ChatTemplate:
        if not tokenizer.chat_template:
            raise ValueError(f"{tokenizer.source}: the model files carry no chat template")
        return cls(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token,
                   tokenizer.special_tokens)

    @property
    def handles_tools(self) -> bool:
        """Whether the template renders `tools` itself (else `render` writes them, see there)."""
        return "tools" in self.source

    def render(self, messages: Sequence[Mapping[str, Any]], /, add_generation_prompt: bool = False,
               **extra: Any) -> str:
        """`extra` reaches the template as variables (tools=..., documents=..., or whatever else a
        template reads, like enable_thinking), as in transformers. A `ChatPrompt` when the
        messages or `extra` spell a special token, else a plain str.

        A template that knows nothing of tools (SmolLM2's, plain ChatML) gets them the way
        Hermes-style templates write them, as llama.cpp does for such models: the tool
        signatures and the calling convention in the system message, earlier calls as
        `<tool_call>` blocks in the assistant's content, results as `<tool_response>` blocks in
        a user turn (server/tool_parsers.py reads the calls back)."""
        _validate(messages)
        if "messages" in extra:
            raise ValueError("messages: the template's own argument, not a variable")
        mark = None if self._specials is None else self._specials.mark_for(
            [self.source, self.bos_token or "", self.eos_token or ""], (messages, extra))
        if mark is None:  # no request text spells (a part of) a special token
            return self._render(messages, add_generation_prompt, extra)
        # Render with a mark written into every special token's text in the request's
        # strings, so that only the template's own ones match in the output.
        messages, extra = _map_strings(lambda s: self._specials.escape(s, mark), (messages, extra))
        return self._specials.separate(self._render(messages, add_generation_prompt, extra), mark)

    def _render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                extra: dict[str, Any]) -> str:
        extra = dict(extra)
        if not self.handles_tools:
            messages = _hermes_tools(messages, extra.pop("tools", None))
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                     "tools": None, "documents": None, **extra,
                     "messages": [dict(m) for m in messages],
                     "add_generation_prompt": add_generation_prompt}
        try:  # (one dict: any name, `self` too, can be a variable)
            return self._template.render(variables)
        except jinja2.TemplateError as e:  # raise_exception, undefined names, sandbox violations
            raise ValueError(f"chat template failed: {e}") from e
        except (TypeError, KeyError, AttributeError, IndexError, ValueError, OverflowError) as e:
            raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e


class SpecialText:
    """Where a tokenizer's special tokens are spelt in text, found as tokenizers find them:
    leftmost first, the longest at a place. One regular expression over the texts' trie, so
    a search costs about as much for Gemma's 6,249 special tokens as for SmolLM2's 17."""

    def __init__(self, texts: Iterable[str]):
        texts = sorted(set(texts))
        self._pattern = re.compile(_trie_pattern(texts))
        # Proper prefixes and suffixes: a string ending in "<|im_" and the text after it might
        # spell "<|im_end|>" together.
        self._prefixes = frozenset(t[:i] for t in texts for i in range(1, len(t)))
        self._suffixes = frozenset(t[i:] for t in texts for i in range(1, len(t)))
        self._longest = max(map(len, texts))
        self._chars = frozenset("".join(texts))

    def spans(self, text: str) -> list[tuple[int, int]]:
        return [m.span() for m in self._pattern.finditer(text)]

    def _edges(self, s: str) -> Iterator[int]:
        """Where a mark breaks a special token that s would spell with the text around it:
        after the first character of each end of s that begins one, and before the last
        character of each start of s that ends one."""
        for k in range(1, min(self._longest, len(s) + 1)):
            if s[-k:] in self._prefixes:
                yield len(s) - k + 1
            if s[:k] in self._suffixes:
                yield k - 1

    def mark_for(self, trusted: Sequence[str], values: Any) -> str | None:
        """A character that none of the strings in `values` (nested dicts and lists, keys too)
        nor the `trusted` texts hold, when one of those strings spells a special token or a
        part of one at an end; else None."""
        strings = list(_strings(values))
        if not any(self._pattern.search(s) or next(self._edges(s), None) is not None
                   for s in strings):
            return None
        texts = [*strings, *trusted]
        for code in itertools.chain(range(0xE000, 0xF900), range(0xF0000, 0xFFFFE)):  # private
            mark = chr(code)
            if mark not in self._chars and not any(mark in t for t in texts):
                return mark
        raise ValueError("the request uses every private-use character")

    def escape(self, s: str, mark: str) -> str:
        """s with `mark` inside every special token it spells, and at its ends where the text
        around it could complete one."""
        while found := [m.start() + 1 for m in self._pattern.finditer(s)]:
            s = _insert(s, found, mark)  # again: spellings that overlapped a broken one
        return _insert(s, sorted(set(self._edges(s))), mark)

    def separate(self, marked: str, mark: str) -> str:
        """The rendered text without the marks: a ChatPrompt naming the special tokens the
        template wrote (those that still match), or a plain str where they are all the
        special tokens the text spells."""
        marks = [m.start() for m in re.finditer(re.escape(mark), marked)]
        text = marked.replace(mark, "")
        ours = [(a - bisect.bisect(marks, a), b - bisect.bisect(marks, a))
                for a, b in self.spans(marked)]
        return text if self.spans(text) == ours else ChatPrompt(text, ours)


def _trie_pattern(texts: Sequence[str]) -> str:
    """A regular expression for `texts` that, at a place, matches the longest of them there."""
    trie: dict = {}
    for text in texts:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}

    def pattern(node: dict) -> str:
        branches = [re.escape(ch) + pattern(node[ch]) for ch in sorted(node) if ch]
        if not branches:
            return ""
        if "" in node:  # a text ends here; a longer one first
            return f"(?:{'|'.join(branches)})?"
        return branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"

    return pattern(trie)


def _insert(s: str, positions: Sequence[int], mark: str) -> str:
    if not positions:
        return s
    cuts = [0, *positions, len(s)]
    return mark.join(s[a:b] for a, b in itertools.pairwise(cuts))


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _map_strings(f, value: Any) -> Any:
    """`value` with f applied to every string in it, keys of mappings too (a copy)."""
    if isinstance(value, str):
        return f(value)
    if isinstance(value, Mapping):
        return {_map_strings(f, k): _map_strings(f, v) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(f, v) for v in value]
    if isinstance(value, tuple):
        return tuple(_map_strings(f, v) for v in value)
    return value


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
