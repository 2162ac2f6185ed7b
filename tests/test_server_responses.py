"""The Responses API (/v1/responses) through the official `openai` client against the live
`python -m server` running the default model: text and items in, output items out, tools,
formats, the event stream, stored responses and their continuation (a long conversation
whose second turn comes from the prefix cache is in tests/test_tool_loop.py, on its server
with a longer context)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import SERVER_KEY

MAX = 24
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
TIME = {"type": "function", "name": "get_time", "description": "The time in a time zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                       "required": ["zone"]}}
QUESTION = "What is the weather like in Paris today?"


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server}/v1", api_key=SERVER_KEY, max_retries=0)


def create(client, **kwargs):
    kwargs.setdefault("max_output_tokens", MAX)
    kwargs.setdefault("temperature", 0.0)
    return client.responses.create(**kwargs)


def calls(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


# ---- text and items ---------------------------------------------------------------------


def test_text_input_gives_a_message(client):
    r = create(client, input="Name three colours.")
    assert r.object == "response" and r.id.startswith("resp_") and r.status in (
        "completed", "incomplete")
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text and r.output[0].content[0].type == "output_text"
    assert r.usage.output_tokens <= MAX and r.usage.total_tokens == (
        r.usage.input_tokens + r.usage.output_tokens)


def test_items_input_equals_text_input(client):
    text = create(client, input="Name three colours.")
    items = create(client, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Name three colours."}]}])
    typed = create(client, input=[{"type": "message", "role": "user",
                                   "content": "Name three colours."}])
    assert text.output_text == items.output_text == typed.output_text
    assert text.usage.input_tokens == items.usage.input_tokens


def test_the_reply_equals_chat_completions(client):
    chat = client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=0.0, max_completion_tokens=MAX,
        messages=[{"role": "system", "content": "Answer in French."},
                  {"role": "user", "content": "Say hello."}])
    r = create(client, instructions="Answer in French.", input="Say hello.")
    assert r.output_text == chat.choices[0].message.content
    assert r.instructions == "Answer in French."
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_instructions_are_the_system_message(client):
    # (SmolLM2's template writes a system message of its own when the chat has none)
    plain = create(client, input="Say hello.")
    told = create(client, input="Say hello.", instructions="Answer in French.")
    assert told.usage.input_tokens != plain.usage.input_tokens


def test_max_output_tokens_makes_it_incomplete(client):
    r = create(client, input="Write a long story about a dragon.", max_output_tokens=5,
               extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.max_output_tokens == 5


def test_seeded_sampling_is_reproducible(client):
    kw = dict(input="Tell me a fact.", temperature=0.8, extra_body={"seed": 7})
    assert create(client, **kw).output_text == create(client, **kw).output_text


def test_settings_are_echoed(client):
    r = create(client, input="Hi.", top_p=0.9, metadata={"run": "42"})
    assert r.temperature == 0.0 and r.top_p == 0.9 and r.metadata == {"run": "42"}
    assert r.store is True and r.previous_response_id is None and r.tools == []


# ---- formats ------------------------------------------------------------------------------


def test_json_schema_format(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = create(client, input="Invent a person.", max_output_tokens=64,
               text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                "strict": True}})
    person = json.loads(r.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert r.text.format.type == "json_schema"


def test_json_object_format(client):
    r = create(client, input="Give me a JSON object about a cat.", max_output_tokens=256,
               text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(r.output_text), dict)


# ---- function tools -------------------------------------------------------------------------


def test_tool_choice_required_calls_a_tool(client):
    r = create(client, input=QUESTION, tools=[WEATHER, TIME], tool_choice="required",
               max_output_tokens=64)
    found = calls(r)
    assert found and all(c.name in ("get_weather", "get_time") for c in found)
    for c in found:
        assert isinstance(json.loads(c.arguments), dict)
        assert c.call_id.startswith("call_") and c.id.startswith("fc_") and c.status == (
            "completed")


def test_named_tool_choice_calls_that_tool(client):
    r = create(client, input=QUESTION, tools=[WEATHER, TIME], max_output_tokens=64,
               tool_choice={"type": "function", "name": "get_time"})
    assert [c.name for c in calls(r)] == ["get_time"]
    assert "zone" in json.loads(calls(r)[0].arguments)
    assert r.tool_choice.name == "get_time"


def test_no_parallel_calls_gives_one_call(client):
    r = create(client, input=QUESTION, tools=[WEATHER, TIME], tool_choice="required",
               parallel_tool_calls=False, max_output_tokens=64)
    assert len(calls(r)) == 1


def test_tool_choice_none_answers_in_text(client):
    r = create(client, input=QUESTION, tools=[WEATHER], tool_choice="none")
    assert not calls(r) and r.output_text


def test_tool_choice_auto_gives_wellformed_items(client):
    r = create(client, input=QUESTION, tools=[WEATHER], tool_choice="auto", max_output_tokens=64)
    assert {item.type for item in r.output} <= {"message", "function_call"}
    assert [t.name for t in r.tools] == ["get_weather"]


def test_a_function_call_output_continues_the_conversation(client):
    first = create(client, input=QUESTION, tools=[WEATHER], tool_choice="required",
                   parallel_tool_calls=False, max_output_tokens=64)
    call = calls(first)[0]
    second = create(client, previous_response_id=first.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": call.call_id,
         "output": json.dumps({"city": "Paris", "weather": "sunny, 21 C"})}])
    assert second.previous_response_id == first.id and second.output_text
    # The second prompt is the first one, its call, the result and a new turn: longer, and
    # the first turn's blocks came from the prefix cache.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0


# ---- stored responses -----------------------------------------------------------------------


def test_get_returns_the_stored_response(client):
    r = create(client, input="Say hello.")
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    assert got.output[0].id == r.output[0].id


def test_delete_then_get_is_404(client):
    r = create(client, input="Say hello.")
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_unstored_response_cannot_be_continued(client):
    r = create(client, input="Say hello.", store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError) as e:
        create(client, input="And again.", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_continuation_carries_the_conversation(client):
    first = create(client, input="My name is Ada. Remember it.")
    second = create(client, input="What is my name?", previous_response_id=first.id)
    alone = create(client, input="What is my name?")
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16


# ---- the event stream -----------------------------------------------------------------------


def _events(client, **kwargs) -> list:
    kwargs.setdefault("max_output_tokens", MAX)
    kwargs.setdefault("temperature", 0.0)
    return list(client.responses.create(stream=True, **kwargs))


def test_stream_order_and_ids_match_the_final_object(client):
    events = _events(client, input="Name three colours.")
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    message = final.output[0]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and {e.item_id for e in deltas} == {message.id}
    assert "".join(e.delta for e in deltas) == message.content[0].text
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    assert message.content[0].text == create(client, input="Name three colours.").output_text


def test_streamed_function_call(client):
    events = _events(client, input=QUESTION, tools=[WEATHER], tool_choice="required",
                     parallel_tool_calls=False, max_output_tokens=64)
    final = events[-1].response
    assert events[-1].type == "response.completed"
    call = [item for item in final.output if item.type == "function_call"][0]
    added = [e for e in events if e.type == "response.output_item.added"
             and e.item.type == "function_call"]
    assert [e.item.id for e in added] == [call.id] and added[0].item.call_id == call.call_id
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done[0].arguments == call.arguments and done[0].item_id == call.id
    assert isinstance(json.loads(call.arguments), dict)


def test_stream_helper_accumulates_the_final_response(client):
    model = client.models.list().data[0].id
    with client.responses.stream(model=model, input="Say hello.", temperature=0.0,
                                 max_output_tokens=8, extra_body={"ignore_eos": True}) as s:
        text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
    # max_output_tokens ends it incomplete: the helper's final response needs "completed"
    schema = {"type": "object", "properties": {"greeting": {"type": "string", "maxLength": 20}},
              "required": ["greeting"], "additionalProperties": False}
    with client.responses.stream(model=model, input="Say hello.", temperature=0.0,
                                 max_output_tokens=64, text={"format": {
                                     "type": "json_schema", "name": "g", "schema": schema}}) as s:
        final = s.get_final_response()
    assert text and final.status == "completed"
    assert set(json.loads(final.output_text)) == {"greeting"}


def test_streamed_incomplete_and_stored(client):
    events = _events(client, input="Write a long story.", max_output_tokens=4,
                     extra_body={"ignore_eos": True})
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    stored = client.responses.retrieve(last.response.id)
    assert stored.output[0].id == last.response.output[0].id
    nxt = create(client, input="Go on.", previous_response_id=last.response.id)
    assert nxt.output_text


# ---- bad requests ----------------------------------------------------------------------------


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "top_logprobs": 3}, "top_logprobs"),
])
def test_bad_requests_are_400s(live_server, body, param):
    r = httpx.post(f"{live_server}/v1/responses", json=body,
                   headers={"Authorization": f"Bearer {SERVER_KEY}"}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        create(client, input="hi", model="no-such-model")
