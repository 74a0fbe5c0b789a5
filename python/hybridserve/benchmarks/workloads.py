"""Synthetic workloads of the benchmarks: prompts as token id lists (any OpenAI-compatible server takes
`"prompt": [ids]`), seeded, so two servers get exactly the same requests.

- `random`: unique random prompts of `prompt_len` tokens.
- `shared-prefix`: `num_prefixes` groups; the first `prefix_len` tokens of a prompt are its group's
  (default 3/4 of the prompt), the rest unique. Prefix caching serves the shared part.
- `multi-turn`: conversations of `num_turns` turns, sent one turn after the other; turn t's prompt is
  turn t-1's prompt + the assistant's answer to it + a new user message of `prompt_len` tokens.
  Each turn's prompt extends the previous one, as in a chat. The answer is the server's real output
  (`Conversation.prompt(turn, answers)` with the ids a server returns for `return_token_ids`), so
  the whole previous turn, prompt and answer, can be a prefix hit; `max_tokens` random stand-in ids
  take its place where a server does not return output ids (`Conversation.prompts` holds the
  prompts built with stand-ins only).
- `repetitive`: a short random pattern repeated to `prompt_len` tokens (text that repeats itself:
  where n-gram speculation gets its drafts accepted).

Token ids are drawn from [token_id_min, token_id_max): the default [3, 256) lies inside any
byte-level vocabulary and avoids the demo model's special tokens 0-2.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

WORKLOADS = ("random", "shared-prefix", "multi-turn", "repetitive")


@dataclass
class WorkloadSpec:
    name: str
    num_requests: int
    prompt_len: int = 256
    max_tokens: int = 64
    seed: int = 0
    prefix_len: int | None = None  # shared-prefix: tokens shared within a group (default 3/4 prompt_len)
    num_prefixes: int = 1  # shared-prefix: number of distinct shared prefixes
    num_turns: int = 3  # multi-turn: turns per conversation
    pattern_len: int = 16  # repetitive: length of the repeated pattern
    token_id_min: int = 3
    token_id_max: int = 256


@dataclass
class Conversation:
    """Requests sent one after the other (one request for the single-turn workloads).

    `prompts` are the prompts as built with stand-in answers. A multi-turn conversation also keeps
    its parts, so that a client can put the server's real answers in their place: `messages[t]` is
    turn t's new user message and `stand_ins[t]` the stand-in for the answer to turn t.
    """

    prompts: list[list[int]] = field(default_factory=list)
    messages: list[list[int]] = field(default_factory=list)
    stand_ins: list[list[int]] = field(default_factory=list)

    def prompt(self, turn: int, answers: Sequence[Sequence[int] | None] = ()) -> list[int]:
        """Turn `turn`'s prompt, with `answers[t]` as the answer to turn t where given and not None
        (the stand-in elsewhere); `prompt(t)` is `prompts[t]`."""
        if not self.messages:
            return list(self.prompts[turn])
        out = list(self.messages[0])
        for t in range(1, turn + 1):
            answer = answers[t - 1] if t - 1 < len(answers) else None
            out += self.stand_ins[t - 1] if answer is None else answer
            out += self.messages[t]
        return out


def _ids(rng: random.Random, n: int, spec: WorkloadSpec) -> list[int]:
    return [rng.randrange(spec.token_id_min, spec.token_id_max) for _ in range(n)]


def build_workload(spec: WorkloadSpec) -> list[Conversation]:
    """The conversations of the workload; `sum(len(c.prompts)) == spec.num_requests`."""
    if spec.name not in WORKLOADS:
        raise ValueError(f"workload: one of {', '.join(WORKLOADS)}, got {spec.name!r}")
    if spec.num_requests < 1 or spec.prompt_len < 1:
        raise ValueError("num_requests and prompt_len must be >= 1")
    if not 0 <= spec.token_id_min < spec.token_id_max:
        raise ValueError("token ids: need 0 <= token_id_min < token_id_max")
    # seeded per workload name too, so that two workloads never share tokens by accident (a
    # random prompt must not be a prefix hit for a later shared-prefix run against the same server)
    rng = random.Random(f"{spec.name}:{spec.seed}")
    n = spec.num_requests
    if spec.name == "random":
        return [Conversation([_ids(rng, spec.prompt_len, spec)]) for _ in range(n)]
    if spec.name == "shared-prefix":
        plen = spec.prefix_len if spec.prefix_len is not None else spec.prompt_len * 3 // 4
        plen = max(0, min(plen, spec.prompt_len - 1))
        prefixes = [_ids(rng, plen, spec) for _ in range(max(1, spec.num_prefixes))]
        return [
            Conversation([prefixes[i % len(prefixes)] + _ids(rng, spec.prompt_len - plen, spec)])
            for i in range(n)
        ]
    if spec.name == "repetitive":
        out = []
        for _ in range(n):
            pattern = _ids(rng, max(1, spec.pattern_len), spec)
            reps = -(-spec.prompt_len // len(pattern))
            out.append(Conversation([(pattern * reps)[: spec.prompt_len]]))
        return out
    # multi-turn
    turns = max(1, spec.num_turns)
    convs: list[Conversation] = []
    remaining = n
    while remaining > 0:
        k = min(turns, remaining)
        conv = Conversation()
        for t in range(k):
            if t > 0:
                conv.stand_ins.append(_ids(rng, spec.max_tokens, spec))  # the previous answer, stood in
            conv.messages.append(_ids(rng, spec.prompt_len, spec))
            conv.prompts.append(conv.prompt(t))
        convs.append(conv)
        remaining -= k
    return convs
