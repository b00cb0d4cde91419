"""Solver math on small random matrices: rank ≤ k, normal equations, null-space annihilation, ablation."""

import pytest
import torch

from clef_model.errors import BlazeError
from surgery import solvers
from surgery.directions import choose_band, layer_directions, principal_directions, separation_score


def _orth(d, k, g):
    q, _ = torch.linalg.qr(torch.randn(d, k, generator=g, dtype=torch.float64))
    return q


@pytest.fixture
def problem():
    g = torch.Generator().manual_seed(0)
    d_in, d_out, n_pairs, per = 12, 9, 6, 5
    keys = torch.randn(n_pairs * per, d_in, generator=g, dtype=torch.float64) + 0.5
    pair_of = torch.arange(n_pairs).repeat_interleave(per)
    targets = torch.randn(n_pairs, d_out, generator=g, dtype=torch.float64)
    kp = torch.randn(7, d_in, generator=g, dtype=torch.float64)  # 7 preserved keys: rank 7 < 12
    return keys, pair_of, targets, kp


def _moments(keys, pair_of, n_pairs):
    means = torch.stack([keys[pair_of == p].mean(0) for p in range(n_pairs)])
    counts = torch.bincount(pair_of, minlength=n_pairs).double()
    return means, counts, keys.T @ keys / len(keys)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_steer_solves_ridge_normal_equations_with_rank_k(problem, k):
    keys, pair_of, targets, kp = problem
    n = targets.shape[0]
    q = principal_directions(targets, k)
    means, counts, cb = _moments(keys, pair_of, n)
    cp = kp.T @ kp / len(kp)
    lam, mu = 0.7, 1e-2
    f = solvers.steer(q, solvers.cross_moment(q, targets, means, counts), cb, cp, lam=lam, mu=mu)
    dw = f.U @ f.V.T
    assert solvers.numerical_rank(f.U, f.V) <= k
    assert torch.linalg.matrix_rank(dw).item() <= k
    # Explicit problem: every key of pair p should map to R_p = Q Qᵀ t_p.
    r = (targets @ q @ q.T)[pair_of]                               # N × d_out
    kb = keys.T                                                     # d_in × N
    big_n = keys.shape[0]
    g = kb @ kb.T / big_n + lam * cp
    g = g + solvers.relative_ridge(g, mu) * torch.eye(g.shape[0], dtype=g.dtype)
    # normal equations of min ‖ΔW K_b − R‖²/N + λ‖ΔW K_p‖²/N_p + μ'‖ΔW‖² (restricted to span Q)
    assert torch.allclose(dw @ g, r.T @ kb.T / big_n, atol=1e-10)


def test_steer_without_regularisation_fits_a_consistent_system():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(40, 6, generator=g, dtype=torch.float64)
    q = _orth(5, 1, g)
    true = q @ torch.randn(1, 6, generator=g, dtype=torch.float64)    # a rank-1 map
    pair_of = torch.arange(40)                                          # one key per "pair"
    targets = keys @ true.T
    means, counts, cb = _moments(keys, pair_of, 40)
    f = solvers.steer(q, solvers.cross_moment(q, targets, means, counts), cb, None, lam=0.0, mu=0.0)
    assert torch.allclose(f.U @ f.V.T, true, atol=1e-10)


def test_nullspace_annihilates_preserved_keys(problem):
    keys, pair_of, targets, kp = problem
    q = principal_directions(targets, 2)
    means, counts, cb = _moments(keys, pair_of, targets.shape[0])
    cp = kp.T @ kp / len(kp)
    f = solvers.nullspace(q, solvers.cross_moment(q, targets, means, counts), cb, cp, threshold=1e-8)
    dw = f.U @ f.V.T
    assert f.null_dim == 12 - 7
    assert (dw @ kp.T).abs().max() < 1e-10 * dw.abs().max()
    assert dw.abs().max() > 0 and solvers.numerical_rank(f.U, f.V) <= 2
    # and it still acts on behaviour keys
    assert (dw @ keys.T).abs().max() > 1e-3


