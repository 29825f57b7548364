"""The orthonormal DCT-II on chunks, and an inverse that gives the same bits on every CPU.

D[k, n] = α_k·cos(π(2n+1)k / 2s), α_0 = √(1/s), α_k = √(2/s) for k > 0: orthonormal, so D⁻¹ = Dᵀ. A chunk x (a row)
has coefficients c = x·Dᵀ and comes back as x = c·D.

Every region applies the same decoded update to θ_global, so the inverse that decodes the regions' coefficients
must round identically everywhere. A matrix product does not: BLAS kernels sum in an order (and with fused
multiply-adds) that depends on the CPU and the thread count. `inverse_exact` sums the s terms one after another,
each product and each sum rounded once (IEEE 754), the same on any CPU; the basis is computed in float64 by
Python's `math.cos` and rounded once to fp32. The forward transform and a region's own residual are local (no
other region recomputes them) and use the fast matrix product.
"""

from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=8)
def dct_basis(size: int) -> torch.Tensor:
    """D (size × size, fp32): row k is the k-th cosine of the orthonormal DCT-II."""
    rows = []
    for k in range(size):
        alpha = math.sqrt((1.0 if k == 0 else 2.0) / size)
        rows.append([alpha * math.cos(math.pi * (2 * n + 1) * k / (2 * size)) for n in range(size)])
    return torch.tensor(rows, dtype=torch.float64).float()


def forward(chunks: torch.Tensor) -> torch.Tensor:
    """Coefficients (chunks, s) of each row of `chunks` (local: a matrix product)."""
    return chunks.float() @ dct_basis(chunks.shape[1]).T


def inverse(coefficients: torch.Tensor) -> torch.Tensor:
    """The chunks whose coefficients these are (local: a matrix product)."""
    return coefficients.float() @ dct_basis(coefficients.shape[1])


def inverse_exact(coefficients: torch.Tensor) -> torch.Tensor:
    """`inverse`, summed term by term in a fixed order with every operation rounded once: bit-identical on any
    CPU (s passes over the tensor: ~2·s·numel operations)."""
    basis = dct_basis(coefficients.shape[1])
    out = torch.zeros_like(coefficients, dtype=torch.float32)
    for k in range(basis.shape[0]):
        out = torch.add(out, torch.mul(coefficients[:, k:k + 1], basis[k:k + 1, :]))
    return out
