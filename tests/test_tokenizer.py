"""Our tokenizers against their references: transformers for the default GGUF and for
tokenizer.json; the sentencepiece processor for tokenizer.model and a GGUF 'llama' vocabulary."""

from __future__ import annotations

import json
import random

import pytest

from models.chat_template import ChatPrompt
from models.gguf_vocab import CONTROL, NORMAL
from models.tokenizer import Tokenizer, TokenizerError

FIXED = [
    "", " ", "  ", "\n", "\t", "\r\n", "a", "Hello world", "Hello, world!", " leading space",
    "trailing space ", "   three leading", "multiple   spaces   inside", "tabs\tand\t\ttabs",
    "lines\nand\n\nblank\n\n\nlines", "windows\r\nline\r\nendings\r\n", " \t \n mixed \r\n\t ",
    "a   1", "x\n\n2", "  12", "0", "1234567890", "3.14159265358979", "1,000,000 and 2.5e-10",
    "phone: +1 (555) 010-9999", "v1.2.3-rc4", "0x7fff_ffff", "2024-01-01T12:34:56Z",
    "def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "const f = async (a, b) => { await g(a?.b ?? 0); };", "#include <stdio.h>\nint main(void) "
    "{ printf(\"%d\\n\", 42); }", "SELECT * FROM t WHERE id = 'x' AND n >= 10;",
    "<div class=\"a\">&amp; &lt;tag&gt;</div>", "{\"key\": [1, 2, {\"nested\": null}]}",
    "I'm sure you're right, it's what we'd've done; they'll see.", "DON'T SHOUT, IT'S RUDE",
    "café naïve résumé façade Ångström", "e\u0301 (e + combining acute), n\u0303, a\u030a\u0301",
    "Straße, Œuvre, Ærø, İstanbul, ǅ", "Ελληνικά κείμενα", "Русский текст, ёлка",
    "עברית מימין לשמאל", "العربية: مرحبا بالعالم", "mixed LTR עברית and العربية", "हिन्दी भाषा",
    "ภาษาไทย", "Tiếng Việt có dấu", "日本語のテキストです。", "中文文本，标点符号。",
    "한국어 텍스트",
    "全角ＡＢＣ１２３", "😀", "👍🏽", "👨‍👩‍👧‍👦 family", "🏳️‍🌈 flag", "🇫🇷🇯🇵🇺🇸 flags",
    "emoji in text 🎉 party 🥳!", "🤖🤖🤖", "math: ∀x ∈ ℝ, x² ≥ 0; ∑ᵢ aᵢ ≈ π", "½ ¼ ² ³ ٣ ૩ Ⅻ",
    "arrows → ← ↔ ⇒ and box ┌─┐", "zero\u200bwidth\u200cjoin\u200d", "\u00a0nbsp\u2003em space",
    "control \x00 \x07 \x1b[31m", "\ufeffBOM", "replacement \ufffd char", "<|im_start|>",
    "<|endoftext|>", "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text", "<|im_end|><|im_end|>", "<|im_start", "<|not_special|>",
    "<repo_name>x<file_sep>y", "a<|im_end|>b", " <|im_start|> spaced ", "<s> </s> <unk>",
    "http://example.com/path?q=1&r=2#frag", "user@example.com", "$100 €50 £20 ¥1000 ₿",
    "~!@#$%^&*()_+`-=[]\\{}|;':\",./<>?", "......!!!???---___", "a" * 200, "ab " * 100,
    "\n" * 30, " " * 50, "\t" * 20 + "x",
]

PIECES = [
    "the", " quick", " brown", "fox", " jumps", "over", " lazy", "dog", "Hello", "world", "123",
    "4567", "0", " 89", "def", "return", "()", "{", "}", ";", "=>", "::", "->", "  ", "   ", "\t",
    "\n", "\n\n", "\r\n", " ", "é", "ñ", "ü", "e\u0301", "漢字", "日本", "한국", "שלום", "سلام",
    "😀", "👨‍💻", "🇩🇪", "🏽", "‍", "️", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "'s",
    "'ll", "n't", "...", "!", "?", ",", ".", "-", "_", "/", "\\", "\"", "'", "`", "#", "@",
    "%", "^", "&", "*", "|", "~", "$", "+", "<", ">", "[", "]", "ß", "Ω", "∑", "\u00a0", "\u3000",
]


def _generated(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 24))) for _ in range(n)]


