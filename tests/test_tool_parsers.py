"""Tool-call parsing: whole replies, and streams that give the same content and calls however the
text is split, never show part of a tag as content, and never invent a call."""

from __future__ import annotations

import json
import random
import re

import pytest

from server.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    ToolStream,
    parser_for_template,
)

HERMES = HermesParser()
LLAMA = Llama3JsonParser()


def _hermes_call(name: str, args: str, key: str = "arguments") -> str:
    return f'<tool_call>\n{{"name": "{name}", "{key}": {args}}}\n</tool_call>'


WEATHER = _hermes_call("get_weather", '{"city": "Paris"}')
HERMES_SAMPLES = [
    WEATHER,
    WEATHER + "\n" + _hermes_call("get_time", '{"tz": "Europe/Paris", "fmt": "24h"}'),
    "Let me check the weather.\n\n" + WEATHER,
    "I use <b>bold</b> and a < b < c, not <tool_cal> tags.",
    _hermes_call("f", '{"q": "a } and a \\" and </tool_call> inside", "n": [1, {"x": null}]}'),
    _hermes_call("f", '{"a": 1}', key="parameters"),
    '<tool_call>{"arguments": {"a": [1, 2]}, "name": "late_name"}</tool_call>',
    _hermes_call("f", '"{\\"a\\": 1}"'),
    '<tool_call>{"name": "no_args"}</tool_call>',
    WEATHER + "\n\nDone, more text after the call.",
    "Café ☕ 日本 " + _hermes_call("é", '{"city": "Zürich 🇨🇭"}'),
    # Broken calls: their text is content.
    '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',
    "<tool_call>\nnot json at all\n</tool_call>",
    '<tool_call>{"name": "f", "arguments": {"city": "Par',
    '<tool_call>{"argu',
    "trailing <tool_ca",
    '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>' + WEATHER,
    '<tool_call>{"name": "f" "arguments": {}}</tool_call>' + WEATHER,  # broken mid-object
]
LLAMA_SAMPLES = [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {"b": "}"}}',
    '{"name": "f", "parameters": {}}\n{"name": "g", "parameters": {"x": [1]}}',
    "  The weather in Paris is sunny.",
    "<|python_tag|>brave_search.call(query='paris')",
    '{"answer": 42}',
    '{"name": "f", "parameters": {"a": ',
    '\n{"name": "f", "parameters": "{\\"a\\": [1, 2]}"}; ',
    '{"name": "f", "parameters": {"a": 1}}; {"name": "g" "parameters": {}}; text',
]


def _run(stream: ToolStream, chunks: list[str]):
    """-> (content, [(name, arguments)] per index, deltas) of a stream fed `chunks`."""
    content, deltas = [], []
    for chunk in chunks:
        text, ds = stream.feed(chunk)
        content.append(text)
        deltas += ds
    text, ds = stream.finish()
    content.append(text)
    deltas += ds
    calls = {}
    for d in deltas:
        if d.id is not None:  # a call's first delta, then only argument fragments
            assert d.index == len(calls) and d.name and re.fullmatch(r"call_[0-9a-f]{24}", d.id)
            calls[d.index] = [d.name, ""]
        else:
            assert d.name is None and d.index in calls
        calls[d.index][1] += d.arguments
    return "".join(content), [tuple(c) for c in calls.values()], deltas


def _splits(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = [[text], list(text)]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


@pytest.mark.parametrize("parser, text", [(HERMES, t) for t in HERMES_SAMPLES]
                         + [(LLAMA, t) for t in LLAMA_SAMPLES])
def test_stream_is_the_same_however_the_text_is_split(parser, text):
    content, calls = parser.parse(text)
    whole = _run(parser.stream(), [text])
    for i, chunks in enumerate(_splits(text, seed=len(text))):
        got = _run(parser.stream(), chunks)
        assert got[:2] == whole[:2], (i, chunks)
    stream = parser.stream()
    got_content, got_calls, _ = _run(stream, [text])
    streamed = [(c.name, c.arguments) for c in stream.calls]
    # Valid calls stream exactly what parse() gives; a broken call is content for parse().
    assert streamed == [(c.name, c.arguments) for c in calls]
    if len(got_calls) == len(streamed):  # no call broke after it was shown
        assert got_calls == streamed
        assert (got_content if got_content.strip() else None) == content


def test_hermes_single_call():
    content, calls = HERMES.parse(WEATHER)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    assert calls[0].arguments == '{"city": "Paris"}'  # as the model wrote it


def test_hermes_content_then_two_calls():
    text = HERMES_SAMPLES[1].replace(WEATHER, "Checking both.\n" + WEATHER, 1)
    content, calls = HERMES.parse(text)
    assert content == "Checking both."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1].arguments) == {"tz": "Europe/Paris", "fmt": "24h"}
    assert len({c.id for c in calls}) == 2
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)


