"""The Responses API's output items (reasoning, message, function call, mcp_call) and, for a
streamed response, `StreamedItems`: the items as chat deltas arrive and the events that
add, grow and finish them (server/responses.py drives it)."""

from __future__ import annotations

import uuid

from engine.tool_loop import ToolCall, ToolResult


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text)] if status == "completed" else []}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed"
            else []}


def call_item(item_id: str, call_id: str, name: str, arguments: str,
               status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def mcp_item(item_id: str, call: ToolCall, server: str, result: ToolResult | None) -> dict:
    item = {"type": "mcp_call", "id": item_id, "server_label": server, "name": call.name,
            "arguments": call.arguments, "output": None, "error": None,
            "status": "in_progress"}
    if result is not None and result.is_error:  # (OpenAI's shape for a tool's own failure)
        item.update(status="failed", error={"type": "mcp_tool_execution_error",
                                            "content": [{"type": "text", "text": result.text}]})
    elif result is not None:
        item.update(status="completed", output=result.text)
    return item


def items_of(message: dict, server_tools: set[str]) -> list[dict]:
    """A finished round's reply as output items (the calls to the server's tools left out)."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"]))
    for call in message.get("tool_calls", ()):
        if call["function"]["name"] not in server_tools:
            items.append(call_item(new_id("fc"), call["id"], call["function"]["name"],
                                    call["function"]["arguments"]))
    return items




class StreamedItems:
    """The output items of a streamed response as chat deltas arrive, and their events: a
    reasoning or message item stays open while its text grows and is done when another item
    starts; function calls are done at the end."""

    def __init__(self, event):
        self._event = event
        self.output: list[dict] = []  # every item, in output order, as it stands
        self._text: int | None = None  # the open reasoning or message item's index
        self._calls: dict[int, int | None] = {}  # a call's index in the reply -> its output
        self._server_tools: set[str] = set()   # index (None: a call of the server's tools)

    def new_round(self, server_tools: set[str]) -> None:
        """The next round's reply: its calls count from 0; the server's own are not shown
        as function calls (they run, and show as mcp_call items)."""
        self._calls, self._server_tools = {}, server_tools

    def add(self, item: dict) -> tuple[int, str]:
        """A whole item added: its index and its event."""
        self.output.append(item)
        index = len(self.output) - 1
        return index, self._event("response.output_item.added", output_index=index,
                                  item=dict(item))

    def feed(self, delta: dict) -> list[str]:
        events = []
        if delta.get("reasoning_content"):
            events += self._grow("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._grow("message", delta["content"])
        for call in delta.get("tool_calls", ()):
            if call["index"] not in self._calls and \
                    call["function"].get("name") in self._server_tools:
                self._calls[call["index"]] = None
            index = self._calls.get(call["index"], -1)
            if index is None:  # the server's own call
                continue
            if index == -1:
                events += self.close_text()
                index = self._calls[call["index"]] = len(self.output)
                self.output.append(call_item(new_id("fc"), call["id"], call["function"]["name"],
                                              "", "in_progress"))
                events.append(self._event("response.output_item.added", output_index=index,
                                          item=dict(self.output[index])))
            arguments = call["function"]["arguments"]
            if arguments:
                self.output[index]["arguments"] += arguments
                events.append(self._event("response.function_call_arguments.delta",
                                          item_id=self.output[index]["id"],
                                          output_index=index, delta=arguments))
        return events

    def _grow(self, kind: str, text: str) -> list[str]:
        events = []
        if self._text is None or self.output[self._text]["type"] != kind:
            events += self.close_text()
            self._text = index = len(self.output)
            item = (message_item if kind == "message" else reasoning_item)(
                new_id("msg" if kind == "message" else "rs"), "", "in_progress")
            self.output.append(item)
            part = (text_part("") if kind == "message"
                    else {"type": "reasoning_text", "text": ""})
            item["content"].append(part)
            events.append(self._event("response.output_item.added", output_index=index,
                                      item={**item, "content": []}))
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=index, content_index=0, part=dict(part)))
        index = self._text
        item = self.output[index]
        item["content"][0]["text"] += text
        kind_event = "output_text" if kind == "message" else "reasoning_text"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(f"response.{kind_event}.delta", item_id=item["id"],
                                  output_index=index, content_index=0, delta=text, **extra))
        return events

    def close_text(self) -> list[str]:
        if self._text is None:
            return []
        index, self._text = self._text, None
        item = self.output[index]
        part = item["content"][0]
        kind_event = "output_text" if item["type"] == "message" else "reasoning_text"
        extra = {"logprobs": []} if item["type"] == "message" else {}
        item["status"] = "completed"
        return [self._event(f"response.{kind_event}.done", item_id=item["id"],
                            output_index=index, content_index=0, text=part["text"], **extra),
                self._event("response.content_part.done", item_id=item["id"],
                            output_index=index, content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def close_all(self) -> list[str]:
        events = self.close_text()
        for index, item in enumerate(self.output):
            if item["type"] != "function_call" or item["status"] == "completed":
                continue
            item["status"] = "completed"
            events.append(self._event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=index,
                                      name=item["name"], arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=index,
                                      item=item))
        return events
