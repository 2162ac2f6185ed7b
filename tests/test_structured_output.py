"""Structured output in the engine (engine/grammar.py): grammar-constrained replies of the
default model follow their grammar, rows without one are untouched, and the constraint
survives overlapped steps, preemption and n > 1; bad or costly grammars are refused."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
from conftest import SERVER_LIMITS

from engine.config import EngineConfig
from engine.grammar import GrammarError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.sampling_params import StructuredOutputsParams as Structured
from models.chat_template import ChatTemplate

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(default_gguf):
    # The live server's limits: its executables come from the store whoever compiled them.
    eng = LLMEngine(EngineConfig(model=str(default_gguf), **SERVER_LIMITS))
    eng.runner.warmup()
    return eng


@pytest.fixture(autouse=True)
def all_blocks_free_after(request):
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        assert not eng.has_unfinished() and not eng._matchers
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks


def chat(engine, text: str) -> str:
    return ChatTemplate.for_tokenizer(engine.tokenizer).render(
        [{"role": "user", "content": text}], add_generation_prompt=True)


def test_json_schema_replies_validate_greedy_and_sampled(engine):
    prompts = [chat(engine, t) for t in ("Describe a person as JSON.", "Who is Ada Lovelace?",
                                          "Write a poem about the sea.")]
    spec = Structured(json=PERSON)
    params = [SamplingParams(temperature=0, max_tokens=200, structured_outputs=spec),
              SamplingParams(temperature=1.0, seed=7, max_tokens=200, structured_outputs=spec,
                             n=2)]
    for p in params:
        for out in engine.generate(prompts, p):
            for c in out.outputs:
                assert c.finish_reason == "stop", c.text
                jsonschema.validate(json.loads(c.text), PERSON)
    assert engine.grammars.mask_steps > 0


def test_rows_without_a_grammar_are_unchanged_beside_constrained_ones(engine):
    prompts = [chat(engine, "Name three rivers."), chat(engine, "What is 2 + 2?")]
    free = SamplingParams(temperature=0, max_tokens=30)
    alone = engine.generate(prompts, free)
    constrained = SamplingParams(temperature=0, max_tokens=60,
                                 structured_outputs=Structured(json_object=True))
    mixed = engine.generate(prompts + prompts, [free, free, constrained, constrained])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    assert mixed[2].outputs[0].token_ids != alone[0].outputs[0].token_ids


def test_choice_and_regex_end_exactly_where_the_grammar_does(engine):
    prompt = chat(engine, "Is the sky blue? Answer yes or no.")
    outs = engine.generate([prompt] * 3, [
        SamplingParams(temperature=0, max_tokens=20,
                       structured_outputs=Structured(choice=["yes", "no", "maybe not"])),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                       structured_outputs=Structured(regex=r"[0-9]{3}-[0-9]{4}")),
        SamplingParams(temperature=0, max_tokens=40,
                       structured_outputs=Structured(grammar='start: "A" | "B" ("B")*')),
    ])
    texts = [o.outputs[0].text for o in outs]
    assert texts[0] in ("yes", "no", "maybe not")
    assert len(texts[1]) == 8 and texts[1][3] == "-" and texts[1].replace("-", "").isdigit()
    assert texts[2] == "A" or set(texts[2]) == {"B"}
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_overlapped_steps_and_preemption_keep_the_grammar(engine):
    story = "A village by the sea had a baker, a smith, a fisher and a teacher. " * 6
    prompts = [chat(engine, f"{story}Describe person number {i} as JSON.") for i in range(8)]
    p = SamplingParams(temperature=0, max_tokens=120, structured_outputs=Structured(json=PERSON))
    base = [o.outputs[0].token_ids for o in engine.generate(prompts, p)]
    overlapped = LLMEngine(dataclasses.replace(engine.config, async_scheduling=True),
                           runner=engine.runner, tokenizer=engine.tokenizer)
    # A plain request first, so that a grammar arrives while steps overlap.
    overlapped.add_request(chat(engine, "Hello"), SamplingParams(temperature=0, max_tokens=8))
    overlapped.step()
    assert overlapped._in_flight is not None
    assert [o.outputs[0].token_ids for o in overlapped.generate(prompts, p)] == base
    small = LLMEngine(dataclasses.replace(engine.config, num_blocks=33), runner=engine.runner,
                      tokenizer=engine.tokenizer)  # room for one max_model_len sequence
    outs = small.generate(prompts, p)
    assert small.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == base
    for eng in (overlapped, small):
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "no-such-type"}), "invalid structured output"),
    (dict(regex="a(b"), "invalid structured output"),
    (dict(grammar="start: undefined_rule"), "invalid structured output"),
    # costly: 100,000 enum values exhaust llguidance's lexer budget in ~0.2 s
    (dict(json={"enum": [f"v{i}" for i in range(100_000)]}), "too big"),
])
def test_bad_or_costly_grammars_are_refused_and_nothing_is_queued(engine, spec, message):
    with pytest.raises(GrammarError, match=message) as e:
        engine.add_request("x", SamplingParams(structured_outputs=Structured(**spec)))
    assert e.value.param == "structured_outputs"
    assert not engine.has_unfinished()


def test_exactly_one_kind_of_structure():
    with pytest.raises(SamplingParamsError, match="exactly one"):
        Structured(regex="a", choice=["b"])
    with pytest.raises(SamplingParamsError, match="exactly one"):
        Structured()
    with pytest.raises(SamplingParamsError, match="non-empty"):
        Structured(choice=[])


def test_drafts_masks_are_each_rows_and_leave_the_matcher_as_it_was(tokenizer):
    """Speculative decoding: the mask of each row after drafts (the grammar's state after the
    drafts before it), drafts past the grammar's end not fed (an end-of-sequence token would
    not roll back), and the matcher left where it was."""
    import numpy as np

    from engine.grammar import Grammars, allowed_drafts, fill_mask_after

    grammars = Grammars(tokenizer, tokenizer.vocab_size)
    words = "(apple|river|stone|cloud)"
    matcher = grammars.matcher(Structured(regex=f" ?{words}(, {words}){{0,3}}\\."))
    for token in tokenizer.encode(" apple, river", add_special_tokens=False):
        assert matcher.consume_token(token)
    comma, dot = tokenizer.encode(",", add_special_tokens=False) + tokenizer.encode(
        ".", add_special_tokens=False)
    eos = min(tokenizer.eos_token_ids)

    def allowed(mask, row):
        bits = np.unpackbits(mask[row].view(np.uint8), bitorder="little")
        return set(np.flatnonzero(bits[:tokenizer.vocab_size]).tolist())

    drafts = [dot, eos, eos]
    assert allowed_drafts(matcher, drafts) == 2  # one end: the second is past it
    mask = grammars.fill_mask([(1, matcher, drafts)], 5)
    assert not allowed(mask, 0) and allowed(mask, 1) == {comma, dot}
    assert allowed(mask, 2) == allowed(mask, 3) == allowed(mask, 4) == {eos}
    assert allowed(fill_mask_after(grammars, [(0, matcher, [comma])], 1), 0) >= {
        tokenizer.encode(" stone", add_special_tokens=False)[0]}
    assert allowed_drafts(matcher, [dot]) == 1 and not matcher.is_stopped()  # as it was
