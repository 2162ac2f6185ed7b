"""SamplingParams validation: every out-of-range value is a clear error naming the field."""

import pytest

from engine.sampling_params import SamplingParams, SamplingParamsError


def test_defaults_and_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[5, 6], top_k=-1)
    assert p.stop == ("###",) and p.stop_token_ids == (5, 6) and p.top_k == 0
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    hash(p)  # frozen and hashable
    # logit_bias as OpenAI sends it (string keys) or as vLLM takes it (int keys): sorted pairs
    q = SamplingParams(logit_bias={"7": 1, 3: -100.0, "12": 100})
    assert q.logit_bias == ((3, -100.0), (7, 1.0), (12, 100.0)) and SamplingParams(n=128).n == 128
    hash(q)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", 101), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("min_p", -0.1), ("min_p", 1.1), ("presence_penalty", 2.5),
    ("frequency_penalty", -3), ("repetition_penalty", 0.0), ("seed", -1),
    ("max_tokens", 0), ("min_tokens", -1), ("stop", [""]), ("stop", ["x"] * 17),
    ("stop_token_ids", [-1]), ("n", 0), ("n", 129), ("logprobs", 21), ("logprobs", -1),
    ("logit_bias", {5: 101}), ("logit_bias", {"a": 1}), ("logit_bias", {-1: 1}),
    ("logit_bias", {5: float("nan")}), ("logit_bias", {i: 1 for i in range(301)}),
    ("logit_bias", [(5, 1), (5, 2)]),
])
def test_out_of_range_is_rejected_with_the_field_named(field, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field
    assert field in str(e.value)


def test_min_tokens_must_not_exceed_max_tokens():
    with pytest.raises(SamplingParamsError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)
    SamplingParams(min_tokens=5, max_tokens=5)