def test_nullspace_threshold_too_high_or_full_rank_errors(problem):
    keys, pair_of, targets, _ = problem
    q = principal_directions(targets, 1)
    means, counts, cb = _moments(keys, pair_of, targets.shape[0])
    full = torch.eye(12, dtype=torch.float64)
    with pytest.raises(BlazeError, match="threshold"):
        solvers.nullspace(q, solvers.cross_moment(q, targets, means, counts), cb, full, threshold=0.0)
    with pytest.raises(BlazeError):
        solvers.null_basis(full, 1.5)


def test_ablate_output_and_input():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(8, 5, generator=g, dtype=torch.float64)
    q = _orth(8, 2, g)
    f = solvers.ablate_output(w, q, 1.0)
    new = w + f.U @ f.V.T
    assert torch.allclose(q.T @ new, torch.zeros(2, 5, dtype=torch.float64), atol=1e-12)
    half = w + solvers.ablate_output(w, q, 0.5).U @ solvers.ablate_output(w, q, 0.5).V.T
    assert torch.allclose(q.T @ half, 0.5 * q.T @ w, atol=1e-12)
    qi = _orth(5, 1, g)
    fi = solvers.ablate_input(w, qi, 1.0)
    assert torch.allclose((w + fi.U @ fi.V.T) @ qi, torch.zeros(8, 1, dtype=torch.float64), atol=1e-12)
    assert solvers.numerical_rank(fi.U, fi.V) == 1


def test_calibrate_hits_desired_effect_and_is_linear(problem):
    keys, pair_of, targets, kp = problem
    q = principal_directions(targets, 1)
    means, counts, cb = _moments(keys, pair_of, targets.shape[0])
    f = solvers.steer(q, solvers.cross_moment(q, targets, means, counts), cb, kp.T @ kp / 7, lam=5.0)
    m = keys.mean(0)
    desired = torch.tensor([0.3], dtype=torch.float64)
    c = solvers.calibrate(f, q, m, desired)
    assert torch.allclose(solvers.effect(c, q, m), desired)
    c2 = solvers.calibrate(f, q, m, 2 * desired)
    assert torch.allclose(c2.V, 2 * c.V)


def test_directions_and_separation():
    g = torch.Generator().manual_seed(3)
    d = 16
    axis = torch.zeros(d, dtype=torch.float64)
    axis[0] = 1.0
    base = torch.randn(30, d, generator=g, dtype=torch.float64)
    wanted = base + 2.0 * axis + 0.1 * torch.randn(30, d, generator=g, dtype=torch.float64)
    unwanted = base
    basis = principal_directions(wanted - unwanted, 3)
    assert basis.shape == (d, 3)
    assert torch.allclose(basis.T @ basis, torch.eye(3, dtype=torch.float64), atol=1e-10)
    assert basis[0, 0] > 0.99                       # first column = mean difference, sign kept
    assert separation_score(wanted, unwanted) > 1.0
    assert separation_score(unwanted, unwanted + 1e-9 * torch.randn(30, d, generator=g, dtype=torch.float64)) < 5
    found = layer_directions({0: wanted.float()}, {0: unwanted.float()}, 2,
                             torch.tensor([0] * 15 + [1] * 15))
    assert found[0].basis.shape == (d, 2)
    with pytest.raises(BlazeError, match="rank"):
        layer_directions({0: wanted}, {0: unwanted}, 1, torch.tensor([0] * 15 + [1] * 15))


def test_choose_band_picks_best_contiguous_window():
    scores = {i: 0.1 for i in range(20)}
    for i in range(10, 16):
        scores[i] = 3.0
    band = choose_band(scores, 20, width=6)
    assert band == list(range(10, 16))
    assert choose_band({0: 9.0, 1: 1.0, 2: 1.0, 3: 9.0}, 4, width=2) == [1, 2]   # never first/last layer
