"""The draft-model proposer's rows on the CPU: the tokens a request accepted since its last
proposal (a small prefill row from the draft's kept state) take the native step, as its decode
rows do, and the drafts are the model forward's drafts (float64: the two paths agree to rounding,
far inside any gap between logits)."""

from __future__ import annotations

import random
from typing import Any

import torch

from hybridserve.model.demo import ensure_demo_model
from hybridserve.spec_decode.base import History
from hybridserve.spec_decode.draft_model import DraftModelProposer


def _proposer(native: bool) -> DraftModelProposer:
    p = DraftModelProposer(
        ensure_demo_model(),
        dtype=torch.float64,
        device=torch.device("cpu"),
        max_model_len=256,
        max_num_seqs=4,
        num_speculative_tokens=3,
    )
    if not native:
        p.decode_step = None
    return p


def test_accepted_tokens_take_the_native_step_and_draft_as_the_forward_does() -> None:
    native, forward = _proposer(True), _proposer(False)
    assert native.decode_step is not None
    taken: list[tuple[int, int]] = []  # (decode rows, tokens) of the steps the native step ran
    run = native.decode_step.run

    def counted(out: Any) -> Any:
        got = run(out)
        if got is not None:
            taken.append((int(out.num_decodes), len(out.input_ids)))
        return got

    native.decode_step.run = counted  # type: ignore[method-assign]
    rng = random.Random(3)
    histories = [[rng.randrange(10, 500) for _ in range(n)] for n in (9, 40, 17)]
    ids = ["a", "b", "c"]
    for _ in range(6):  # proposals, each after some of the drafts were "accepted"
        hist = [History(h, (), ()) for h in histories]
        drafts = native.propose_histories(ids, hist, 3)
        assert drafts == forward.propose_histories(ids, hist, 3)
        for h, d in zip(histories, drafts):
            h.extend(d[: rng.randrange(0, 4)] + [rng.randrange(10, 500)])
    # every step ran natively: per proposal one step of prefill rows, then two of decode rows
    prefill = [t for t in taken if t[0] == 0]
    assert len(prefill) == 6 and len(taken) == 18
    assert all(tokens <= 3 * 4 for _, tokens in prefill[1:])  # (later ones: what was accepted)