LONG_TEXT = "\n\n".join(FIXED[8:60]) * 4
STRINGS = [*FIXED, *_generated(260), LONG_TEXT]


@pytest.fixture(scope="module")
def ours(default_gguf):
    return Tokenizer.from_path(default_gguf)


@pytest.fixture(scope="module")
def theirs(default_gguf):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(str(default_gguf.parent),
                                                      gguf_file=default_gguf.name)


def test_many_strings_are_tested():
    assert len(set(STRINGS)) >= 300


def test_ids_equal_transformers_on_default_gguf(ours, theirs):
    mismatches = [(s, ours.encode(s), theirs.encode(s)) for s in STRINGS
                  if ours.encode(s) != theirs.encode(s)]
    assert not mismatches, mismatches[:3]
    # Without BOS/EOS too (the default model adds none, so this equals the above; kept for others).
    assert ours.encode("Hi", add_special_tokens=False) == theirs.encode("Hi",
                                                                        add_special_tokens=False)


def test_decode_round_trips_and_equals_transformers(ours, theirs):
    for s in STRINGS:
        ids = ours.encode(s)
        assert ours.decode(ids) == s
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True)


def test_default_model_special_tokens(ours, theirs):
    assert ours.vocab_size == 49152 == len(theirs)
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.add_bos_token is False
    # <|im_end|> is both the EOS and the template's end of turn; the template has no <|endoftext|>.
    assert ours.eos_token_ids == {2}
    assert ours.special_token_ids == set(range(17))
    assert ours.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert ours.decode([1, 4093, 2], skip_special_tokens=True) == "user"
    assert ours.convert_ids_to_tokens([1, 905]) == ["<|im_start|>", "Ġworld"]
    assert ours.convert_ids_to_tokens([1, 905]) == theirs.convert_ids_to_tokens([1, 905])
    assert ours.chat_template == theirs.chat_template
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        ours.id_to_token(49152)


def _chat_turn(text: str) -> ChatPrompt:
    """`text` in a ChatML user turn whose two special tokens the template wrote."""
    turn = f"<|im_start|>user\n{text}<|im_end|>\n"
    return ChatPrompt(turn, [(0, 12), (len(turn) - 11, len(turn) - 1)])


def test_chat_prompt_tokens_are_the_whole_texts(ours):
    """Tokenized piece by piece between the template's special tokens, a chat is the tokens of
    its whole text (where the request spells no special token)."""
    plain = [s for s in STRINGS if not any(t in s for t in ours.special_tokens)]
    assert len(plain) > 200
    for s in plain:
        turn = _chat_turn(s)
        assert ours.encode(turn, add_special_tokens=False) == ours.encode(str(turn), False), s


def test_chat_prompt_spelling_special_tokens_is_text(ours, theirs):
    forged = [s for s in STRINGS if any(t in s for t in ours.special_tokens)]
    assert len(forged) > 20
    for s in forged:
        ids = ours.encode(_chat_turn(s), add_special_tokens=False)
        assert [i for i in ids if i in ours.special_token_ids] == [1, 2], s
        # as transformers tokenizes text whose special tokens it is told to split
        text = theirs.encode(f"user\n{s}", add_special_tokens=False, split_special_tokens=True)
        assert ids == [1, *text, 2, 198], s
        assert ours.decode(ids) == _chat_turn(s)
    # A plain str of it parses them, wherever they are.
    assert ours.encode(str(_chat_turn("<|im_end|>")), False).count(2) == 2


def test_long_texts_tokenize_as_short_ones(ours):
    # (over _LONG_TEXT characters the GIL is released: encode_batch, same pipeline)
    text = LONG_TEXT * 3
    assert len(text) > 4096
    assert ours.encode(text) == ours._backend.hf.encode(text, add_special_tokens=False).ids


def test_max_token_bytes_bounds_every_token(ours):
    longest = max(len(ours.decode([i]).encode()) for i in range(ours.vocab_size))
    assert longest <= ours.max_token_bytes <= 2 * longest


def test_tokenizer_json_directory_equals_transformers(ours, theirs, tmp_path):
    theirs.save_pretrained(tmp_path)
    from_dir = Tokenizer.from_path(tmp_path)
    for s in STRINGS:
        assert from_dir.encode(s) == theirs.encode(s)
    ids = from_dir.encode(LONG_TEXT)
    assert from_dir.decode(ids) == LONG_TEXT
    assert (from_dir.bos_token_id, from_dir.eos_token_id) == (1, 2)
    assert from_dir.add_bos_token is False
    assert from_dir.chat_template == ours.chat_template
    assert from_dir.eos_token_ids == ours.eos_token_ids


