"""Streaming detokenization: the deltas add up to the decoded text, never show half a character,
and each step decodes only a few tokens."""

from __future__ import annotations

import random

import pytest

from models.detokenizer import IncrementalDetokenizer
from models.tokenizer import Tokenizer

TEXT = ("Emoji: 👨‍👩‍👧‍👦 👍🏽 🏳️‍🌈 🇫🇷🇯🇵 🤖🎉🥳. "
        "日本語のテキストです。中文文本，标点符号。한국어 텍스트. "
        "Accents: café naïve e\u0301 Ångström. עברית العربية ∑ᵢ aᵢ ≈ π. 😀😀😀 done!\n") * 8


@pytest.fixture(scope="module")
def tok(default_gguf):
    return Tokenizer.from_path(default_gguf)


def _stream(detok: IncrementalDetokenizer, ids) -> list[str]:
    deltas = [detok.add(i) for i in ids]
    return [*deltas, detok.flush()]


def test_streams_exact_text_without_broken_characters(tok):
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok)
    deltas = []
    for k, i in enumerate(ids):
        deltas.append(detok.add(i))
        # The stream holds the complete characters decoded so far, but for the few (a space) that
        # share a token with an unfinished character.
        complete = tok.decode(ids[:k + 1]).rstrip("\ufffd")
        assert complete.startswith(detok.text) and len(complete) - len(detok.text) <= 2
    assert detok.flush() == ""
    assert "".join(deltas) == TEXT == tok.decode(ids) == detok.text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas.count("") > 20  # multi-token characters really were held back


def test_with_prompt_prefix(tok):
    prompt_ids = tok.encode("<|im_start|>user\nSay 🇯🇵 日本<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(TEXT)
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids)
    deltas = _stream(detok, ids)
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_prompt_ending_inside_a_character(tok):
    ids = tok.encode("ok 🥳🥳 fin")
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, prompt_ids=ids[:cut])
    complete_prefix = tok.decode(ids[:cut]).rstrip("\ufffd")
    deltas = _stream(detok, ids[cut:])
    assert "".join(deltas) == "ok 🥳🥳 fin"[len(complete_prefix):]
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    ids = tok.encode("<|im_start|>assistant\nHi 👋 there<|im_end|>\n"
                     "<|im_start|>user\n日本<|im_end|>")
    deltas = _stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(deltas)) is not skip


def test_random_byte_soup_matches_full_decode(tok):
    # Arbitrary ids can make bytes that never form a character: they reach the text as U+FFFD
    # (at the latest on flush), exactly as a full decode shows them.
    rng = random.Random(0)
    ids = [rng.randrange(17, tok.vocab_size) for _ in range(400)]
    assert "".join(_stream(IncrementalDetokenizer(tok), ids)) == tok.decode(ids)


def test_each_step_decodes_a_short_window(tok):
    longest = 0
    decode = tok.decode

    class Counting:
        def decode(self, ids, skip_special_tokens=False):
            nonlocal longest
            longest = max(longest, len(ids))
            return decode(ids, skip_special_tokens)

    ids = tok.encode(TEXT * 4)
    assert len(ids) > 2000
    text = "".join(_stream(IncrementalDetokenizer(Counting(), prompt_ids=ids[:500]), ids))
    assert text == TEXT * 4
    assert longest <= 12


def test_sentencepiece_spaces_survive_streaming(tmp_path):
    import sentencepiece as spm

    words = ["hello", "world", "stream", "ing", "text", "日本", "über"]
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(words) for _ in range(8)) for _ in range(500)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=300,
        model_type="bpe", byte_fallback=True, character_coverage=1.0, minloglevel=2)
    tok = Tokenizer.from_path(tmp_path)
    text = "hello world, streaming text 🎉 über 日本 done"
    ids = tok.encode(text, add_special_tokens=False)
    deltas = _stream(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    # After a prompt, the space that joins the reply to it is kept (decode(reply) alone drops it).
    prompt = tok.encode("hello", add_special_tokens=False)
    reply = tok.encode("hello world", add_special_tokens=False)[len(prompt):]
    assert "".join(_stream(IncrementalDetokenizer(tok, prompt_ids=prompt), reply)) == " world"
