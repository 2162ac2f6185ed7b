"""GGUF vocabularies -> HF `tokenizers` pipelines.

llama.cpp stores a tokenizer as metadata: tokens, token types, merges or scores.
A byte-level ('gpt2') vocabulary becomes the pipeline transformers builds for
`gguf_file=`; a sentencepiece ('llama') one behaves like sentencepiece itself.
"""

from __future__ import annotations

from functools import cache

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer


class VocabError(ValueError):
    pass


# llama.cpp token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split regexes for byte-level vocabularies, by `tokenizer.ggml.pre`. A name not here
# (gpt2, smollm, ...) gets the GPT-2 split built into `ByteLevel`, as in transformers. llama.cpp
# also isolates every digit first for smollm/starcoder ("\p{N}"); transformers does not, and we
# follow transformers so our ids equal the reference's: "a   1" is [a, ĠĠ, Ġ, 1] here and in
# transformers, [a, ĠĠĠ, 1] in llama.cpp.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BYTE_LEVEL_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3",
                     "pixtral"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}



@cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes stand for themselves, the
    rest take the code points from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    spelling, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _add_vocab_tokens(hf: HFTokenizer, tokens: list[str], types: list[int],
                      special_types: tuple[int, ...], skip: frozenset[int] = frozenset()) -> None:
    # Control tokens (and unk) are special: skipped by decode(skip_special_tokens=True). Both they
    # and user-defined tokens are matched whole in the text, never cut by BPE. They are already in
    # the model vocabulary, so they keep their ids.
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, k in zip(tokens, types, strict=True) if k in special_types])
    hf.add_tokens([AddedToken(t, special=False, normalized=False)
                   for i, (t, k) in enumerate(zip(tokens, types, strict=True))
                   if k == USER_DEFINED and i not in skip])


def byte_level_bpe(tokens: list[str], types: list[int], merges: list[str] | None,
                    pre: str | None) -> HFTokenizer:
    if merges is None:
        raise VocabError("byte-level ('gpt2') GGUF vocabulary without tokenizer.ggml.merges")
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        # A few converters store a plain token in raw UTF-8; BPE knows it by its byte spelling.
        # Control/user-defined tokens keep their text, which is what they match in the input.
        if kind not in (CONTROL, USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    hf = HFTokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    split = BYTE_LEVEL_SPLITS.get(pre)
    if split is None:
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    _add_vocab_tokens(hf, tokens, types, (CONTROL,))
    return hf


def sentencepiece_bpe(tokens: list[str], types: list[int], merges: list[str] | None,
                       scores: list[float] | None, unk_id: int | None,
                       add_space_prefix: bool) -> HFTokenizer:
    """SentencePiece BPE as llama.cpp stores it (Llama 2, Mistral, Gemma): '▁' for space, <0xNN>
    tokens for bytes outside the vocabulary, and scores instead of merges."""
    tokens, runs = respell_space_runs(tokens)
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    if merges is not None:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    elif scores is not None:
        pairs = merges_from_scores(tokens, types, scores)
    else:
        raise VocabError("sentencepiece ('llama') GGUF vocabulary without merges or scores")
    unk = tokens[unk_id] if unk_id is not None else None
    hf = HFTokenizer(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # Like sentencepiece's dummy prefix: a space before every piece of text, even one that starts
    # with a space ("  hi" -> "▁▁▁hi"), which the Metaspace pre-tokenizer would not do. Gemma has
    # none (add_space_prefix false): "hi" is "hi", " hi" is "▁hi".
    replace = normalizers.Replace(" ", "▁")
    hf.normalizer = (normalizers.Sequence([normalizers.Prepend("▁"), replace])
                     if add_space_prefix else replace)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    hf.decoder = decoders.Sequence(steps)
    _add_vocab_tokens(hf, tokens, types, (CONTROL, UNKNOWN), skip=runs)
    return hf


def respell_space_runs(tokens: list[str]) -> tuple[list[str], frozenset[int]]:
    """Gemma's files store its whitespace-run tokens ("  ", "   ", ...) with real spaces, where the
    pipeline sees '▁'. Spelt '▁▁', '▁▁▁', ... they become pieces that BPE builds out of the text's
    spaces, as transformers does for `gguf_file=`, rather than tokens matched whole in the raw
    text, longest first (llama.cpp's way with user-defined tokens). The two differ on a run longer
    than the longest such token: 40 spaces are 16 + 24 here, 31 + 9 matched longest first."""
    runs = frozenset(i for i, t in enumerate(tokens) if t and t.count(" ") == len(t))
    if runs:
        tokens = list(tokens)
        for i in runs:
            tokens[i] = "▁" * len(tokens[i])
    return tokens, runs


def merges_from_scores(tokens: list[str], types: list[int],
                       scores: list[float]) -> list[tuple[str, str]]:
    """The merges a sentencepiece BPE vocabulary implies. Sentencepiece joins the adjacent pair
    whose concatenation is the best-scoring piece; BPE applies the lowest-ranked merge first. So
    every split of a piece into two pieces becomes a merge, ranked by the piece's score.

    Where the normal pieces' scores fall with their position in the file (sentencepiece BPE
    vocabularies: Llama 2, Gemma), the position ranks them instead: the same order on them, and
    it places the pieces whose score is a placeholder too (Gemma's whitespace runs score -1000
    but come first), as transformers does for Gemma. The splits of one piece go longer left part
    first, as in transformers (sentencepiece takes the leftmost of two such pairs)."""
    pieces = {t: i for i, (t, k) in enumerate(zip(tokens, types, strict=True))
              if k in (NORMAL, USER_DEFINED)}
    normal = [scores[i] for i, k in enumerate(types) if k == NORMAL]
    if all(a >= b for a, b in zip(normal, normal[1:], strict=False)):
        order = sorted(pieces, key=pieces.__getitem__)
    else:
        order = sorted(pieces, key=lambda t: (-scores[pieces[t]], pieces[t]))
    return [(token[:cut], token[cut:]) for token in order for cut in range(len(token) - 1, 0, -1)
            if token[:cut] in pieces and token[cut:] in pieces]
