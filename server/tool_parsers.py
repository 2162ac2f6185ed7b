"""Tool calls out of generated text: a chat reply's OpenAI `tool_calls`, whole or streamed.

Two families of model output:

- Hermes (Qwen2/2.5/3, ChatML templates, our fallback tool prompt): content, then calls written
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- Llama 3 JSON (Llama 3.1/3.2): the reply is `{"name": ..., "parameters": {...}}` objects,
  optionally after `<|python_tag|>`, separated by `;` or newlines; any other reply is content.

`ToolParser.parse(text)` splits a whole reply into content and `ToolCall`s; `ToolParser.stream()`
does the same as text arrives and yields `ToolCallDelta`s the way OpenAI streams them. Both run
one scanner, so a call's streamed argument fragments join to exactly `parse`'s `arguments`: the
arguments object's text as the model wrote it (or the text inside, when it wrote a JSON string).

Broken calls (invalid JSON, no name, cut by max_tokens) never become calls: `parse` returns their
text as content. A stream shows a call as soon as its name is complete, so one found broken later
stays a partial call in what the client has seen; it is left out of `ToolStream.calls` (report
finish_reason "tool_calls" only when `calls` is non-empty) and not repeated as content; if its
JSON broke mid-object, the rest of it is dropped (hermes: up to `</tool_call>`; llama3: the rest
of the reply). A call that breaks before its name is complete goes out as content, as in `parse`.

No HTTP here: text in, dataclasses out.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from engine.grammar import JSON_LAYOUT

_ARG_KEYS = ("arguments", "parameters")
MAX_PARALLEL_CALLS = 8  # calls a constrained reply may hold (parallel_tool_calls)
_WS = " \t\r\n"
_PYTHON_TAG = "<|python_tag|>"
_LLAMA_SEPARATORS = re.compile(r"(?:\s|;|<\|python_tag\|>)*")


@dataclasses.dataclass
class ToolCall:
    id: str  # "call_" + 24 hex digits
    name: str
    arguments: str  # JSON text of the arguments object


@dataclasses.dataclass
class ToolCallDelta:
    """One streamed piece of one call: `id` and `name` come on its first piece only."""

    index: int  # the call's place in this reply
    id: str | None = None
    name: str | None = None
    arguments: str = ""  # a fragment of the arguments JSON text


class _CallScanner:
    """Walks one call's JSON object as it grows: its name, the span of its arguments value, its
    end. Tracks only strings, escapes and nesting; `arguments()` has json check the whole."""

    def __init__(self):
        self.raw = ""  # the object's text so far, from its '{'
        self.pos = 0  # next character to scan
        self.depth = 0
        self.in_str = self.esc = False
        self.str_at = 0
        self.expect = "key"  # at depth 1: key, colon, value, scalar or comma
        self.key: str | None = None
        self.name: str | None = None
        self.args: list | None = None  # [start, end or None] of the arguments value in raw
        self.end: int | None = None  # just past the closing '}'
        self.bad: int | None = None  # where the text stopped being a call object

    def run(self) -> None:
        raw = self.raw
        while self.pos < len(raw) and self.end is None and self.bad is None:
            i, c = self.pos, raw[self.pos]
            self.pos += 1
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
                    if self.depth == 1:
                        self._string(i + 1)
            elif c in _WS:
                pass
            elif self.depth == 0:  # the object's '{': the caller starts raw there
                self.depth = 1
            elif self.depth > 1:  # inside a nested value only its closing matters
                if c == '"':
                    self.in_str = True
                elif c in "{[":
                    self.depth += 1
                elif c in "}]":
                    self.depth -= 1
                    if self.depth == 1:
                        self.expect = "comma"
                        if self.args and self.args[1] is None:
                            self.args[1] = i + 1
            else:
                self._top(i, c)

    def _top(self, i: int, c: str) -> None:
        e = self.expect
        if c == '"' and e in ("key", "value"):
            self.in_str, self.str_at = True, i
        elif c == ":" and e == "colon":
            self.expect = "value"
        elif c == "," and e in ("comma", "scalar"):
            self.expect = "key"
        elif c == "}" and e in ("key", "comma", "scalar"):
            self.depth, self.end = 0, i + 1
        elif e == "value" and c in "{[":
            self.depth = 2
            if self.key in _ARG_KEYS and self.args is None:
                self.args = [i, None]
        elif e in ("value", "scalar"):  # a number, true, false or null: json checks it at the end
            if e == "value" and self.key in _ARG_KEYS and self.args is None:
                self.args = [i, i]  # not an object: arguments() turns the call down
            self.expect = "scalar"
        else:
            self.bad = i

    def _string(self, end: int) -> None:
        try:
            s = json.loads(self.raw[self.str_at:end])
        except ValueError:
            self.bad = self.str_at
            return
        if self.expect == "key":
            self.key, self.expect = s, "colon"
            return
        if self.key == "name" and self.name is None:
            self.name = s
        elif self.key in _ARG_KEYS and self.args is None:
            self.args = [self.str_at, end]
        self.expect = "comma"

    def partial_arguments(self) -> str:
        """The arguments text scanned so far, when it can be shown as it grows (an object)."""
        if self.args is None or self.raw[self.args[0]] != "{":
            return ""  # a string value is shown whole, once decoded
        return self.raw[self.args[0]:self.args[1] or self.pos]

    def arguments(self) -> str | None:
        """The finished call's arguments text, or None when the call is broken."""
        try:
            json.loads(self.raw[:self.end])
        except (ValueError, RecursionError):  # (a reply can nest deeper than json recurses)
            return None
        if not self.name:
            return None
        if self.args is None:
            return "{}"  # a function without parameters
        text = self.raw[self.args[0]:self.args[1]]
        if text.startswith('"'):  # arguments written as a JSON string: use the JSON it holds
            text = json.loads(text).strip()
            try:
                if not isinstance(json.loads(text), dict):
                    return None
            except (ValueError, RecursionError):
                return None
        elif not text.startswith("{"):
            return None
        return text


