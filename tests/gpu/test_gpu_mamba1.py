"""Jamba's Mamba1 scan (kernels/csrc/cuda/mamba1.cu) vs the float64 twin: long and short prefill
rows, a row from zeros, emitted states, an empty row, d_state 16 to 128."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import DEVICE, ON_GPU, OUT_TOL, STATE_TOL, assert_close, gen

from hybridserve.kernels import dispatch
from hybridserve.kernels.selective_scan import selective_scan_prefill, selective_scan_rows


@pytest.mark.parametrize("Dc,N", [(8192, 16), (300, 16), (1024, 64), (256, 128)])
def test_mamba1_scan_matches_twin(Dc: int, N: int) -> None:
    g = gen(11)
    lengths = [700, 1, 3, 0, 129]
    T, R = sum(lengths), len(lengths)
    x = torch.randn((T, Dc), generator=g)
    dt = torch.rand((T, Dc), generator=g) * 0.2
    A = -torch.rand((Dc, N), generator=g) * 4
    B, C = torch.randn((T, N), generator=g), torch.randn((T, N), generator=g)
    D = torch.randn(Dc, generator=g)
    pool = torch.randn((2 * R + 6, Dc, N), generator=g)
    pool[0] = 0
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    read = torch.arange(1, R + 1)
    has_init = torch.tensor([True, False, True, True, False])
    write = torch.arange(R + 1, 2 * R + 1)
    emit_row, emit_token, emit_slot = (
        torch.tensor([0, 0, 4]),
        torch.tensor([255, 511, 0]),
        torch.tensor([12, 13, 14]),
    )
    on = [t.to(DEVICE) for t in (x, dt, A, B, C, D)]
    p_dev = pool.to(DEVICE)
    y = selective_scan_prefill(*on, p_dev, qsl, read, has_init, write, emit_row, emit_token, emit_slot)
    if ON_GPU:  # the op itself ran, not the twin
        assert (
            dispatch.mamba1_scan(*on, p_dev.clone(), qsl, read, None, (emit_row, emit_token, emit_slot))
            is not None
        )
    p_ref = pool.double()
    rows = torch.cat([emit_row, torch.arange(R)[torch.tensor(lengths) > 0]])
    toks = torch.cat([emit_token, (torch.tensor(lengths) - 1)[torch.tensor(lengths) > 0]])
    slots = torch.cat([emit_slot, write[torch.tensor(lengths) > 0]])
    order = torch.argsort(rows * (T + 1) + toks, stable=True)
    want = selective_scan_rows(
        *(t.double() for t in (x, dt, A, B, C, D)),
        p_ref,
        qsl,
        read,
        has_init,
        (rows[order], toks[order], slots[order]),
    )
    # the same recurrence in plain torch float32 on the same device: the baseline when an element
    # misses the elementwise bound (a 700-token row's state sums many terms that cancel)
    p32 = pool.to(DEVICE)
    y32 = selective_scan_rows(*on, p32, qsl, read, has_init, (rows[order], toks[order], slots[order]))
    assert_close(y.cpu(), want, OUT_TOL[torch.float32], y32.cpu(), what="y")
    assert_close(p_dev.cpu(), p_ref, STATE_TOL[torch.float32], p32.cpu(), what="states")
