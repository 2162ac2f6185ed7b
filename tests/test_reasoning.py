"""Reasoning separation (`--reasoning-parser`): the parser on its own, whole and streamed under
every split of the text, then the official `openai` client against a live server on the
default model, whose reply a regex forces into a think block."""

from __future__ import annotations

import itertools
import json

import openai
import pytest
from conftest import SERVER_KEY, default_model_server
from test_server_openai import MODEL

from server.reasoning import REASONING_PARSERS, ReasoningParser

PARSER = ReasoningParser("qwen3")

# reply -> (reasoning, content) as a whole reply splits
WHOLE = {
    "<think>ab</think>\n\nHi": ("ab", "Hi"),
    "<think>\nstep one\n</think>\n\nThe answer.\n": ("\nstep one\n", "The answer.\n"),
    "ab</think> Hi": ("ab", "Hi"),  # the prompt opened the block
    "Hi there": (None, "Hi there"),
    "<think>cut off": (None, "<think>cut off"),  # no </think>: the model did not think
    "<think>ab</think>": ("ab", None),
    "<think>ab</think> \n ": ("ab", None),
    "</think>Hi": (None, "Hi"),
    "<think></think>Hi": (None, "Hi"),
    "Sure. <think>x</think> y": ("x", "Sure. y"),
    "<think>a<think>b</think>c": ("a<think>b", "c"),
    "<think>a</think>b</think><think>c": ("a", "b</think><think>c"),
    "<thinking>a</thinking>": (None, "<thinking>a</thinking>"),
    "a < b </think> <think>": ("a < b ", "<think>"),
    "": (None, ""),
}


def test_whole_reply_split():
    for text, expected in WHOLE.items():
        assert PARSER.split(text) == expected, text


def test_both_names_and_unknown_name():
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}
    assert ReasoningParser("deepseek_r1").split("<think>a</think>b") == ("a", "b")
    with pytest.raises(ValueError, match="qwen3"):
        ReasoningParser("granite")


def test_a_prompt_opens_the_block_only_when_it_ends_with_the_tag():
    assert PARSER.opened_by("<|im_start|>assistant\n<think>\n")
    assert PARSER.opened_by("<｜Assistant｜><think>")
    assert not PARSER.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    assert not PARSER.opened_by("user: what does <think> mean?\nassistant:")
    assert not PARSER.opened_by("")


class ShortTags(ReasoningParser):
    """The same machine with 3- and 4-character tags, so every split of a reply with both
    tags is few enough to try them all."""

    start_tag, end_tag = "<t>", "</t>"


def run(pieces: list[str], prompt: str = "", parser: ReasoningParser = PARSER
        ) -> list[tuple[str, str]]:
    """Each piece's (reasoning, content) out of one stream, and finish()'s last."""
    stream = parser.stream(prompt)
    return [stream.feed(p) for p in pieces] + [stream.finish()]


def joined(outs: list[tuple[str, str]]) -> tuple[str | None, str | None]:
    reasoning = "".join(r for r, _ in outs)
    content = "".join(c for _, c in outs)
    return reasoning or None, content or None


def every_split(text: str):
    """Every way to cut `text` into non-empty pieces (2 ** (len - 1) of them)."""
    for cuts in itertools.product((False, True), repeat=max(len(text) - 1, 0)):
        pieces, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                pieces.append(text[start:i])
                start = i
        yield pieces + [text[start:]]


def few_splits(text: str):
    """Every cut into two or three pieces, and one character at a time."""
    n = len(text)
    yield [text]
    yield list(text)
    for i in range(1, n):
        yield [text[:i], text[i:]]
        for j in range(i + 1, n):
            yield [text[:i], text[i:j], text[j:]]


# Replies whose stream joins to exactly the whole split: blocks that close, and no tags.
AGREE = ["<think>ab</think>\n Hi", "x<think>a</think>y", "<think></think> \nz", "a<b</thi>c",
         "<think>a<think>b</think>c", "<think>a</think>b<think>", "plain < text"]
OPENED = "<|im_start|>assistant\n<think>\n"  # a prompt that leaves the reply inside the block
AFTER_OPENED = ["ab</think>\n Hi", "<think>a</think>b", "a</think>", "\n</think>\n"]