def test_tokenizer_json_directory_reads_bos_and_eos_config(theirs, tmp_path):
    theirs.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_path(tmp_path)
    assert tok.encode("hi") == [1, *theirs.encode("hi")]
    assert tok.encode("hi", add_special_tokens=False) == theirs.encode("hi")
    assert tok.eos_token_ids == {0, 2}


def _assert_same(a: Tokenizer, b: Tokenizer, strings) -> None:
    for name in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "eos_token_ids",
                 "add_bos_token", "add_eos_token", "chat_template", "special_token_ids"):
        assert getattr(a, name) == getattr(b, name), name
    for s in strings:
        assert a.encode(s) == b.encode(s), s
        assert a.decode(a.encode(s)) == b.decode(a.encode(s)), s


def test_save_pretrained_round_trips(ours, theirs, tmp_path):
    ours.save_pretrained(tmp_path)
    _assert_same(Tokenizer.from_path(tmp_path), ours, STRINGS)
    # transformers reads the saved files as the same tokenizer too.
    import transformers
    reloaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for s in STRINGS[::10]:
        assert reloaded.encode(s) == theirs.encode(s)


# -- sentencepiece: tokenizer.model and GGUF 'llama' --------------------------------------------

SP_CORPUS_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello",
                   "world", "token", "tokenizer", "piece", "sentence", "model", "language", "llama",
                   "café", "naïve", "über", "日本", "語", "123", "42", "don't", "isn't", "—", "ok!"]

SP_STRINGS = [
    "", "hello world", "Hello World", "the quick brown fox jumps over the lazy dog",
    " leading", "  two leading", "trailing ", "in   between", "tabs\tand\nnewlines\n\n",
    "\r\nwindows", "tokenizer tokenizers tokenized", "café naïve über", "e\u0301 combining",
    "日本語 テキスト", "emoji 😀 👨‍👩‍👧 🇯🇵", "unseen: ωψχ Ж ß", "digits 0123456789 3.14",
    "punctuation !?.,;:'\"()[]{}", "mixed: the dog 🐕 jumps über 42 fences", "zzzzzzzz",
    "x" * 100, "\u00a0nbsp", "\t", " ", "▁literal", "<0x41> is text",
]


def _sp_strings() -> list[str]:
    rng = random.Random(1)
    extra = [" ".join(rng.choice(SP_CORPUS_WORDS + ["😀", "\n", "ω", " "])
                      for _ in range(rng.randint(1, 12))) for _ in range(60)]
    return SP_STRINGS + extra


def train_tiny_sentencepiece(model_file, **ids):
    """A 400-piece sentencepiece BPE model (byte fallback, no normalization) trained on a
    fixed random corpus of SP_CORPUS_WORDS, written to `model_file` (`ids`: special ids)."""
    import sentencepiece as spm
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(SP_CORPUS_WORDS) for _ in range(rng.randint(3, 15)))
              for _ in range(2000)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_prefix=str(model_file).removesuffix(".model"),
        vocab_size=400, model_type="bpe", byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2,
        **ids)
    return spm.SentencePieceProcessor(model_file=str(model_file))


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    """A tiny Llama-style sentencepiece BPE model: byte fallback, no normalization."""
    model = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    return model, train_tiny_sentencepiece(model, bos_id=1, eos_id=2, unk_id=0, pad_id=-1)


def test_tokenizer_model_directory_equals_sentencepiece(sp_model, tmp_path):
    model_file, sp = sp_model
    (tmp_path / "tokenizer.model").write_bytes(model_file.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"add_bos_token": true}')
    tok = Tokenizer.from_path(tmp_path)
    assert (tok.bos_token, tok.eos_token, tok.vocab_size) == ("<s>", "</s>", 400)
    for s in _sp_strings():
        assert tok.encode(s) == [1, *sp.encode(s)], s
        assert tok.decode(tok.encode(s), skip_special_tokens=True) == sp.decode(sp.encode(s))
    # Special tokens written in the text are matched, as in transformers and llama.cpp.
    assert tok.encode("<s>hi</s>", add_special_tokens=False) == [1, *sp.encode("hi"), 2]
    assert tok.decode([1, *sp.encode("hi"), 2]) == "<s>hi</s>"
    tok.save_pretrained(tmp_path / "saved")
    _assert_same(Tokenizer.from_path(tmp_path / "saved"), tok, _sp_strings())


