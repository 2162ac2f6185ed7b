"""The engines under `Tokenizer` (models/tokenizer.py): text to ids without BOS/EOS, ids to text,
tokens looked up; and, for a rendered chat, the texts between the template's special tokens
encoded with any special token they spell read as text (`encode_around`).

- `HFBackend`: a `tokenizers` pipeline (tokenizer.json, or one rebuilt from a GGUF vocabulary);
- `SentencePieceBackend`: the sentencepiece processor of a tokenizer.model.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

# Texts this long or longer are tokenized with the GIL released: `tokenizers` holds it through an
# `encode` call (a 2 MB text stalled every other thread, the event loop's too, for over a second)
# and releases it in `encode_batch`, which costs a little more on a short text.
_LONG_TEXT = 4096


class HFBackend:
    def __init__(self, hf: HFTokenizer, tokens: Sequence[str] | None = None):
        """`tokens`: the vocabulary as its file spells it, where it is at hand (a GGUF's):
        `get_vocab` takes a second for 262,144 tokens."""
        self.hf = hf
        self._tokens = tokens
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        added = hf.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        # Special tokens that take the whitespace beside them when they match (Phi-3's rstrip).
        self._strips = {i: (t.lstrip, t.rstrip) for i, t in added.items()
                        if t.special and (t.lstrip or t.rstrip)}
        self._plain: HFTokenizer | None = None  # the same, with special tokens read as text
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        if len(text) < _LONG_TEXT:
            return self.hf.encode(text, add_special_tokens=False).ids
        return self.hf.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_around(self, texts: list[str], special_ids: list[int]) -> list[int]:
        """texts[0], special_ids[0], texts[1], ...: special tokens spelt in the texts are text.
        (Tokenizers cut the text at special tokens too, but a Metaspace pre-tokenizer with
        prepend_scheme 'first' prefixes each of these texts as a first one.)"""
        texts = list(texts)
        for n, i in enumerate(special_ids):
            lstrip, rstrip = self._strips.get(i, (False, False))
            if lstrip:
                texts[n] = texts[n].rstrip()
            if rstrip:
                texts[n + 1] = texts[n + 1].lstrip()
        with self._lock:  # a flag on a shared tokenizer would race: a copy keeps it set
            if self._plain is None:
                self._plain = HFTokenizer.from_str(self.hf.to_str())
                self._plain.encode_special_tokens = True
        pieces = self._plain.encode_batch(texts, add_special_tokens=False)  # (GIL released)
        ids = list(pieces[0].ids)
        for i, piece in zip(special_ids, pieces[1:], strict=True):
            ids += [i, *piece.ids]
        return ids

    def pieces(self) -> Iterable[str]:
        return self._tokens if self._tokens is not None else self.hf.get_vocab(
            with_added_tokens=True)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.hf.id_to_token(i)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def save(self, directory: Path) -> dict:
        self.hf.save(str(directory / "tokenizer.json"))
        return {"tokenizer_class": "PreTrainedTokenizerFast"}


class SentencePieceBackend:
    """The processor itself, so its normalizer (often NFKC) applies exactly. It never parses
    special tokens out of text, so we split the text on them first; every text piece then gets
    sentencepiece's dummy-prefix space, as llama.cpp does after a special token."""

    def __init__(self, sp, extra_special_ids: Iterable[int] = ()):
        self.sp = sp
        self.vocab_size = sp.get_piece_size()
        self.special_ids = frozenset(i for i in range(self.vocab_size)
                                     if sp.is_control(i) or sp.is_unknown(i)).union(
                                         extra_special_ids)
        specials = sorted((sp.id_to_piece(i) for i in self.special_ids), key=len, reverse=True)
        self._split = (re.compile("(" + "|".join(map(re.escape, specials)) + ")")
                       if specials else None)

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self.sp.encode(text)
        ids: list[int] = []
        for n, piece in enumerate(self._split.split(text)):
            if n % 2:  # a captured special token
                ids.append(self.sp.piece_to_id(piece))
            elif piece:
                ids.extend(self.sp.encode(piece))
        return ids

    def encode_around(self, texts: list[str], special_ids: list[int]) -> list[int]:
        """texts[0], special_ids[0], texts[1], ...: special tokens spelt in the texts are text."""
        ids: list[int] = []
        for n, text in enumerate(texts):
            if n:
                ids.append(special_ids[n - 1])
            if text:
                # The processor itself matches no control piece (<s>), but does match the
                # user-defined ones HF calls special (Gemma's turn markers): spell those out.
                for i in self.sp.encode(text):
                    ids.extend(self._spell(self.sp.id_to_piece(i)) if i in self.special_ids
                               else [i])
        return ids

    def _spell(self, text: str) -> list[int]:
        """`text` one character at a time: its piece, else its bytes' pieces (<0xAB>)."""
        ids = []
        for ch in text:
            i = self.token_to_id(ch)
            if i is None or i in self.special_ids:
                ids.extend(self.sp.piece_to_id(f"<0x{b:02X}>") for b in ch.encode("utf-8"))
            else:
                ids.append(i)
        return ids

    def pieces(self) -> Iterable[str]:
        return (self.sp.id_to_piece(i) for i in range(self.vocab_size))

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if skip_special_tokens:
            return self.sp.decode([i for i in ids if i not in self.special_ids])
        parts, run = [], []
        for i in ids:
            if i in self.special_ids:
                parts += [self.sp.decode(run), self.sp.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        return "".join([*parts, self.sp.decode(run)])

    def id_to_token(self, i: int) -> str | None:
        return self.sp.id_to_piece(i) if 0 <= i < self.vocab_size else None

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)
        # piece_to_id answers unk for an unknown piece; only the unk piece itself maps there.
        return i if self.sp.id_to_piece(i) == token else None

    def save(self, directory: Path) -> dict:
        (directory / "tokenizer.model").write_bytes(self.sp.serialized_model_proto())
        extra = sorted(i for i in self.special_ids
                       if not (self.sp.is_control(i) or self.sp.is_unknown(i)))
        return {"added_tokens_decoder": {
            str(i): {"content": self.sp.id_to_piece(i), "special": True} for i in extra}}
