"""Text <-> token ids, from any of the three places a model keeps its tokenizer.

- a directory with `tokenizer.json`: the HF `tokenizers` library runs it as is;
- a directory with only `tokenizer.model`: the sentencepiece processor runs it;
- a GGUF file: we rebuild the tokenizer from the vocabulary llama.cpp stored in the metadata, as a
  `tokenizers` pipeline. A byte-level ('gpt2') vocabulary gives the ids transformers gives for
  `gguf_file=`; a sentencepiece ('llama') one gives the ids of sentencepiece itself (and of
  transformers for Gemma's, see models/gguf_vocab.py).

Whatever the source, `Tokenizer` adds BOS/EOS itself, from one pair of flags, so the rule that
decides a prompt's first token is visible here rather than hidden in a post-processor. A model whose
files carry no chat template can be given one of ours by name (`default_chat_template`).

Special tokens written in a text become their ids (as in transformers), except in a rendered chat
(`ChatPrompt`), where only the template's own are real and request text spelling one is text.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from models import registry
from models.chat_template import builtin_template
from models.gguf_file import read_metadata
from models.gguf_vocab import NORMAL, VocabError, byte_level_bpe, sentencepiece_bpe
from models.tokenizer_backends import HFBackend, SentencePieceBackend

# Special tokens that end an assistant turn. One of them counts as end-of-generation when the chat
# template writes it, so a chat reply stops at the turn's end even where the model's declared EOS is
# another token (Llama 3's EOS is <|end_of_text|>, its turns end with <|eot_id|>). `<|end|>` is left
# out on purpose: gpt-oss writes it between the channels of one reply.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>",
                      "<|END_OF_TURN_TOKEN|>")


class TokenizerError(ValueError):
    pass


class Tokenizer:
    """One model's tokenizer. Build it with `Tokenizer.from_path`."""

    def __init__(self, backend: HFBackend | SentencePieceBackend, *, source: str,
                 bos_token_id: int | None = None, eos_token_id: int | None = None,
                 pad_token_id: int | None = None, extra_eos_ids: Iterable[int] = (),
                 add_bos_token: bool = False, add_eos_token: bool = False,
                 chat_template: str | None = None):
        self._backend = backend
        self.source = source
        self.vocab_size: int = backend.vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.add_eos_token = add_eos_token and eos_token_id is not None
        self.chat_template = chat_template
        named = {i for i in (bos_token_id, eos_token_id, pad_token_id) if i is not None}
        self.special_token_ids: frozenset[int] = frozenset(backend.special_ids | named)
        self.eos_token_ids: frozenset[int] = self._end_of_generation_ids(extra_eos_ids)

    def _end_of_generation_ids(self, extra_eos_ids: Iterable[int]) -> frozenset[int]:
        # The rule: the declared EOS, the ids the model files list as extra EOS (generation_config,
        # config.json, GGUF eot/eom), and each END_OF_TURN_TOKENS special token the chat template
        # writes.
        ids = {self.eos_token_id, *extra_eos_ids}
        for text in END_OF_TURN_TOKENS:
            i = self._backend.token_to_id(text)
            if i is not None and i in self.special_token_ids and text in (self.chat_template or ""):
                ids.add(i)
        return frozenset(i for i in ids if i is not None)

    def __repr__(self) -> str:
        return (f"Tokenizer({self.source!r}, vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r}, add_bos_token={self.add_bos_token})")

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: str | Path, default_chat_template: str | None = None) -> Tokenizer:
        """`default_chat_template` names one of our templates (models.chat_template.
        BUILTIN_TEMPLATES), used only when the model's files carry no chat template."""
        path = Path(path)
        if path.is_file() and path.suffix == ".gguf":
            return cls.from_gguf(path, default_chat_template)
        if path.is_dir():
            if (path / "tokenizer.json").is_file():
                return cls._from_hf_dir(path, default_chat_template)
            if (path / "tokenizer.model").is_file():
                return cls._from_sentencepiece_dir(path, default_chat_template)
        raise TokenizerError(
            f"{path}: no tokenizer found (expected a .gguf file, or a directory containing "
            f"tokenizer.json or tokenizer.model)")

    @classmethod
    def for_model(cls, path: str | Path) -> Tokenizer:
        """`from_path`, with the built-in chat template of the model's family
        (models/registry.py) for files that carry none, as the engine and tools load it."""
        return cls.from_path(path, registry.builtin_chat_template(path))

    @classmethod
    def from_gguf(cls, path: str | Path, default_chat_template: str | None = None) -> Tokenizer:
        fallback = _builtin(default_chat_template)
        meta = read_metadata(path)
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise TokenizerError(f"{path}: GGUF file has no tokenizer.ggml.tokens")
        types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        scores = meta.get("tokenizer.ggml.scores")
        if len(types) != len(tokens) or (scores is not None and len(scores) != len(tokens)):
            raise TokenizerError(f"{path}: {len(tokens)} tokens but {len(types)} token types and "
                                 f"{len(scores or ())} scores")
        merges = meta.get("tokenizer.ggml.merges")
        try:
            if kind == "gpt2":
                hf = byte_level_bpe(tokens, types, merges, meta.get("tokenizer.ggml.pre"))
            elif kind == "llama":
                hf = sentencepiece_bpe(tokens, types, merges, scores,
                                       meta.get("tokenizer.ggml.unknown_token_id"),
                                       meta.get("tokenizer.ggml.add_space_prefix", True))
            else:
                raise TokenizerError(f"{path}: unsupported GGUF tokenizer model {kind!r} "
                                     "(supported: 'gpt2', 'llama')")
        except VocabError as e:
            raise TokenizerError(f"{path}: {e}") from e
        extra_eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
        return cls(HFBackend(hf, tokens), source=str(path),
                   bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                   eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
                   pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
                   extra_eos_ids=[i for i in extra_eos if i is not None],
                   # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
                   add_bos_token=meta.get("tokenizer.ggml.add_bos_token", kind == "llama"),
                   add_eos_token=meta.get("tokenizer.ggml.add_eos_token", False),
                   chat_template=meta.get("tokenizer.chat_template") or fallback)

    @classmethod
    def _from_hf_dir(cls, path: Path, default_chat_template: str | None) -> Tokenizer:
        fallback = _builtin(default_chat_template)
        try:
            hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:
            raise TokenizerError(f"{path / 'tokenizer.json'}: cannot load ({e})") from e
        backend = HFBackend(hf)
        cfg = _DirConfig(path, backend.token_to_id)
        bos, eos = cfg.token_id("bos_token", "bos_token_id"), cfg.token_id("eos_token", None)
        eos = eos if eos is not None else next(iter(cfg.eos_ids), None)
        # Without explicit flags, do what tokenizer.json's post-processor does (transformers too).
        probe = hf.encode("", add_special_tokens=True).ids
        adds_bos = probe[:1] == [bos]
        adds_eos = len(probe) > adds_bos and probe[-1] == eos
        add_bos = cfg.tokenizer.get("add_bos_token", adds_bos)
        add_eos = cfg.tokenizer.get("add_eos_token", adds_eos)
        return cls(backend, source=str(path), bos_token_id=bos, eos_token_id=eos,
                   pad_token_id=cfg.token_id("pad_token", "pad_token_id"),
                   extra_eos_ids=cfg.eos_ids, add_bos_token=add_bos, add_eos_token=add_eos,
                   chat_template=cfg.chat_template or fallback)

    @classmethod
    def _from_sentencepiece_dir(cls, path: Path, default_chat_template: str | None) -> Tokenizer:
        import sentencepiece

        fallback = _builtin(default_chat_template)
        try:
            sp = sentencepiece.SentencePieceProcessor(model_file=str(path / "tokenizer.model"))
        except Exception as e:
            raise TokenizerError(f"{path / 'tokenizer.model'}: cannot load ({e})") from e
        added = _read_json(path / "tokenizer_config.json").get("added_tokens_decoder", {})
        added_ids = {int(i) for i in added}
        added_ids |= set(_read_json(path / "added_tokens.json").values())
        if beyond := sorted(i for i in added_ids if i >= sp.get_piece_size()):
            raise TokenizerError(
                f"{path}: added tokens {beyond[:5]} lie beyond tokenizer.model's vocabulary "
                f"({sp.get_piece_size()}); only a tokenizer.json can describe them")
        # HF may call a piece special that sentencepiece calls user-defined (Gemma's turn markers).
        backend = SentencePieceBackend(sp, {int(i) for i, t in added.items() if t.get("special")})
        cfg = _DirConfig(path, backend.token_to_id)
        bos, eos = cfg.token_id("bos_token", None), cfg.token_id("eos_token", None)
        bos = bos if bos is not None else _non_negative(sp.bos_id())
        eos = eos if eos is not None else _non_negative(sp.eos_id())
        return cls(backend, source=str(path), bos_token_id=bos, eos_token_id=eos,
                   pad_token_id=cfg.token_id("pad_token", "pad_token_id"),
                   extra_eos_ids=cfg.eos_ids,
                   add_bos_token=cfg.tokenizer.get("add_bos_token", True),  # Llama's default
                   add_eos_token=cfg.tokenizer.get("add_eos_token", False),
                   chat_template=cfg.chat_template or fallback)

    # -- use ------------------------------------------------------------------------------------

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)

    @functools.cached_property
    def special_tokens(self) -> tuple[str, ...]:
        """The texts that `encode` turns into special tokens (`<|im_start|>`)."""
        return tuple(sorted({t for i in self._backend.special_ids
                             if (t := self._backend.id_to_token(i))}))

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """At least the bytes of text any one token stands for: its longest spelling in the
        vocabulary, in UTF-8 (which spells a byte in one to six: 'Ġ' is two, '▁' three, '<0x0A>'
        six). A text of more than `n * max_token_bytes` bytes is more than n tokens, unless a
        normalizer shrinks it first (NFKC, collapsed whitespace)."""
        return max(len(t.encode("utf-8")) for t in self._backend.pieces())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens written in `text` (like `<|im_start|>`) become their ids, as in
        transformers, except in a ChatPrompt: there only its `template_specials` do, and the
        rest is plain text. `add_special_tokens` only decides the BOS/EOS added around it."""
        spans = getattr(text, "template_specials", None)
        ids = self._backend.encode(text) if spans is None else self._encode_chat(text, spans)
        if add_special_tokens:
            if self.add_bos_token:
                ids = [self.bos_token_id, *ids]
            if self.add_eos_token:
                ids.append(self.eos_token_id)
        return ids

    def _encode_chat(self, text: str, spans: Sequence[tuple[int, int]]) -> list[int]:
        # The pieces between the template's special tokens are where tokenizers would cut the
        # text anyway, so each piece's tokens are those of the whole text.
        pieces, specials, start = [], [], 0
        for a, b in spans:
            i = self._backend.token_to_id(text[a:b])
            if i is None or i not in self.special_token_ids:
                raise TokenizerError(f"{text[a:b]!r} is not a special token of {self.source}")
            pieces.append(text[start:a])
            specials.append(i)
            start = b
        pieces.append(text[start:])
        return self._backend.encode_around(pieces, specials)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        token = self._backend.id_to_token(int(i))
        if token is None:
            raise TokenizerError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        return token

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def hf_json(self) -> str | None:
        """The `tokenizers` pipeline as JSON (what grammar engines load), or None for a
        sentencepiece processor (see `token_bytes`)."""
        return self._backend.hf.to_str() if isinstance(self._backend, HFBackend) else None

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` stands for in a sentencepiece vocabulary ('▁' is a space,
        `<0xAB>` one byte); special tokens stand for nothing."""
        if not isinstance(self._backend, SentencePieceBackend):
            raise TypeError("token_bytes is for sentencepiece tokenizers; use hf_json")
        if i in self.special_token_ids:
            return b""
        piece = self._backend.id_to_token(i) or ""
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def save_pretrained(self, directory: str | Path) -> Path:
        """Writes tokenizer files that `from_path(directory)` reads back as this same tokenizer:
        tokenizer.json or tokenizer.model, tokenizer_config.json (special tokens, BOS/EOS flags),
        chat_template.jinja, and the EOS ids in generation_config.json (merged into one there)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = self._backend.save(directory)
        for name, i in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id),
                        ("pad_token", self.pad_token_id)):
            if i is not None:
                config[name] = self.id_to_token(i)
        config.update(add_bos_token=self.add_bos_token, add_eos_token=self.add_eos_token)
        _write_json(directory / "tokenizer_config.json", config)
        if self.chat_template:
            (directory / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
        generation = _read_json(directory / "generation_config.json")
        others = sorted(self.eos_token_ids - {self.eos_token_id})
        generation["eos_token_id"] = [i for i in (self.eos_token_id, *others) if i is not None]
        _write_json(directory / "generation_config.json", generation)
        return directory


def _non_negative(i: int) -> int | None:
    return i if i >= 0 else None


def _builtin(name: str | None) -> str | None:
    # Checked before the files are read, so a wrong name fails whether or not it would be used.
    try:
        return None if name is None else builtin_template(name)
    except ValueError as e:
        raise TokenizerError(str(e)) from e


class _DirConfig:
    """tokenizer_config.json, generation_config.json, config.json and chat_template.jinja of a
    HF model directory: what decides BOS/EOS and the chat template."""

    def __init__(self, path: Path, token_to_id):
        self.tokenizer = _read_json(path / "tokenizer_config.json")
        self.model = _read_json(path / "config.json")
        self.generation = _read_json(path / "generation_config.json")
        self._token_to_id = token_to_id
        eos: list[int] = []
        for cfg in (self.generation, self.model):
            value = cfg.get("eos_token_id")
            eos += value if isinstance(value, list) else [] if value is None else [value]
        self.eos_ids = tuple(dict.fromkeys(eos))
        jinja = path / "chat_template.jinja"  # where transformers >= 4.50 saves it
        template = (jinja.read_text(encoding="utf-8") if jinja.is_file()
                    else self.tokenizer.get("chat_template"))
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        self.chat_template = template

    def token_id(self, name: str, model_key: str | None) -> int | None:
        token = self.tokenizer.get(name)
        if isinstance(token, dict):  # serialized AddedToken
            token = token.get("content")
        if isinstance(token, str) and (i := self._token_to_id(token)) is not None:
            return i
        return self.model.get(model_key) if model_key else None


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: cannot read ({e})") from e
