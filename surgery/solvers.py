"""Closed-form, rank-limited weight edits (the math and citations are in docs/METHOD.md).

Every solver returns factors ``U`` (d_out × k) and ``V`` (d_in × k) with ΔW = U Vᵀ, so the rank is at
most k by construction. All arithmetic runs in float64 (inputs are moments and means, so the
matrices are at most d_in × d_in); the factors are returned in float32.

Notation, per target matrix W (d_out × d_in) and its inputs ("keys") k:

- ``C_b`` = E[k kᵀ] over behaviour keys (response positions of the contrast pairs),
- ``C_p`` = E[k kᵀ] over preserved keys (typed-decision requests, neutral chat text),
- ``Q``   (d_out × k) orthonormal behaviour directions in W's output space,
- ``B``   (k × d_in) = Σ_p w_p (Qᵀ t_p) m_pᵀ, the cross moment between each pair's wanted output shift
  t_p (coordinates in Q) and its mean key m_p, weighted by the pair's share w_p of behaviour keys.

The unregularised least-squares problem "ΔW k = t_p for every key of pair p" has the normal equations
ΔW C_b = Q B; the solvers below add the preservation terms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clef_model.errors import BlazeError

METHODS = ("steer", "nullspace", "ablate", "distill")


@dataclass
class Factors:
    """ΔW = U Vᵀ for one matrix, with the numbers the manifest records."""

    U: torch.Tensor
    V: torch.Tensor
    scale: float = 1.0          # calibration factor applied to reach the requested strength
    null_dim: int | None = None  # nullspace: dimension of the preserved keys' null space


def _sym(m: torch.Tensor) -> torch.Tensor:
    m = m.double()
    return (m + m.T) / 2


def relative_ridge(matrix: torch.Tensor, mu: float) -> float:
    """μ as a fraction of the mean eigenvalue (trace / d) of ``matrix``, so it is scale free."""
    d = matrix.shape[0]
    return float(mu * torch.trace(matrix.double()).clamp(min=1e-30) / d)


def penalised_gram(key_moment: torch.Tensor, preserve_moment: torch.Tensor | None, lam: float, mu: float,
                   method: str) -> torch.Tensor:
    """G = E[k kᵀ] + λ C_p + μ' I (float64, symmetric), the matrix every ridge solve here inverts; μ' is
    ``mu`` × the mean eigenvalue of E[k kᵀ] + λ C_p (:func:`relative_ridge`)."""
    if lam < 0 or mu < 0:
        raise BlazeError("lambda and mu must be ≥ 0")
    g = _sym(key_moment)
    if lam > 0:
        if preserve_moment is None:
            raise BlazeError(f"{method} with lambda > 0 needs preserved-key statistics (a preserve set)")
        g = g + lam * _sym(preserve_moment)
    return g + relative_ridge(g, mu) * torch.eye(g.shape[0], dtype=g.dtype, device=g.device)


def cross_moment(basis: torch.Tensor, pair_targets: torch.Tensor, pair_keys: torch.Tensor,
                 pair_weights: torch.Tensor) -> torch.Tensor:
    """B = Σ_p w_p (Qᵀ t_p) m_pᵀ  (k × d_in)."""
    coords = pair_targets.double() @ basis.double()            # n × k
    w = (pair_weights.double() / pair_weights.double().sum()).unsqueeze(1)
    return (coords * w).T @ pair_keys.double()                 # k × d_in


def steer(basis: torch.Tensor, cross: torch.Tensor, behaviour_moment: torch.Tensor,
          preserve_moment: torch.Tensor | None = None, lam: float = 0.0, mu: float = 1e-3) -> Factors:
    """Ridge edit with a preserved-key penalty (the MEMIT shape, Meng et al. 2023).

    Minimises ‖ΔW K_b − R‖² + λ‖ΔW K_p‖² + μ'‖ΔW‖² over ΔW = Q X, which gives
    ΔW = Q B (C_b + λ C_p + μ' I)⁻¹ with μ' = ``mu`` × mean eigenvalue of (C_b + λ C_p).
    Only second moments are needed. U = Q, V = (C_b + λ C_p + μ' I)⁻¹ Bᵀ.
    """
    g = penalised_gram(behaviour_moment, preserve_moment, lam, mu, "steer")
    v = torch.linalg.solve(g, cross.double().T)                # d_in × k  (g symmetric)
    return Factors(U=basis.double().clone(), V=v)


def null_basis(preserve_moment: torch.Tensor, threshold: float) -> torch.Tensor:
    """Orthonormal basis (d_in × m) of the preserved keys' (near) null space: eigenvectors of C_p whose
    eigenvalue is below ``threshold`` × the largest one (AlphaEdit, Fang et al. 2025)."""
    if not 0 <= threshold < 1:
        raise BlazeError(f"threshold must be in [0, 1) (got {threshold})")
    values, vectors = torch.linalg.eigh(_sym(preserve_moment))
    keep = values <= threshold * values.max().clamp(min=1e-30)
    return vectors[:, keep]


def nullspace(basis: torch.Tensor, cross: torch.Tensor, behaviour_moment: torch.Tensor,
              preserve_moment: torch.Tensor, threshold: float = 0.01, mu: float = 1e-3) -> Factors:
    """AlphaEdit-style edit: the ridge solution restricted to the null space of the preserved keys.

    With N the null basis and P = N Nᵀ, ΔW = Q B N (Nᵀ C_b N + μ' I)⁻¹ Nᵀ, so ΔW k = 0 for every key
    in the span of the (non-null) preserved keys. U = Q, V = N (Nᵀ C_b N + μ' I)⁻¹ Nᵀ Bᵀ.
    """
    n = null_basis(preserve_moment, threshold)
    if n.shape[1] == 0:
        raise BlazeError("the preserved keys span every input direction at this threshold: raise --threshold")
    g = n.T @ _sym(behaviour_moment) @ n
    g = g + relative_ridge(_sym(behaviour_moment), mu) * torch.eye(g.shape[0], dtype=g.dtype, device=g.device)
    v = n @ torch.linalg.solve(g, n.T @ cross.double().T)
    return Factors(U=basis.double().clone(), V=v, null_dim=int(n.shape[1]))


def reduced_rank_regression(cross: torch.Tensor, key_moment: torch.Tensor, rank: int,
                            preserve_moment: torch.Tensor | None = None, lam: float = 0.0,
                            mu: float = 1e-3) -> Factors:
    """The ``distill`` solve: the best rank-``rank`` ΔW for "ΔW k = r" (Izenman 1975, with the MEMIT penalty).

    Minimises ‖ΔW K − R‖² + λ‖ΔW K_p‖² + μ'‖ΔW‖² over rank(ΔW) ≤ k, from moments only: ``cross`` = E[r kᵀ]
    (d_out × d_in), ``key_moment`` = E[k kᵀ], ``preserve_moment`` = C_p. With G = E[k kᵀ] + λ C_p + μ' I
    (μ' relative, :func:`relative_ridge`) the unconstrained solution is M = E[r kᵀ] G⁻¹, and the objective
    is ‖(ΔW − M) G^½‖² + const, so the rank-k optimum projects M onto the top-k eigenvectors Q of
    M G Mᵀ (= E[r kᵀ] Mᵀ): ΔW = Q Qᵀ M, i.e. U = Q, V = Mᵀ Q.
    """
    if rank < 1:
        raise BlazeError(f"--rank must be ≥ 1 (got {rank})")
    g = penalised_gram(key_moment, preserve_moment, lam, mu, "distill")
    c = cross.double()
    m = torch.linalg.solve(g, c.T).T                           # d_out × d_in  (g symmetric)
    _, vectors = torch.linalg.eigh(_sym(c @ m.T))              # ascending eigenvalues
    q = vectors[:, -min(rank, vectors.shape[1]):].flip(1)       # d_out × k, strongest first
    return Factors(U=q, V=m.T @ q)


def fit_fraction(f: Factors, cross: torch.Tensor, key_moment: torch.Tensor, target_energy: float,
                 strength: float = 1.0) -> float:
    """Share of the targets' energy E‖r‖² that ``strength`` × ΔW reproduces on the keys it was fitted on:
    1 − E‖s ΔW k − r‖² / E‖r‖² (1 = exact, 0 = no better than no edit, < 0 = overshoot)."""
    if target_energy <= 0:
        return 0.0
    u, v = f.U.double(), f.V.double()
    quad = float(torch.trace((u.T @ u) @ (v.T @ key_moment.double() @ v)))    # E‖ΔW k‖²
    lin = float(torch.trace(u.T @ cross.double() @ v))                         # E[rᵀ ΔW k]
    residual = strength * strength * quad - 2 * strength * lin + target_energy
    return 1.0 - residual / target_energy


def ablate_output(weight: torch.Tensor, basis: torch.Tensor, strength: float) -> Factors:
    """Directional ablation on the output side (Arditi et al. 2024): W' = (I − α Q Qᵀ) W.

    U = −α Q, V = Wᵀ Q. α = 1 removes the directions from everything W writes.
    """
    q = basis.double()
    return Factors(U=-strength * q, V=weight.double().T @ q)


def ablate_input(weight: torch.Tensor, basis: torch.Tensor, strength: float) -> Factors:
    """Directional ablation on the input side, for readers: W' = W (I − α Q Qᵀ) with Q in key space.

    U = −α W Q, V = Q: the matrix no longer reads the behaviour directions.
    """
    q = basis.double()
    return Factors(U=-strength * (weight.double() @ q), V=q)


def effect(f: Factors, basis: torch.Tensor, key_mean: torch.Tensor) -> torch.Tensor:
    """Mean change of the output at the behaviour keys, in basis coordinates: Qᵀ U Vᵀ m_b (k,)."""
    return basis.double().T @ (f.U @ (f.V.T @ key_mean.double()))


def calibrate(f: Factors, basis: torch.Tensor, key_mean: torch.Tensor, desired: torch.Tensor) -> Factors:
    """Scale ΔW so its mean effect at the behaviour keys matches ``desired`` (least squares over the
    basis coordinates). This is what makes a strength mean the same thing for every method, λ and
    threshold: see docs/METHOD.md, "Strength"."""
    got = effect(f, basis, key_mean)
    denom = float(got @ got)
    want = desired.double()
    if denom <= 1e-24 * max(float(want @ want), 1e-30):
        raise BlazeError(
            "the preservation term removed the whole behaviour effect of this matrix: "
            "lower --lambda, lower --threshold, or choose other --layers/--kinds"
        )
    s = float(got @ want) / denom
    return Factors(U=f.U, V=f.V * s, scale=s, null_dim=f.null_dim)


def to_float32(f: Factors) -> tuple[torch.Tensor, torch.Tensor]:
    """The (U, V) pair as contiguous float32 CPU tensors, as stored in a patch."""
    return f.U.float().cpu().contiguous(), f.V.float().cpu().contiguous()


def numerical_rank(u: torch.Tensor, v: torch.Tensor, rtol: float = 1e-6) -> int:
    """Rank of U Vᵀ without forming it: singular values of (R_u R_vᵀ) from the QR factors."""
    _, ru = torch.linalg.qr(u.double())
    _, rv = torch.linalg.qr(v.double())
    s = torch.linalg.svdvals(ru @ rv.T)
    if s.numel() == 0 or s[0] == 0:
        return 0
    return int((s > rtol * s[0]).sum())