def test_tokenizer_model_directory_added_tokens(sp_model, tmp_path):
    model_file, sp = sp_model
    (tmp_path / "tokenizer.model").write_bytes(model_file.read_bytes())
    hello = sp.piece_to_id("▁hello")
    added = {str(hello): {"content": "▁hello", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    tok = Tokenizer.from_path(tmp_path)
    assert hello in tok.special_token_ids
    assert tok.decode(sp.encode("hello world"), skip_special_tokens=True) == "world"
    added["400"] = {"content": "<|extra|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    tok.save_pretrained(tmp_path / "saved")
    _assert_same(Tokenizer.from_path(tmp_path / "saved"), tok, ["hello world"])
    with pytest.raises(TokenizerError, match="beyond tokenizer.model's vocabulary"):
        Tokenizer.from_path(tmp_path)


def test_sentencepiece_chat_prompt_spells_out_special_tokens(tmp_path):
    """The processor matches user-defined pieces (Gemma's turn markers, which HF calls special)
    in any text: in request text they are spelt out one character at a time."""
    sp = train_tiny_sentencepiece(tmp_path / "tokenizer.model", bos_id=1, eos_id=2, unk_id=0,
                                  pad_id=-1, user_defined_symbols=["<turn>"])
    turn = sp.piece_to_id("<turn>")
    added = {str(turn): {"content": "<turn>", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    tok = Tokenizer.from_path(tmp_path)
    assert set(tok.special_tokens) == {"<unk>", "<s>", "</s>", "<turn>"}
    text = "<turn>hello <turn> world</s><s>"
    assert tok.encode(text, add_special_tokens=False).count(turn) == 2
    ids = tok.encode(ChatPrompt(text, [(0, 6)]), add_special_tokens=False)
    assert ids[0] == turn and not set(ids[1:]) & tok.special_token_ids
    assert tok.decode(ids) == text
    assert tok.max_token_bytes >= max(len(tok.decode([i]).encode()) for i in range(400))


def _write_llama_gguf(path, sp, **overrides):
    import gguf
    types = []
    for i in range(sp.get_piece_size()):
        kind = (gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL
                if sp.is_control(i) else gguf.TokenType.BYTE if sp.is_byte(i)
                else gguf.TokenType.UNUSED if sp.is_unused(i) else gguf.TokenType.NORMAL)
        types.append(int(kind))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    writer.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    for key, value in overrides.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def test_gguf_llama_vocabulary_equals_sentencepiece(sp_model, tmp_path):
    _, sp = sp_model
    path = tmp_path / "tiny-llama.gguf"
    types = _write_llama_gguf(path, sp)
    assert types.count(6) == 256 and NORMAL in types and CONTROL in types
    tok = Tokenizer.from_path(path)
    assert tok.add_bos_token  # llama.cpp's default for a vocabulary that does not say
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (1, 2, {2})
    for s in _sp_strings():
        assert tok.encode(s) == [1, *sp.encode(s)], s
        assert tok.decode(sp.encode(s)) == sp.decode(sp.encode(s)), s
    assert tok.encode("hi</s>", add_special_tokens=False) == [*sp.encode("hi"), 2]
    assert tok.decode([1, *sp.encode("hi")], skip_special_tokens=True) == "hi"
    tok.save_pretrained(tmp_path / "saved")
    _assert_same(Tokenizer.from_path(tmp_path / "saved"), tok, _sp_strings())


def test_gguf_llama_vocabulary_flags(sp_model, tmp_path):
    _, sp = sp_model
    path = tmp_path / "flags.gguf"
    _write_llama_gguf(path, sp, add_bos_token=False, add_eos_token=True,
                      chat_template="{{ messages[0]['content'] }}<|eot|>")
    tok = Tokenizer.from_path(path)
    assert tok.encode("hello") == [*sp.encode("hello"), 2]
    assert tok.chat_template.endswith("<|eot|>")


# -- errors -------------------------------------------------------------------------------------


def test_path_without_tokenizer_names_the_path(tmp_path):
    with pytest.raises(TokenizerError, match=str(tmp_path)):
        Tokenizer.from_path(tmp_path)
    missing = tmp_path / "does-not-exist"
    with pytest.raises(ValueError, match=str(missing)):
        Tokenizer.from_path(missing)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_path(tmp_path)
