"""Edit on the tiny Clef fixture (CPU): targets, rank ≤ k, the strength definition, metadata, errors."""

from __future__ import annotations

import pytest
import torch

from clef_model.errors import BlazeError
from surgery.directions import ContrastPair
from surgery.edit import (
    SolveSettings,
    collect_statistics,
    plan,
    solve,
    solve_factors,
    weights_from_runtime,
)
from surgery.statistics import PreserveSet, contrast_sequences
from surgery.targets import split_name

PAIRS = [
    ContrastPair("What is the boiling point of water?", "100 °C.",
                 "Great question! Water boils at 100 degrees Celsius at sea level, which is 212 °F.",
                 "Answer in as few words as possible.", "Answer in great detail."),
    ContrastPair("How many legs does a spider have?", "Eight.",
                 "Spiders are arachnids, and like all arachnids they have eight legs in total.", None, None),
    ContrastPair("Who wrote Hamlet?", "Shakespeare.",
                 "Hamlet was written by William Shakespeare around 1600; it is one of his tragedies.", None, None),
    ContrastPair("What colour is the sky?", "Blue.",
                 "On a clear day the sky appears blue because air scatters short wavelengths.", None, None),
]
PRESERVE = PreserveSet(texts=["Write a haiku about autumn.", "Sort a list in Python.", "Explain photosynthesis."])


@pytest.fixture(scope="module")
def stats(tiny_runtime):
    return collect_statistics(tiny_runtime, PAIRS, PRESERVE, "2-4", "writers", rank=2)


def test_plan_resolves_writers_per_layer_type(tiny_runtime):
    p = plan(tiny_runtime, "2-4", "writers", rank=2)
    kinds = {split_name(n) for n in p.targets}
    assert (3, "self_attn.o_proj") in kinds and (2, "linear_attn.out_proj") in kinds
    assert (2, "mlp.down_proj") in kinds and len(p.targets) == 6
    with pytest.raises(BlazeError, match="out of range"):
        plan(tiny_runtime, "2-40", "writers")
    with pytest.raises(BlazeError, match="unknown method"):
        plan(tiny_runtime, "2-4", "writers", method="magic")


@pytest.mark.parametrize("method,k", [("steer", 1), ("steer", 2), ("nullspace", 1), ("ablate", 2)])
def test_solve_rank_and_targets(tiny_runtime, stats, method, k):
    patch = solve(stats, SolveSettings(method, 0.2, k, 1.0, 0.3), weights=weights_from_runtime(tiny_runtime),
                  metadata={"spec_hash": "abc"})
    assert sorted(patch.names()) == sorted(stats.keys)
    for name in patch.names():
        assert patch.rank(name) == k
        delta = patch.delta(name).double()
        assert torch.linalg.matrix_rank(delta, rtol=1e-6).item() <= k
        assert delta.abs().max() > 0
    meta = patch.metadata
    assert (meta["method"], meta["rank"], meta["strength"], meta["spec_hash"]) == (method, k, 0.2, "abc")
    assert meta["layers"] == [2, 3, 4] and "mlp.down_proj" in meta["kinds"]
    assert all(i["rank"] <= k for i in meta["targets"].values())


def test_strength_is_the_mean_shift_at_behaviour_keys(tiny_runtime, stats):
    """One down_proj in one layer: the layer's output moves, on average over the behaviour positions, by
    exactly strength × the contrastive mean difference along the direction (docs/METHOD.md)."""
    name = "model.language_model.layers.3.mlp.down_proj"
    alpha = 0.5
    result = solve_factors(stats, "steer", alpha, 1, 1.0, targets=[name])
    f = result.factors[name]
    r = f.U[:, 0] / f.U[:, 0].norm()
    layer = tiny_runtime.decoder_layers()[3]
    seqs = contrast_sequences(tiny_runtime, PAIRS)
    captured = []
    hook = layer.register_forward_hook(lambda _m, _i, o: captured.append((o[0] if isinstance(o, tuple) else o)[0]))
    from surgery.patch import Patch

    patch = Patch(factors={name: (f.U.float(), f.V.float())})
    try:
        with torch.no_grad():
            for s in seqs:
                tiny_runtime.text_model()(input_ids=torch.tensor([s.ids]))
            with patch.applied(tiny_runtime):
                for s in seqs:
                    tiny_runtime.text_model()(input_ids=torch.tensor([s.ids]))
    finally:
        hook.remove()
    n = len(seqs)
    shifts = torch.cat([(captured[n + i] - captured[i])[s.positions].double() for i, s in enumerate(seqs)])
    achieved = (shifts @ r.double()).mean().item()
    d = (stats.wanted_means[3] - stats.unwanted_means[3]).double()
    weights = stats.keys[name].pair_counts.double()
    desired = alpha * ((weights / weights.sum()) @ d @ r.double()).item()
    assert achieved == pytest.approx(desired, rel=1e-3)
    # the edit restored the exact weights
    assert torch.equal(tiny_runtime.named_linears()[name].weight, weights_from_runtime(tiny_runtime)(name))