def short(text: str) -> str:
    return text.replace("<think>", "<t>").replace("</think>", "</t>")


@pytest.mark.parametrize("text", AGREE)
def test_every_split_of_a_stream_joins_to_the_whole_split(text):
    expected = PARSER.split(text)
    for pieces in few_splits(text):
        assert joined(run(pieces)) == expected, pieces
    text, parser = short(text), ShortTags("qwen3")
    expected = parser.split(text)
    assert expected == tuple(short(x) if x else x for x in PARSER.split(text.replace(
        "</t>", "</think>").replace("<t>", "<think>")))
    count = 0
    for pieces in every_split(text):
        assert joined(run(pieces, parser=parser)) == expected, pieces
        count += 1
    assert count == 2 ** (len(text) - 1)


@pytest.mark.parametrize("text", AFTER_OPENED)
def test_every_split_after_a_prompt_that_opened_the_block(text):
    for parser, prompt, cut in ((PARSER, OPENED, few_splits),
                                (ShortTags("qwen3"), short(OPENED), every_split)):
        text = short(text) if parser is not PARSER else text
        expected = parser.split(text)
        for pieces in cut(text):
            outs = run(pieces, prompt, parser)
            assert joined(outs) == expected, pieces
            kinds = [k for r, c in outs for k, s in (("r", r), ("c", c)) if s]
            assert kinds == sorted(kinds, reverse=True), pieces  # reasoning, then content


def test_partial_tags_are_held_back_and_never_sent():
    stream = PARSER.stream()
    assert stream.feed("Hello <thi") == ("", "Hello ")
    assert stream.feed("nk>plan") == ("plan", "")
    assert stream.feed(" more</") == (" more", "")
    assert stream.feed("think") == ("", "")
    assert stream.feed(">") == ("", "")
    assert stream.feed("\n\n") == ("", "")  # whitespace after the block is dropped
    assert stream.feed(" Bye <think>") == ("", "Bye <think>")  # after the block: all content
    assert stream.finish() == ("", "")


def test_a_held_piece_that_is_not_a_tag_goes_out():
    stream = PARSER.stream()
    assert stream.feed("a <think") == ("", "a ")
    assert stream.feed("ing> b") == ("", "<thinking> b")
    stream = PARSER.stream()
    assert stream.feed("<think>x</th") == ("x", "")
    assert stream.finish() == ("</th", "")  # the reply ended: it was reasoning text
    stream = PARSER.stream()
    assert stream.feed("no tags <") == ("", "no tags ")
    assert stream.finish() == ("", "<")


def test_where_a_stream_cannot_agree_with_the_whole_split():
    # A block cut off (max_tokens) has streamed as reasoning; whole, it is content.
    assert joined(run(["<think>cut ", "off"])) == ("cut off", None)
    assert PARSER.split("<think>cut off") == (None, "<think>cut off")
    # A </think> the stream never saw open comes too late: the text before it has gone out
    # as content, and the tag is dropped.
    assert joined(run(["ab", "</think> Hi"])) == (None, "abHi")
    assert PARSER.split("ab</think> Hi") == ("ab", "Hi")


# ---- a live server ---------------------------------------------------------------------------

