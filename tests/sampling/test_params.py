"""SamplingParams validation of stop strings: the length limits shared with the HTTP protocol."""

from __future__ import annotations

import pytest

from hybridserve import InvalidRequestError, SamplingParams
from hybridserve.sampling.params import MAX_STOP_STR_LEN, MAX_STOP_STRS_TOTAL_LEN


def test_stop_strings_at_the_limits_are_accepted() -> None:
    one = SamplingParams(stop="x" * MAX_STOP_STR_LEN)
    assert one.stop == ["x" * MAX_STOP_STR_LEN]
    n = MAX_STOP_STRS_TOTAL_LEN // MAX_STOP_STR_LEN
    assert len(SamplingParams(stop=[chr(65 + i) * MAX_STOP_STR_LEN for i in range(n)]).stop) == n
    # the offline API has no count limit of its own: many short strings within the total are fine
    assert len(SamplingParams(stop=[f"<{i}>" for i in range(1000)]).stop) == 1000


def test_a_stop_string_over_the_length_limit_is_refused_naming_it() -> None:
    with pytest.raises(InvalidRequestError, match=rf"^stop: .*at most {MAX_STOP_STR_LEN} characters") as ei:
        SamplingParams(stop=["ok", "x" * (MAX_STOP_STR_LEN + 1)])
    assert f"got one of {MAX_STOP_STR_LEN + 1}" in str(ei.value)


def test_stop_strings_over_the_total_limit_are_refused_naming_it() -> None:
    per = MAX_STOP_STR_LEN
    stop = ["x" * per] * (MAX_STOP_STRS_TOTAL_LEN // per) + ["y"]
    with pytest.raises(InvalidRequestError, match=rf"^stop: .*at most {MAX_STOP_STRS_TOTAL_LEN} characters"):
        SamplingParams(stop=stop)


def test_stop_strings_set_after_construction_are_checked_again() -> None:
    # LLM.generate validates the params again when it adds the request
    p = SamplingParams()
    p.stop = ["x" * (MAX_STOP_STR_LEN + 1)]
    with pytest.raises(InvalidRequestError, match="stop"):
        p.validate()


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 10**400},
        {"top_p": -(10**400)},
        {"repetition_penalty": 10**400},
        {"logit_bias": {1: 10**400}},
    ],
)
def test_an_int_no_float_holds_is_out_of_range_not_an_overflow(kw: dict[str, object]) -> None:
    # (float() of it raised OverflowError out of the validation)
    with pytest.raises(InvalidRequestError, match=next(iter(kw))):
        SamplingParams(**kw)  # type: ignore[arg-type]


def test_clone_and_from_optional_as_vllm() -> None:
    """`clone()` is a copy whose changes leave the original as it was; `from_optional` takes
    None as the field's default."""
    p = SamplingParams(temperature=0.5, stop=["x"], max_tokens=7)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")  # type: ignore[union-attr]
    q.max_tokens = 9
    assert p.stop == ["x"] and p.max_tokens == 7
    r = SamplingParams.from_optional(temperature=None, max_tokens=5, seed=None)
    assert r == SamplingParams(max_tokens=5)
