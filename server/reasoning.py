"""Reasoning out of generated text: a chat reply's `<think>...</think>` block becomes OpenAI's
`reasoning_content` (vLLM's field), the rest its `content`, whole or streamed.

`--reasoning-parser qwen3` and `deepseek_r1` name the same rules here (vLLM's Qwen3 parser):

- `<think>R</think>C`: reasoning R, content C without the whitespace that follows `</think>`.
  Text the model wrote before `<think>` stays content.
- `R</think>C` (templates that end the prompt with `<think>`): reasoning R, content C.
- no `</think>` at all: everything is content, as written (the model did not think).

`ReasoningParser.split(text)` applies these to a whole reply. `ReasoningParser.stream(prompt)`
does it as text arrives: reasoning inside the block, content after it, and what may be the
start of a tag held back until it is known, so no tag or piece of one reaches the client. A
stream cannot take back what it has sent, so it decides the start of the reply from the prompt:
a prompt that ends with `<think>` opens the block. Where a reply closes the block it opened (in
the reply or the prompt), or has no tags, the streamed pieces join to exactly `split`'s result.
Where it does not, they differ: a block cut off by max_tokens has streamed as reasoning (`split`
calls it content), and a `</think>` the stream never saw open is dropped while the text before
it has gone out as content (`split` calls that text reasoning).

No HTTP here: text in, text out.
"""

from __future__ import annotations

from server.tool_parsers import _partial_suffix

REASONING_PARSERS = ("qwen3", "deepseek_r1")  # vLLM's names; both mean `<think>...</think>`


class ReasoningParser:
    """The `<think>...</think>` format, under any of the names in REASONING_PARSERS."""

    start_tag, end_tag = "<think>", "</think>"

    def __init__(self, name: str):
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r} "
                             f"(choose from {', '.join(REASONING_PARSERS)})")
        self.name = name

    def split(self, text: str) -> tuple[str | None, str | None]:
        """Whole reply -> (reasoning, content); reasoning None when the reply has no
        `</think>` or the block is empty, content None when nothing follows the block."""
        head, tag, tail = text.partition(self.end_tag)
        if not tag:
            return None, text
        before, tag, reasoning = head.partition(self.start_tag)
        if not tag:
            before, reasoning = "", head
        return reasoning or None, (before + tail.lstrip()) or None

    def opened_by(self, prompt: str) -> bool:
        """Whether the rendered prompt leaves the reply inside a block (its last words are
        `<think>`, as DeepSeek-R1's and Qwen3 thinking models' templates write)."""
        return prompt.rstrip().endswith(self.start_tag)

    def stream(self, prompt: str = "") -> ReasoningStream:
        return ReasoningStream(self, self.opened_by(prompt))


class ReasoningStream:
    """One reply split as it arrives. States:

    start      no tag yet, the block not open: content; `<think>` opens the block
    reasoning  inside the block: reasoning until `</think>` (a `<think>` first is dropped)
    after      right after `</think>`: whitespace is dropped until the content starts
    content    the rest of the reply, as it comes (no more tags are looked for)
    """

    def __init__(self, parser: ReasoningParser, opened: bool = False):
        self.parser = parser
        self.state = "reasoning" if opened else "start"
        self.seen_start = False  # a `<think>` in the reply: another is reasoning text
        self.buf = ""  # held back: what may be the start of a tag

    def feed(self, delta: str) -> tuple[str, str]:
        """New text of the reply -> (reasoning to show now, content to show now)."""
        return self._run(self.buf + delta, final=False)

    def finish(self) -> tuple[str, str]:
        """End of the reply: a held-back piece of a tag that never came is text after all."""
        return self._run(self.buf, final=True)

    def _run(self, text: str, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        self.buf = ""
        while text:
            if self.state == "content":
                content.append(text)
                break
            if self.state == "after":
                text = text.lstrip()
                if text:
                    self.state = "content"
                continue
            tags = self._tags()
            out = content if self.state == "start" else reasoning
            found = min(((text.find(t), t) for t in tags if t in text), default=None)
            if found is None:
                keep = 0 if final else max(_partial_suffix(text, t) for t in tags)
                out.append(text[:len(text) - keep])
                self.buf = text[len(text) - keep:]
                break
            at, tag = found
            out.append(text[:at])
            text = text[at + len(tag):]
            if tag == self.parser.start_tag:
                self.state, self.seen_start = "reasoning", True
            else:  # `</think>`; in start, one the stream never saw open: dropped (see above)
                self.state = "after"
        return "".join(reasoning), "".join(content)

    def _tags(self) -> tuple[str, ...]:
        p = self.parser
        return (p.end_tag,) if self.seen_start else (p.start_tag, p.end_tag)