def test_hermes_plain_content_is_untouched():
    text = HERMES_SAMPLES[3]
    assert HERMES.parse(text) == (text, [])
    assert HERMES.parse("  \n ") == (None, [])


@pytest.mark.parametrize("text, name, args", [
    (_hermes_call("f", '{"a": 1}', key="parameters"), "f", {"a": 1}),
    (_hermes_call("f", '"{\\"a\\": 1}"'), "f", {"a": 1}),
    ('<tool_call>{"arguments": {"a": 1}, "name": "g"}</tool_call>', "g", {"a": 1}),
    ('<tool_call>{"name": "h"}</tool_call>', "h", {}),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}', "f", {"a": 1}),  # no closing tag
])
def test_hermes_argument_spellings(text, name, args):
    content, calls = HERMES.parse(text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(name, args)]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',  # invalid JSON
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>{"name": "f", "arguments": {"city": "Par',  # cut by max_tokens
    '<tool_call>{"name": "f", "arguments": 3}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    "<tool_call>\n",
])
def test_hermes_broken_call_is_content(text):
    assert HERMES.parse(text) == (text, [])


def test_hermes_broken_call_keeps_whitespace_and_later_calls():
    text = 'Hi\n<tool_call>{"name": 1}</tool_call>\n' + WEATHER
    content, calls = HERMES.parse(text)
    assert content == 'Hi\n<tool_call>{"name": 1}</tool_call>'
    assert [c.name for c in calls] == ["get_weather"]


def test_stream_shows_partial_tag_only_once_it_is_not_the_tag():
    stream = HERMES.stream()
    shown = [stream.feed(c)[0] for c in ["Let me check", " <", "tool", "_ca"]]
    assert shown == ["Let me check", "", "", ""]
    text, deltas = stream.feed('ll>{"name": "f", "arguments": {}}</tool_call>')
    assert text == "" and [(d.name, d.arguments) for d in deltas] == [("f", "{}")]
    assert stream.finish() == ("", [])

    stream = HERMES.stream()
    assert [stream.feed(c)[0] for c in ["a <", "b", ">bold"]] == ["a", " <b", ">bold"]
    assert stream.feed(" <tool_")[0] == ""
    assert stream.finish()[0] == " <tool_"  # at the end it is not a tag: released


@pytest.mark.parametrize("text", [t for t in HERMES_SAMPLES if "<" not in (HERMES.parse(t)[0] or "")
                                  and HERMES.parse(t)[1]])
def test_no_part_of_a_tag_is_ever_content(text):
    for chunks in _splits(text, seed=0):
        stream = HERMES.stream()
        assert not any("<" in stream.feed(c)[0] for c in chunks)
        assert "<" not in stream.finish()[0]


def test_stream_deltas_flow_as_the_arguments_grow():
    stream = HERMES.stream()
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    pieces = [stream.feed(c) for c in text]
    deltas = [d for _, ds in pieces for d in ds]
    first = deltas[0]
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "")
    # The header goes out when the name's closing quote arrives, before any argument.
    at = next(i for i, (_, ds) in enumerate(pieces) if ds)
    assert text[:at + 1].endswith('"get_weather"')
    fragments = [d.arguments for d in deltas[1:]]
    assert len(fragments) == len('{"city": "Paris"}') and "".join(fragments) == '{"city": "Paris"}'
    assert stream.finish() == ("", [])
    assert [c.name for c in stream.calls] == ["get_weather"]


