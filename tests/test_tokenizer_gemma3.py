"""Gemma 3's GGUF vocabulary (sentencepiece-style, 262,144 pieces, no dummy-prefix space, no chat
template in a base model's file) against transformers' tokenizer for the same file, and our gemma
chat template on it.

The real file is fetched once per session (`gemma3_gguf` in conftest.py, as
`scripts/fetch_model.py gemma3-270m` does); a tiny Gemma-style vocabulary written here tests the
same rules on a vocabulary small enough to read.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_tokenizer import SP_CORPUS_WORDS, STRINGS, train_tiny_sentencepiece

from models.chat_template import ChatTemplate
from models.parity import read_prompts
from models.tokenizer import Tokenizer

PROMPTS = Path(__file__).parent / "data" / "parity_prompts.txt"

GEMMA_STRINGS = [
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n", "a<end_of_turn>b",
    " <start_of_turn> spaced ", "<start_of_turn", "<end_of_turn><end_of_turn>", "<bos>hi<eos>",
    "<pad><unk><mask>", "<unused5> [multimodal] <start_of_image><end_of_image>",
    "<table><tr><td>x</td></tr></table>", "<0x41> is text", "<b>bold</b> and <i>it</i>",
    *(" " * n + "x" for n in range(1, 41)), *(" " * n for n in (31, 32, 33, 40, 64)),
    *("x" + " " * n + "y" for n in (2, 3, 7, 16, 31, 32, 45)), "hello  \n  world",
    "word    word", "\t\tx", "x\t \t y", "\n \n", "\n" * 31 + "x", "\n" * 40, "\t" * 33,
    " hi", "hi", "hi ", "  ", "\u2581 literal", "\u2581\u2581x", "Ĳ ﬁ ﬀ ｈｅｌｌｏ",
    "日本語 テキスト 🤖🦜🧬 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "\U0001F9FF\U000E0001", "ঀ ஃ ༄ ᚠ ሀ",
]


def _prompt_texts() -> list[str]:
    """parity_prompts.txt: plain prompts as they are, each message of a chat on its own."""
    texts = []
    for prompt in read_prompts(PROMPTS):
        texts += [m["content"] for m in prompt] if isinstance(prompt, list) else [prompt]
    return texts


@pytest.fixture(scope="module")
def ours(gemma3_tokenizer):
    return gemma3_tokenizer  # the registry gives Gemma 3 the gemma template


@pytest.fixture(scope="module")
def theirs(gemma3_gguf):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(str(gemma3_gguf.parent),
                                                      gguf_file=gemma3_gguf.name)


@pytest.fixture(scope="module")
def strings(ours):
    chats = [ChatTemplate.for_tokenizer(ours).render(p, add_generation_prompt=True)
             for p in read_prompts(PROMPTS) if isinstance(p, list)]
    return list(dict.fromkeys([*_prompt_texts(), *chats, *GEMMA_STRINGS, *STRINGS]))


def test_ids_equal_transformers(ours, theirs, strings):
    assert len(strings) > 400
    mismatches = [(s, ours.encode(s), theirs.encode(s)) for s in strings
                  if ours.encode(s) != theirs.encode(s)]
    assert not mismatches, mismatches[:3]
    for s in strings[::7]:
        assert ours.encode(s, add_special_tokens=False) == theirs.encode(
            s, add_special_tokens=False)


def test_decode_equals_transformers(ours, theirs, strings):
    for s in strings:
        ids = ours.encode(s)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip), s
        # A literal '▁' in the text comes back as a space, in transformers too.
        if "\u2581" not in s:
            assert ours.decode(ids) == "<bos>" + s


def test_vocabulary_and_special_tokens(ours, theirs):
    assert ours.vocab_size == 262144 == len(theirs)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (2, 1, 0)
    assert (ours.bos_token, ours.eos_token) == ("<bos>", "<eos>")
    assert ours.add_bos_token and not ours.add_eos_token
    assert ours.encode("<start_of_turn>user\nHi<end_of_turn>\n") == [
        2, 105, 2364, 107, 10979, 106, 107]
    assert {105, 106} <= ours.special_token_ids
    assert ours.decode([2, 105, 10979, 106], skip_special_tokens=True) == "Hi"
    # No dummy prefix (add_space_prefix false): a leading space is the text's own.
    assert ours.convert_ids_to_tokens(ours.encode("hi there", add_special_tokens=False)) == [
        "hi", "\u2581there"]
    assert ours.convert_ids_to_tokens(ours.encode(" hi", add_special_tokens=False)) == ["\u2581hi"]
    # Runs of spaces are built by BPE from the file's whitespace tokens, as transformers does;
    # matching those tokens whole in the text, longest first, would give 31 + 9 here.
    assert ours.convert_ids_to_tokens(ours.encode(" " * 40, add_special_tokens=False)) == [
        "\u2581" * 16, "\u2581" * 24]


def test_end_of_turn_ends_generation_with_the_gemma_template(ours, gemma3_gguf):
    # The file has no template, so nothing writes <end_of_turn>: only <eos> ends generation.
    plain = Tokenizer.from_path(gemma3_gguf)
    assert plain.chat_template is None and plain.eos_token_ids == {1}
    assert ours.token_to_id("<end_of_turn>") == 106
    assert ours.eos_token_ids == {1, 106}


def test_gemma_chat_prompt_has_one_bos(ours, theirs):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = ChatTemplate.for_tokenizer(ours).render(messages, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\n")
    # The template writes BOS; chat prompts are tokenized without added special tokens (as the
    # server and transformers' apply_chat_template do), so BOS comes once.
    ids = ours.encode(text, add_special_tokens=False)
    assert ids[:2] == [2, 105] and ids.count(2) == 1
    assert ids == list(theirs.apply_chat_template(
        messages, chat_template=ours.chat_template, add_generation_prompt=True,
        tokenize=True, return_dict=True)["input_ids"])


# -- a tiny Gemma-style vocabulary: the same rules, without the real file -------------------------


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """Laid out as Gemma's file is: control tokens, user-defined newline runs and space runs
    stored with real spaces (score -1000), byte tokens, then the pieces scored by rank."""
    import gguf

    out = tmp_path_factory.mktemp("tiny-gemma")
    sp = train_tiny_sentencepiece(out / "sp.model")
    kind = gguf.TokenType
    vocab = [(t, kind.CONTROL, -1000.0) for t in ("<pad>", "<eos>", "<bos>")]
    vocab += [("<unk>", kind.UNKNOWN, -1000.0), ("<mask>", kind.CONTROL, -1000.0),
              ("<start_of_turn>", kind.CONTROL, -1000.0), ("<end_of_turn>", kind.CONTROL, -1000.0)]
    vocab += [(c * n, kind.USER_DEFINED, -1000.0) for c in "\n " for n in range(1 + (c == " "), 6)]
    vocab += [(f"<0x{b:02X}>", kind.BYTE, 0.0) for b in range(256)]
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())
              if not (sp.is_byte(i) or sp.is_control(i) or sp.is_unknown(i))]
    vocab += [(p, kind.NORMAL, -float(rank)) for rank, p in enumerate(pieces)]
    path = out / "tiny-gemma3.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([t for t, _, _ in vocab])
    writer.add_token_scores([s for _, _, s in vocab])
    writer.add_token_types([int(k) for _, k, _ in vocab])
    for add, value in (("bos_token_id", 2), ("eos_token_id", 1), ("unk_token_id", 3),
                       ("pad_token_id", 0), ("add_bos_token", True),
                       ("add_space_prefix", False)):
        getattr(writer, f"add_{add}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_gemma_vocabulary_equals_transformers(tiny_gemma):
    import transformers
    theirs = transformers.AutoTokenizer.from_pretrained(str(tiny_gemma.parent),
                                                        gguf_file=tiny_gemma.name)
    ours = Tokenizer.from_path(tiny_gemma)
    rng = random.Random(2)
    words = [*SP_CORPUS_WORDS, "\n", "\n\n", "<start_of_turn>", "<end_of_turn>", "😀"]
    generated = ["".join(rng.choice([*words, *(" " * n for n in range(1, 14))])
                         for _ in range(rng.randint(1, 16))) for _ in range(300)]
    strings = [*GEMMA_STRINGS, *generated]
    mismatches = [(s, ours.encode(s), theirs.encode(s)) for s in strings
                  if ours.encode(s) != theirs.encode(s)]
    assert not mismatches, mismatches[:3]
    # Thirteen spaces: BPE builds 4 + 4 + 5 from the space pieces (matching the space tokens
    # whole, longest first, would give 5 + 5 + 3).
    assert ours.convert_ids_to_tokens(ours.encode("a" + " " * 13 + "b")) == [
        "<bos>", "a", "\u2581" * 4, "\u2581" * 4, "\u2581" * 5, "b"]
    for s in strings:
        assert ours.decode(ours.encode(s)) == theirs.decode(theirs.encode(s)), s


def test_tiny_gemma_end_of_turn_with_the_gemma_template(tiny_gemma):
    plain = Tokenizer.from_path(tiny_gemma)
    end_of_turn = plain.token_to_id("<end_of_turn>")
    assert end_of_turn in plain.special_token_ids and plain.eos_token_ids == {1}
    chat = Tokenizer.from_path(tiny_gemma, default_chat_template="gemma")
    assert chat.eos_token_ids == {1, end_of_turn}
    text = ChatTemplate.for_tokenizer(chat).render([{"role": "user", "content": "hi"}],
                                                   add_generation_prompt=True)
    ids = chat.encode(text, add_special_tokens=False)
    assert ids[:2] == [2, chat.token_to_id("<start_of_turn>")] and ids.count(2) == 1
