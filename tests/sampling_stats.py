"""Chi-square goodness of fit for the sampling tests (no scipy: torch.special.gammaincc)."""

from __future__ import annotations

import torch


def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof)."""
    if dof <= 0:
        raise ValueError("dof must be positive")
    s = torch.tensor(stat / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), s))


def chisquare_pvalue(
    observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0
) -> float:
    """p-value of observed counts against probabilities; cells with expected < min_expected are merged.

    Observations in a cell of probability zero make the p-value 0 (an impossible outcome happened).
    """
    obs = observed.double().flatten()
    probs = expected_probs.double().flatten()
    n = float(obs.sum())
    if bool((obs[probs == 0] > 0).any()):
        return 0.0
    keep = probs > 0
    obs, exp = obs[keep], probs[keep] * n
    order = torch.argsort(exp, descending=True)
    obs, exp = obs[order], exp[order]
    big = exp >= min_expected
    cells_obs = list(obs[big])
    cells_exp = list(exp[big])
    if bool((~big).any()):
        # Merge the small cells into one (and into the smallest big cell if still too small).
        so, se = obs[~big].sum(), exp[~big].sum()
        if se < min_expected and cells_exp:
            cells_obs[-1] = cells_obs[-1] + so
            cells_exp[-1] = cells_exp[-1] + se
        else:
            cells_obs.append(so)
            cells_exp.append(se)
    o = torch.stack([torch.as_tensor(c) for c in cells_obs])
    e = torch.stack([torch.as_tensor(c) for c in cells_exp])
    stat = float(((o - e) ** 2 / e).sum())
    return chi2_sf(stat, len(cells_obs) - 1)