def test_stream_waits_for_a_late_name():
    stream = HERMES.stream()
    assert stream.feed('<tool_call>{"arguments": {"a": 1}') == ("", [])
    _, deltas = stream.feed(', "name": "f"}')
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "f", '{"a": 1}')]


def test_stream_cut_inside_a_shown_call_is_not_a_call():
    # The client has seen the call's start; it is not repeated as content, and `calls` stays
    # empty so the caller reports the engine's finish_reason ("length"), not "tool_calls".
    text = 'Hm.<tool_call>{"name": "f", "arguments": {"city": "Par'
    content, calls, deltas = _run(HERMES.stream(), [text])
    assert content == "Hm." and calls == [("f", '{"city": "Par')]
    stream = HERMES.stream()
    _run(stream, [text])
    assert stream.calls == []
    assert HERMES.parse(text) == (text, [])


def test_stream_drops_the_rest_of_a_shown_call_broken_inside():
    text = 'Hm.<tool_call>{"name": "f" "arguments": {"a": 1}}</tool_call>\nOk.'
    content, calls, _ = _run(HERMES.stream(), [text])
    assert (content, calls) == ("Hm.Ok.", [("f", "")])
    assert HERMES.parse(text) == (text, [])


def test_stream_calls_carry_the_ids_the_deltas_showed():
    stream = HERMES.stream()
    _, _, deltas = _run(stream, list(HERMES_SAMPLES[1]))
    assert [d.id for d in deltas if d.id] == [c.id for c in stream.calls]


def test_stream_indexes_follow_calls_shown():
    text = ('<tool_call>{"name": "bad", "arguments": {"a": 1,}}</tool_call>\n' + WEATHER)
    stream = HERMES.stream()
    _, calls, _ = _run(stream, [text])
    assert [name for name, _ in calls] == ["bad", "get_weather"]  # two indexes on the wire
    assert [c.name for c in stream.calls] == ["get_weather"]


def test_llama3_calls():
    content, calls = LLAMA.parse(LLAMA_SAMPLES[1])
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"a": 1}), ("g", {"b": "}"})]
    content, calls = LLAMA.parse(LLAMA_SAMPLES[2])
    assert [c.name for c in calls] == ["f", "g"] and calls[0].arguments == "{}"
    content, calls = LLAMA.parse(LLAMA_SAMPLES[7])
    assert content is None and json.loads(calls[0].arguments) == {"a": [1, 2]}


@pytest.mark.parametrize("text", [
    "  The weather in Paris is sunny.",
    "Use {braces} freely.",
    "<|python_tag|>brave_search.call(query='paris')",  # built-in tool syntax: not JSON
    '{"answer": 42}',  # JSON without a name
    '{"name": "f", "parameters": {"a": ',  # cut
])
def test_llama3_non_calls_are_content(text):
    assert LLAMA.parse(text) == (text, [])


def test_llama3_holds_a_partial_python_tag():
    stream = LLAMA.stream()
    assert stream.feed("<|pyth") == ("", [])
    _, deltas = stream.feed('on_tag|>{"name": "f", "parameters": {}}')
    assert [(d.name, d.arguments) for d in deltas] == [("f", "{}")]


def test_ids_are_fresh():
    ids = [c.id for _ in range(50) for c in HERMES.parse(WEATHER)[1]]
    assert len(set(ids)) == 50 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


QWEN = ("{%- if tools %}{{- '<tools>' }}{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}"
        "{{- '</tools>\\nreturn <tool_call>{...}</tool_call>' }}{%- endif %}")
LLAMA31 = ("{%- if tools is not none %}{{- 'Environment: ipython' }}{%- endif %}"
           "{%- if message.tool_calls %}{{- '<|python_tag|>' + tool_call | tojson }}{%- endif %}")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' "
          "+ message['content'] + '<|im_end|>\\n'}}{% endfor %}")


@pytest.mark.parametrize("template, kind", [
    (QWEN, HermesParser), (LLAMA31, Llama3JsonParser), (CHATML, HermesParser),
    (None, HermesParser), ("{{ messages }} ipython", Llama3JsonParser),
])
def test_parser_for_template(template, kind):
    assert type(parser_for_template(template)) is kind