class ToolParser:
    """How one model family marks its calls; `ToolStream` does the parsing for both."""

    open_tag: str | None  # what opens each call; None: calls are the reply itself
    close_tag: str | None
    first_state: str  # the stream's state at the start of the reply
    after_call: str  # its state after a call's closing '}'
    arguments_key: str  # what this family names a call's arguments when it writes them
    separator: str  # between two calls of one reply

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Whole reply -> (content, or None when empty or whitespace only; calls)."""
        stream = ToolStream(self, eager=False)
        content = stream.feed(text)[0] + stream.finish()[0]
        return (content if content.strip() else None), stream.calls

    def stream(self) -> ToolStream:
        return ToolStream(self)

    def grammar(self, tools: list[dict], parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect, `%json` for a schema) whose every sentence is
        a reply of calls to `tools` ([{"name", "parameters"}]) in this family's format: what
        tool_choice "required" or a named function constrains generation to, so the call
        always parses. Up to MAX_PARALLEL_CALLS calls when `parallel`, else one."""
        call = {"anyOf": [{
            "type": "object",
            "properties": {"name": {"const": t["name"]},
                           self.arguments_key: t.get("parameters") or {"type": "object"}},
            "required": ["name", self.arguments_key],
            "additionalProperties": False} for t in tools], "x-guidance": JSON_LAYOUT}
        more = (f' ({json.dumps(self.separator)} call){{0,{MAX_PARALLEL_CALLS - 1}}}'
                if parallel else "")
        tagged = "body"
        if self.open_tag:
            opening, closing = json.dumps(self.open_tag + "\n"), json.dumps("\n" + self.close_tag)
            tagged = f"{opening} body {closing}"
        return f"start: call{more}\ncall: {tagged}\nbody: %json {json.dumps(call)}\n"


class HermesParser(ToolParser):
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    first_state, after_call = "content", "close"
    arguments_key, separator = "arguments", "\n"


class Llama3JsonParser(ToolParser):
    open_tag = close_tag = None
    first_state = after_call = "between"
    arguments_key, separator = "parameters", "; "


