"""The float64 oracle of the six spectral columns, written from docs/metrics.md
independently of rankscope: the singular values of the matrix in float64
(``torch.linalg.svdvals``). The wheel test runs this file inside the user's venv (its
source goes ahead of the script run there); ``python/benches/gpu_accuracy.py`` imports
it."""

import math

import torch

COLUMNS = ("stable_rank", "participation_ratio", "participation_ratio_sv", "nuclear_norm_ratio", "effective_rank", "cum_energy_90")


def oracle(x: torch.Tensor) -> dict:
    """The six columns of ``x`` (rows × columns, or any shape whose last dimension is
    the columns), from its values in float64."""
    sv = torch.linalg.svdvals(x.detach().cpu().double().reshape(-1, x.shape[-1])).tolist()
    lam = [t * t for t in sv]
    p = [t / sum(sv) for t in sv]
    acc, k = 0.0, 0
    for k, value in enumerate(lam, 1):
        acc += value
        if acc >= 0.9 * sum(lam):
            break
    return {
        "stable_rank": sum(lam) / lam[0],
        "participation_ratio": sum(lam) ** 2 / sum(v * v for v in lam),
        "participation_ratio_sv": sum(sv) ** 2 / sum(lam),
        "nuclear_norm_ratio": sum(sv) / sv[0],
        "effective_rank": math.exp(-sum(q * math.log(q) for q in p if q > 0)),
        "cum_energy_90": k,
    }