THINK = r"<think>[a-z][a-z ]{0,29}</think>\n[A-Za-z][A-Za-z ]{0,29}"
ASK = [{"role": "user", "content": "Think first, then tell me the capital of France."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
# A call written inside the think block, then plain content.
CALL_IN_THOUGHT = (r'<think><tool_call>\n\{"name": "get_weather", "arguments": '
                   r'\{"city": "Paris"\}\}\n</tool_call></think>\nI will not call it')
CALL_AFTER = (r'<think>[a-z][a-z ]{0,19}</think>\n<tool_call>\n\{"name": "get_weather", '
              r'"arguments": \{"city": "[A-Z][a-z]{1,9}"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def reasoning_server(default_gguf, tmp_path_factory):
    """The live server's setup with --reasoning-parser qwen3, for this module."""
    log = tmp_path_factory.mktemp("reasoning-server") / "server.log"
    with default_model_server(log, "--reasoning-parser", "qwen3") as url:
        yield url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=SERVER_KEY, max_retries=0)


@pytest.fixture(scope="module")
def on(reasoning_server):
    return _client(reasoning_server)


@pytest.fixture(scope="module")
def off(live_server):
    return _client(live_server)


def chat(client, regex: str, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=120, temperature=0.0,
        extra_body={"structured_outputs": {"regex": regex}}, **kwargs)


def streamed(client, regex: str, **kwargs) -> tuple[list, str | None]:
    """The chunks' deltas and the last finish_reason."""
    deltas, finish = [], None
    for chunk in chat(client, regex, stream=True, **kwargs):
        if chunk.choices:
            deltas.append(chunk.choices[0].delta)
            finish = chunk.choices[0].finish_reason or finish
    return deltas, finish


def test_reasoning_and_content_split_the_reply_exactly_whole_and_streamed(on, off):
    whole = chat(off, THINK).choices[0].message
    text = whole.content
    assert getattr(whole, "reasoning_content", None) is None  # parser off: all content
    assert text.startswith("<think>") and "</think>\n" in text
    thought, after = text[len("<think>"):].split("</think>", 1)

    msg = chat(on, THINK).choices[0].message
    assert msg.reasoning_content == thought and thought
    assert msg.content == after.lstrip() and msg.content
    assert f"<think>{msg.reasoning_content}</think>\n{msg.content}" == text

    deltas, finish = streamed(on, THINK)
    assert finish == "stop"
    pieces = [(getattr(d, "reasoning_content", None) or "", d.content or "") for d in deltas]
    assert "".join(r for r, _ in pieces) == thought
    assert "".join(c for _, c in pieces) == msg.content
    last_thought = max(i for i, (r, _) in enumerate(pieces) if r)
    assert not any(c for _, c in pieces[:last_thought])  # content only after the reasoning
    assert len([r for r, _ in pieces if r]) > 1  # it streamed, not one piece at the end

    # The same reply streamed by the server without the parser is all content.
    plain = streamed(off, THINK)[0]
    assert "".join(d.content or "" for d in plain) == text
    assert all(getattr(d, "reasoning_content", None) is None for d in plain)


def test_tool_calls_are_parsed_from_the_content_only(on, off):
    # parser off: the call written in the reply's think block is a call
    assert chat(off, CALL_IN_THOUGHT, tools=[WEATHER]).choices[0].message.tool_calls
    # parser on: it is reasoning; the content after the block is plain text
    r = chat(on, CALL_IN_THOUGHT, tools=[WEATHER])
    msg = r.choices[0].message
    assert not msg.tool_calls and r.choices[0].finish_reason == "stop"
    assert msg.reasoning_content.startswith("<tool_call>") and "Paris" in msg.reasoning_content
    assert msg.content == "I will not call it"
    deltas, finish = streamed(on, CALL_IN_THOUGHT, tools=[WEATHER])
    assert finish == "stop" and not any(d.tool_calls for d in deltas)
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) \
        == msg.reasoning_content
    assert "".join(d.content or "" for d in deltas) == msg.content

    # A call after the block is a call, and the block is its reasoning.
    r = chat(on, CALL_AFTER, tools=[WEATHER])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.reasoning_content and "<" not in msg.reasoning_content
    [call] = msg.tool_calls
    assert call.function.name == "get_weather"
    city = json.loads(call.function.arguments)["city"]
    deltas, finish = streamed(on, CALL_AFTER, tools=[WEATHER])
    assert finish == "tool_calls" and not "".join(d.content or "" for d in deltas)
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) \
        == msg.reasoning_content
    pieces = [tc for d in deltas for tc in d.tool_calls or []]
    assert [p.function.name for p in pieces if p.id] == ["get_weather"]
    assert json.loads("".join(p.function.arguments or "" for p in pieces))["city"] == city


def test_no_think_block_is_all_content_and_completions_are_untouched(on):
    msg = chat(on, r"[A-Z][a-z]{2,20}").choices[0].message
    assert msg.content and getattr(msg, "reasoning_content", None) is None
    r = on.completions.create(model=MODEL, prompt="Think:", max_tokens=60, temperature=0.0,
                              extra_body={"structured_outputs": {"regex": THINK}})
    text = r.choices[0].text
    assert text.startswith("<think>") and "</think>" in text