class ToolStream:
    """One reply parsed as it arrives. States (methods of the same name):

    content   ordinary text; hermes watches it for `<tool_call>` (llama3: the rest is content)
    open      after `<tool_call>`: whitespace, then the call's '{'
    call      inside a call's JSON object
    close     after a call's '}': whitespace, then `</tool_call>` (tolerated when missing)
    skip      the rest of a call that broke after it was shown
    between   llama3 before and between calls: whitespace, ';', `<|python_tag|>`, then '{'
    """

    def __init__(self, parser: ToolParser, eager: bool = True):
        self.parser = parser
        self.eager = eager  # show calls as they form; parse() waits for each to end
        self.calls: list[ToolCall] = []  # complete, valid calls so far
        self.state = parser.first_state
        self.buf = ""  # text not consumed yet
        self.attempt = ""  # a call's text before its '{': content again if the call breaks
        self.after_call = False  # whitespace right after a call is layout, not content
        self.sent = 0  # calls shown so far: the next call's delta index
        self.scan: _CallScanner | None = None
        self.id, self.index, self.args_sent = "", None, 0  # the call being read
        self._text: list[str] = []
        self._deltas: list[ToolCallDelta] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """New text of the reply -> (content to show now, call deltas now)."""
        self.buf += delta
        while getattr(self, "_" + self.state)(False):
            pass
        return self._take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of the reply: what was held back goes out; a call left open is broken."""
        while getattr(self, "_" + self.state)(True):
            pass
        return self._take()

    def _content(self, final: bool) -> bool:
        if self.after_call:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            self.after_call = False
        tag = self.parser.open_tag
        at = self.buf.find(tag) if tag else -1
        if at >= 0:
            before = self.buf[:at]
            self._text.append(before.rstrip())  # whitespace before a call: kept if the call breaks
            self.attempt = before[len(before.rstrip()):] + tag
            self.buf = self.buf[at + len(tag):]
            self.state = "open"
            return True
        cut = len(self.buf)
        if tag and not final:  # hold back what may be the tag's start, and whitespace before it
            cut = len(self.buf[:cut - _partial_suffix(self.buf, tag)].rstrip())
        self._text.append(self.buf[:cut])
        self.buf = self.buf[cut:]
        return False

    def _open(self, final: bool) -> bool:
        rest = self.buf.lstrip()
        self.attempt += self.buf[:len(self.buf) - len(rest)]
        self.buf = rest
        if rest.startswith("{"):
            return self._start_call()
        if rest or final:
            return self._abandon()
        return False

    def _between(self, final: bool) -> bool:
        skip = _LLAMA_SEPARATORS.match(self.buf).end()
        self.attempt += self.buf[:skip]
        self.buf = self.buf[skip:]
        if self.buf.startswith("{"):
            return self._start_call()
        if not final and _PYTHON_TAG.startswith(self.buf):  # nothing yet, or part of the tag
            return False
        if self.sent == 0:  # not a call reply: content as written; after calls, separators go
            self._text.append(self.attempt)
        self.attempt, self.state = "", "content"
        return True

    def _close(self, final: bool) -> bool:
        rest, tag = self.buf.lstrip(), self.parser.close_tag
        if rest.startswith(tag):
            rest = rest[len(tag):]
        elif not final and tag.startswith(rest):
            self.buf = rest
            return False
        self.buf, self.state, self.after_call = rest, "content", True
        return True

    def _skip(self, final: bool) -> bool:
        # Where a shown call's object broke, its end is a guess: hermes drops up to its
        # closing tag; llama3, having none, drops the rest of the reply.
        tag = self.parser.close_tag
        at = self.buf.find(tag) if tag else -1
        if at < 0:
            keep = _partial_suffix(self.buf, tag) if tag and not final else 0
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        self.buf, self.state, self.after_call = self.buf[at + len(tag):], "content", True
        return True

    def _start_call(self) -> bool:
        self.scan = _CallScanner()
        self.id, self.index, self.args_sent = f"call_{uuid.uuid4().hex[:24]}", None, 0
        self.state = "call"
        return True

    def _call(self, final: bool) -> bool:
        sc = self.scan
        sc.raw += self.buf
        self.buf = ""
        sc.run()
        if self.eager and sc.name:
            self._send(sc.partial_arguments())
        stop = sc.end if sc.end is not None else sc.bad
        if stop is None:  # the object is still open
            return self._abandon() if final else False
        self.buf, sc.raw = sc.raw[stop:], sc.raw[:stop]
        args = sc.arguments() if sc.end is not None else None
        if args is None:
            return self._abandon()
        self._send(args)
        self.calls.append(ToolCall(self.id, sc.name, args))
        self.attempt, self.scan, self.state = "", None, self.parser.after_call
        return True

    def _abandon(self) -> bool:
        """A broken call: what the client has not seen as a call goes out as content."""
        if self.index is None:
            self._text.append(self.attempt + (self.scan.raw if self.scan else ""))
            self.state = "content"
        elif self.scan and self.scan.end is None:  # shown, and broken inside: drop the rest of it
            self.state = "skip"
        else:  # shown as a call, which cannot be taken back
            self.state = self.parser.after_call
        self.attempt, self.scan, self.after_call = "", None, False
        return True

    def _send(self, args: str) -> None:
        if self.index is None:
            self.index, self.sent = self.sent, self.sent + 1
            self._deltas.append(ToolCallDelta(self.index, self.id, self.scan.name))
        if len(args) > self.args_sent:
            self._deltas.append(ToolCallDelta(self.index, arguments=args[self.args_sent:]))
            self.args_sent = len(args)

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        deltas: list[ToolCallDelta] = []
        for d in self._deltas:  # a call's pieces from one step go out as one delta
            if deltas and deltas[-1].index == d.index and d.id is None:
                deltas[-1].arguments += d.arguments
            else:
                deltas.append(d)
        content = "".join(self._text)
        self._text, self._deltas = [], []
        return content, deltas


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1)
                 if text.endswith(tag[:n])), 0)


def parser_for_template(template_source: str | None) -> ToolParser:
    """Llama 3 JSON for templates that speak `<|python_tag|>`/ipython; Hermes otherwise: for
    templates with `<tool_call>`, for those without tools (the server then adds a hermes tool
    prompt), and as the best guess for any other tool format."""
    src = template_source or ""
    if "<tool_call>" not in src and (_PYTHON_TAG in src or "ipython" in src):
        return Llama3JsonParser()
    return HermesParser()