def test_strength_is_linear_and_zero_is_no_edit(stats):
    a = solve_factors(stats, "steer", 0.1, 1, 1.0)
    b = solve_factors(stats, "steer", 0.3, 1, 1.0)
    for name in a.factors:
        assert torch.allclose(3 * (a.factors[name].U @ a.factors[name].V.T), b.factors[name].U @ b.factors[name].V.T)
    zero = solve_factors(stats, "steer", 0.0, 1, 1.0)
    assert all(float(f.V.abs().max()) == 0.0 for f in zero.factors.values())
    with pytest.raises(BlazeError):
        solve_factors(stats, "steer", -1.0)


def test_readers_and_errors(tiny_runtime):
    stats = collect_statistics(tiny_runtime, PAIRS[:2], PRESERVE, "5", "mlp.up_proj")
    weights = weights_from_runtime(tiny_runtime)
    patch = solve(stats, SolveSettings("steer", 0.2, 1, 1.0), weights=weights)
    assert patch.names() == ["model.language_model.layers.5.mlp.up_proj"]
    with pytest.raises(BlazeError, match="needs its weight"):
        solve_factors(stats, "steer", 0.2)
    with pytest.raises(BlazeError, match="threshold"):
        solve_factors(stats, "nullspace", 0.2, threshold=2.0, weights=weights)


def test_sweep_reuses_the_solve_and_matches_a_fresh_one(stats):
    """A strength sweep solves each matrix once (memo on the statistics); later points equal a fresh solve."""
    import dataclasses

    stats.memo.clear()
    solve_factors(stats, "steer", 0.1, 1, 1.0)
    solved = {k for k in stats.memo if k[0] == "solve"}
    assert len(solved) == len(stats.keys)
    swept = solve_factors(stats, "steer", 0.25, 1, 1.0)
    assert {k for k in stats.memo if k[0] == "solve"} == solved          # no new solves
    fresh = solve_factors(dataclasses.replace(stats, memo={}), "steer", 0.25, 1, 1.0)
    for name, f in fresh.factors.items():
        assert torch.equal(swept.factors[name].U, f.U) and torch.equal(swept.factors[name].V, f.V)
    solve_factors(stats, "steer", 0.25, 1, 2.0)                           # another λ is another solve
    assert len({k for k in stats.memo if k[0] == "solve"}) == 2 * len(solved)


def test_rank_limit_message_names_the_real_limit():
    """A rank above the pairs' or the activations' width names that limit (issue 14: not "134 pairs")."""
    from surgery.directions import principal_directions

    with pytest.raises(BlazeError, match="rank 120 is above the limit of 16 here .set by the 16-wide activations"):
        principal_directions(torch.randn(134, 16), 120)
    with pytest.raises(BlazeError, match="limit of 3 here .set by 3 contrast pairs"):
        principal_directions(torch.randn(3, 16), 5)


def test_solve_settings_refuse_non_finite_numbers():
    for bad in ({"lam": float("nan")}, {"lam": float("inf")}, {"strength": -1.0}, {"rank": 0}, {"method": "x"}):
        with pytest.raises(BlazeError):
            SolveSettings(**bad)


def test_a_normalised_writers_output_factor_is_scaled_and_nothing_else(stats, tmp_path):
    """With a post-norm scale for one writer (as ``collect_statistics`` stores for Gemma 3), the steer solve
    multiplies that writer's U by it and leaves V and every other matrix alone; ablate refuses that writer; the
    scale survives a save and load of the statistics."""
    import dataclasses

    writer = next(n for n in stats.targets if split_name(n)[1] == "mlp.down_proj")
    d_out = stats.wanted_means[split_name(writer)[0]].shape[1]
    scale = torch.linspace(0.5, 2.0, d_out)
    scaled = dataclasses.replace(stats, output_scales={writer: scale}, memo={})
    plain = solve_factors(stats, "steer", 0.2, 2, 1.0).factors
    mapped = solve_factors(scaled, "steer", 0.2, 2, 1.0).factors
    assert torch.allclose(mapped[writer].U, plain[writer].U * scale.double().unsqueeze(1))
    assert torch.allclose(mapped[writer].V, plain[writer].V)
    for name in stats.targets:
        if name != writer:
            assert torch.equal(mapped[name].U, plain[name].U) and torch.equal(mapped[name].V, plain[name].V)
    with pytest.raises(BlazeError, match="normalised before the residual"):
        solve_factors(scaled, "ablate", 0.5, 1, 1.0, weights=lambda name: torch.zeros(d_out, d_out))
    scaled.save(tmp_path / "s.pt")
    again = type(stats).load(tmp_path / "s.pt")
    assert set(again.output_scales) == {writer} and torch.equal(again.output_scales[writer], scale)
    assert stats.output_scales == {}                  # the tiny Clef model's writers add to the residual as they are
