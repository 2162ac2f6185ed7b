"""Streaming token ids -> text deltas, one token at a time.

A code point can span several tokens (an emoji is often 2-4 byte-level tokens), and a
sentencepiece decoder drops the space that starts a text, so decoding each token alone is wrong.
As in vLLM, we decode two short windows of the ids that end at the newest token and emit what the
longer one adds to the shorter:

    ids:   ... [prefix_offset ....... read_offset ......... len(ids))
    prefix_text = decode(ids[prefix_offset:read_offset])   # already emitted
    new_text    = decode(ids[prefix_offset:])              # emit new_text[len(prefix_text):]

A delta whose text ends in U+FFFD is an unfinished character: it is held back until a later token
completes it (or `flush` at the end). Both offsets move up after each emission, so the windows stay
a few tokens long and each step costs O(window), not O(length of the output).
"""

from __future__ import annotations

from collections.abc import Sequence

from models.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context for the first output token (vLLM uses 5 as well).
PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only the prompt's tail matters: it gives the first output token its left context.
        self._ids: list[int] = [int(i) for i in prompt_ids[-PROMPT_CONTEXT:]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.output_ids: list[int] = []
        self.text = ""

    def add(self, token_id: int) -> str:
        """Returns the text this token finalizes; '' while a character is still incomplete."""
        self._ids.append(int(token_id))
        self.output_ids.append(int(token_id))
        emitted, new_text = self._windows()
        if len(new_text) <= emitted or new_text.endswith(REPLACEMENT):
            return ""
        delta = new_text[emitted:]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._trim()
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emits whatever is held back (text ending in an incomplete character) at the end of a
        stream, so that `text` is everything the output ids decode to."""
        emitted, new_text = self._windows()
        delta = new_text[emitted:]
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def _windows(self) -> tuple[int, str]:
        """(length of the already emitted part of new_text, new_text)."""
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], skip)
        new_text = decode(self._ids[self._prefix_offset:], skip)
        if not new_text.startswith(prefix_text):
            # The prompt ended inside a character: its U+FFFD at the end of prefix_text is a real
            # character in new_text, completed by the output. Emit that whole character.
            return len(prefix_text.rstrip(REPLACEMENT)), new_text
        return len(prefix_text), new_text

    def _trim(self) -> None:
        # Ids left of prefix_offset are never read again; drop them to keep memory O(window).
        if self._prefix_offset > 64:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
