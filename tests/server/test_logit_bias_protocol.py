"""logit_bias on /v1/completions and /v1/chat/completions: parsed into SamplingParams.logit_bias,
and 400s with an OpenAI error body naming the field for anything else."""

from __future__ import annotations

import pytest

from hybridserve.model.demo import ensure_demo_model
from hybridserve.server import protocol as P
from server_fixtures import TokenizerModelInfo

MODEL = "demo"
MSGS = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def info() -> TokenizerModelInfo:
    return TokenizerModelInfo(ensure_demo_model(), max_model_len=64)


def _parse(info, route: str, bias):
    if route == "completions":
        return P.parse_completion_request({"prompt": "x", "logit_bias": bias}, info, MODEL)
    return P.parse_chat_request({"messages": MSGS, "logit_bias": bias}, info, MODEL)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_logit_bias_is_parsed_into_the_params(info, route):
    top = info.vocab_size - 1
    req = _parse(info, route, {"5": 100, "0": -100, str(top): 0.5})
    assert req.params.logit_bias == {5: 100.0, 0: -100.0, top: 0.5}
    assert _parse(info, route, {}).params.logit_bias is None
    assert _parse(info, route, None).params.logit_bias is None
    assert _parse(info, route, {str(i): 1 for i in range(300)}).params.logit_bias is not None


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize(
    "bias",
    [
        {"5": 100.5},
        {"5": -101},
        {"5": 10**400},
        {"5": "1"},
        {"5": True},
        {"5": None},
        {"5": [1]},
        {"a": 1},
        {"-1": 1},
        {"+1": 1},
        {"05": 1},
        {" 5": 1},
        {"1.0": 1},
        {"": 1},
        {"\u0661": 1},  # an Arabic-Indic digit: int() would take it
        {"VOCAB": 1},  # the vocabulary size itself: out of range
        {"1" * 40: 1},
        {str(i): 1 for i in range(301)},
        [1, 2],
        "5",
        5,
        True,
    ],
)
def test_bad_logit_bias_is_a_400_naming_the_field(info, route, bias):
    if isinstance(bias, dict) and "VOCAB" in bias:
        bias = {str(info.vocab_size): 1}
    with pytest.raises(P.APIError) as ei:
        _parse(info, route, bias)
    err = ei.value
    assert err.status == 400, err.message
    assert err.param == "logit_bias", err.message
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error" and body["message"].startswith("logit_bias: ")
