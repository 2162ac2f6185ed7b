"""JSON text as the server takes it: standard JSON that every later step can handle.

Python's json module accepts NaN and Infinity, escapes that decode to lone surrogates (strings
that are not Unicode text, which the tokenizer, the grammar compiler and UTF-8 encoding all
refuse far from the parser), nesting until RecursionError and integers until its digit limit
(a ValueError of another kind). Parsing strictly once, here, turns all of them into one 400.
"""

from __future__ import annotations

from typing import Any

import pydantic_core


class InvalidJSON(ValueError):
    """A body, or a tool call's arguments, that parse_json refuses."""


def parse_json(text: bytes | str) -> Any:
    """A JSON text as Python values, or InvalidJSON for anything but UTF-8 text of standard
    JSON with Unicode strings, nested at most 200 deep, with integers of at most 4,300 digits
    (pydantic-core's parser limits, well inside what recursion and int() take later)."""
    try:
        return pydantic_core.from_json(text, allow_inf_nan=False)
    except ValueError as e:
        hint = " (an escaped surrogate must be half of a pair)" if "escape" in str(e) else ""
        raise InvalidJSON(f"{e}{hint}") from None
