"""The rows a forward drops after the last cache-writing layer (CausalLM.forward's `keep`).

Only the logits rows' outputs are needed after the last Mamba / attention layer: that layer
computes the queries of those rows only and the cache-free layers after it (NemotronH's trailing
MLP / MoE, Bamba's last feed-forward) run on them alone. These tests hold the logits and every
cache write of such a forward to the same forward asked for every token's logits, in float64,
on a batch of decode rows, a prefill chunk that ends its prompt and one that does not, with the
C++ kernels and on the pure-torch path.
"""

from __future__ import annotations

import pytest
import torch

from hybridserve.kernels import backend
from hybridserve.kernels.backend import Backend
from hybridserve.model.loader import load_model
from model_fixtures import ALL_CONFIGS, Driver, build_hf_model, random_prompts, save_hf_model

torch.set_num_threads(1)

VOCAB = 256
NAMES = list(ALL_CONFIGS)
# the configs whose last cache layer is followed by work on the rows (all but pure Mamba2)
PRUNES = {n for n in NAMES if ALL_CONFIGS[n][0] != "mamba2"}


def _linear_rows(model: torch.nn.Module) -> tuple[list[int], list[torch.utils.hooks.RemovableHandle]]:
    """Rows each linear layer runs on (the routed experts of a MoE, which see the rows routed to
    them, left out)."""
    rows: list[int] = []
    handles = [
        m.register_forward_pre_hook(lambda _m, args: rows.append(int(args[0].shape[0])))
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head") and ".experts." not in name
    ]
    return rows, handles


def _drive(lm, prompts: list[list[int]], all_logits: bool) -> tuple[torch.Tensor, Driver, list[int], int]:
    drv = Driver(lm, max_seq=64, max_reqs=4, window=4)
    a = drv._new_req(0, prompts[0], 0, None, 0)
    b = drv._new_req(1, prompts[1], 0, None, 0)
    c = drv._new_req(2, prompts[2], 0, [6, len(prompts[2]) - 6], 0)
    d = drv._new_req(3, prompts[3], 0, [5, len(prompts[3]) - 5], 0)
    drv.step([(a, a.tokens, False), (b, b.tokens, False)])
    drv.step([(c, c.tokens[:6], False)])
    a.prompt_len = b.prompt_len = 0  # decode rows from here on
    rows, handles = _linear_rows(lm.model)
    try:
        # a 1-token and a 3-token decode row, c's final chunk, d's first (non-final) chunk
        batch = [(a, [5], True), (b, [7, 9, 11], True), (c, c.tokens[6:], False), (d, d.tokens[:5], False)]
        logits = drv.step(batch, all_logits=all_logits)
    finally:
        for h in handles:
            h.remove()
    total = 1 + 3 + (len(c.tokens) - 6) + 5
    return logits, drv, rows, total


@pytest.mark.parametrize("native", [True, False], ids=["cpp-kernels", "torch"])
@pytest.mark.parametrize("name", NAMES)
def test_dropping_rows_after_the_last_cache_layer_is_exact(tmp_path, monkeypatch, name, native):
    # the C++ kernels, or the pure-torch attention of kept rows
    monkeypatch.setattr(backend, "_pinned", Backend.CPU_NATIVE if native else Backend.REFERENCE)
    kind, ov = ALL_CONFIGS[name]
    lm = load_model(
        str(save_hf_model(build_hf_model(kind, ov, vocab_size=VOCAB, seed=3), tmp_path)), torch.float64
    )
    prompts = random_prompts(4, VOCAB, [9, 12, 17, 11], seed=5)
    kept, drv_kept, rows_kept, total = _drive(lm, prompts, all_logits=False)
    full, drv_full, rows_full, _ = _drive(lm, prompts, all_logits=True)
    # logits rows: a's token, b's 3 tokens, c's last token (d's chunk does not end its prompt)
    assert kept.shape[0] == 5 and full.shape[0] == total
    want = torch.tensor([0, 1, 2, 3, 3 + len(prompts[2]) - 6])
    torch.testing.assert_close(kept, full[want], rtol=1e-12, atol=1e-12)
    # every cache write is the same: K/V of every token, Mamba states of every row
    for name_ in ("kv", "conv", "ssm"):
        mine, ref = getattr(drv_kept.caches, name_), getattr(drv_full.caches, name_)
        assert mine.keys() == ref.keys()
        for i in mine:
            assert torch.equal(mine[i], ref[i]), (name_, i)
    # the forward asked for every token's logits runs every linear on every token; the other one
    # runs some of them on the 5 logits rows only
    assert set(rows_full) == {total}
    assert (5 in rows_kept) == (name in PRUNES), rows_kept
    assert sum(rows_kept) < sum(rows_full) if name in PRUNES else rows_kept == rows_full


def test_which_logits_lists_drop_rows():
    from hybridserve.model.architectures.base import _drops_rows

    t = torch.tensor
    assert _drops_rows(t([3, 7, 9], dtype=torch.int64), 10)
    assert _drops_rows(t([], dtype=torch.int64), 10)  # a chunk that ends no prompt: no rows at all
    assert not _drops_rows(t(list(range(10))), 10)  # every token: nothing to drop
    # anything but a strictly increasing list inside the batch is taken as it is, by indexing
    for li in ([7, 3], [3, 3], [-1, 4], [2, 10]):
        assert not _drops_rows(t(li), 10), li


def test_a_forward_with_no_logits_rows_writes_every_cache(tmp_path):
    kind, ov = ALL_CONFIGS["nh_g2_moe"]
    lm = load_model(
        str(save_hf_model(build_hf_model(kind, ov, vocab_size=VOCAB, seed=4), tmp_path)), torch.float64
    )
    prompt = random_prompts(1, VOCAB, [14], seed=6)[0]
    runs = []
    for all_logits in (False, True):
        drv = Driver(lm, max_seq=32, max_reqs=1, window=2)
        req = drv._new_req(0, prompt, 0, [9, 5], 0)
        first = drv.step([(req, prompt[:9], False)], all_logits=all_logits)  # not the last chunk
        last = drv.step([(req, prompt[9:], False)])
        runs.append((first, last, drv))
    assert runs[0][0].shape == (0, VOCAB) and runs[1][0].shape == (9, VOCAB)
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-12, atol=1e-12)
    for name in ("kv", "conv", "ssm"):
        for i, t in getattr(runs[0][2].caches, name).items():
            assert torch.equal(t, getattr(runs[1][2].caches, name)[i]), (name, i)
