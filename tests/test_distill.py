"""The ``distill`` method: reduced-rank regression solver, teacher answers, aligned collection, edit effect.

Fast: synthetic matrices for the solver; the in-process random 4-layer Llama stand-in of test_statistics
(character tokenizer) for the collection and for an end-to-end edit.
"""

from __future__ import annotations

import pytest
import torch
from test_statistics import PAIRS, MiniRuntime

from clef_model.errors import BlazeError
from clef_model.runtime import Generation
from surgery import solvers
from surgery.distill import (
    DistillItem,
    DistillStatistics,
    collect_distill,
    collect_distill_statistics,
    item_runs,
    teacher_items,
)
from surgery.edit import SolveSettings, solve, solve_factors
from surgery.statistics import PreserveSet

WRITERS = [f"model.layers.{i}.{k}" for i in (1, 2, 3) for k in ("self_attn.o_proj", "mlp.down_proj")]


def _moments(keys: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    n = keys.shape[0]
    return keys.T @ keys / n, targets.T @ keys / n, float(targets.pow(2).sum() / n)


def _objective(delta: torch.Tensor, keys: torch.Tensor, targets: torch.Tensor) -> float:
    return float((keys @ delta.T - targets).pow(2).sum())


# -------------------------------------------------------------------------------------------- solver
def test_recovers_a_planted_low_rank_map():
    torch.manual_seed(0)
    d_in, d_out, n = 12, 9, 400
    planted = torch.randn(d_out, 2, dtype=torch.float64) @ torch.randn(2, d_in, dtype=torch.float64)
    keys = torch.randn(n, d_in, dtype=torch.float64) * torch.linspace(0.2, 3.0, d_in, dtype=torch.float64)
    kk, rk, rr = _moments(keys, keys @ planted.T)
    f = solvers.reduced_rank_regression(rk, kk, rank=2, mu=1e-12)
    delta = f.U @ f.V.T
    assert solvers.numerical_rank(f.U, f.V) == 2
    assert torch.allclose(delta, planted, atol=1e-6 * float(planted.abs().max()))
    assert solvers.fit_fraction(f, rk, kk, rr) == pytest.approx(1.0, abs=1e-9)
    assert solvers.fit_fraction(f, rk, kk, rr, strength=0.5) == pytest.approx(0.75, abs=1e-9)


def test_rank_limits_and_beats_truncating_the_full_solution():
    torch.manual_seed(1)
    d_in, d_out, n = 10, 8, 300
    keys = torch.randn(n, d_in, dtype=torch.float64) * torch.logspace(-1, 1, d_in, dtype=torch.float64)
    targets = keys @ torch.randn(d_out, d_in, dtype=torch.float64).T + 0.1 * torch.randn(n, d_out, dtype=torch.float64)
    kk, rk, rr = _moments(keys, targets)
    fits = []
    for rank in (1, 2, 4, 8):
        f = solvers.reduced_rank_regression(rk, kk, rank=rank, mu=1e-12)
        assert solvers.numerical_rank(f.U, f.V) == rank
        fits.append(solvers.fit_fraction(f, rk, kk, rr))
        # the fit fraction is the objective, measured from moments
        assert fits[-1] == pytest.approx(1 - _objective(f.U @ f.V.T, keys, targets) / (rr * n), abs=1e-9)
    assert fits == sorted(fits) and fits[0] < fits[-1]
    # reduced-rank regression weights the truncation by the keys: plain SVD truncation of M is worse
    full = solvers.reduced_rank_regression(rk, kk, rank=d_out, mu=1e-12)
    m = full.U @ full.V.T
    u, s, vh = torch.linalg.svd(m)
    naive = (u[:, :1] * s[:1]) @ vh[:1]
    rrr = solvers.reduced_rank_regression(rk, kk, rank=1, mu=1e-12)
    assert _objective(rrr.U @ rrr.V.T, keys, targets) < _objective(naive, keys, targets)


def test_lambda_protects_preserved_keys():
    torch.manual_seed(2)
    d_in, d_out, n = 6, 5, 200
    keys = torch.randn(n, d_in, dtype=torch.float64)
    targets = keys @ torch.randn(d_out, d_in, dtype=torch.float64).T
    kk, rk, _ = _moments(keys, targets)
    preserved = torch.zeros(d_in, dtype=torch.float64)
    preserved[0] = 1.0
    cp = torch.outer(preserved, preserved)
    moved = []
    for lam in (0.0, 1.0, 100.0):
        f = solvers.reduced_rank_regression(rk, kk, rank=d_out, preserve_moment=cp, lam=lam)
        moved.append(float((f.U @ (f.V.T @ preserved)).norm()))
    assert moved[0] > moved[1] > moved[2] and moved[2] < 0.05 * moved[0]
    with pytest.raises(BlazeError, match="preserved-key"):
        solvers.reduced_rank_regression(rk, kk, rank=1, lam=1.0)


# ----------------------------------------------------------------------------------- teacher answers
class TeacherRuntime(MiniRuntime):
    """The stand-in with a scripted ``generate``: records its calls, answers from ``answers``."""

    def __init__(self, answers: dict[str, tuple[list[int], bool]]):
        super().__init__()
        self.answers, self.calls = answers, []

    def stop_token_ids(self):
        return [2, 1]

    def generate(self, prompts, *, max_new_tokens=128, batch_size=8, system=None):
        self.calls.append((list(prompts), system, max_new_tokens))
        out = []
        for prompt in prompts:
            ids, hit = self.answers[prompt]
            out.append(Generation(text="", prompt_tokens=0, new_tokens=len(ids), token_ids=ids, hit_limit=hit))
        return out


def test_teacher_items_answer_under_the_wanted_system_and_keep_the_stop_token():
    rt = TeacherRuntime({PAIRS[0].prompt: ([40, 41], False), PAIRS[1].prompt: ([50, 51, 52], True)})
    items = teacher_items(rt, [PAIRS[0], PAIRS[1], PAIRS[0], PAIRS[2]], max_new_tokens=7)
    assert rt.calls == [([PAIRS[0].prompt, PAIRS[1].prompt], "brief", 7)]    # deduplicated; PAIRS[2] has no system
    assert items == [DistillItem(PAIRS[0].prompt, "brief", (40, 41, 2)),      # stopped: end-of-turn kept
                     DistillItem(PAIRS[1].prompt, "brief", (50, 51, 52))]     # ran to the limit: nothing added
    with pytest.raises(BlazeError, match="wanted system prompt"):
        teacher_items(rt, [PAIRS[2]], max_new_tokens=7)


# ------------------------------------------------------------------------------------------ collection
@pytest.fixture(scope="module")
def mini():
    return MiniRuntime()


ITEMS = [DistillItem("capital of France?", "be brief", tuple(range(20, 26))),
         DistillItem("two plus two?", "be brief", tuple(range(30, 33))),
         DistillItem("a much longer question about the colour of the sky?", "be brief", tuple(range(40, 50)))]


def test_runs_align_by_offset_from_the_end_of_the_prompt(mini):
    a, b = item_runs(mini, ITEMS[0])
    pa, pb = mini.chat_ids(ITEMS[0].prompt, "be brief"), mini.chat_ids(ITEMS[0].prompt)
    assert len(pa) > len(pb)
    assert a.positions == list(range(len(pa) - 1, len(pa) + 6)) and b.positions == list(range(len(pb) - 1, len(pb) + 6))
    assert a.ids[len(pa):] == b.ids[len(pb):] == list(ITEMS[0].response)
    short_a, short_b = item_runs(mini, ITEMS[0], max_length=len(pa) + 2)   # cut: both runs keep 2 response tokens
    assert len(short_a.positions) == len(short_b.positions) == 3


def _brute_force(mini, items, target):
    """Per item, unbatched: keys of B, outputs of A and B at the aligned positions."""
    module = mini.named_linears()[target]
    seen = {}
    handle = module.register_forward_hook(lambda _m, i, o: seen.update(k=i[0][0].double(), o=o[0].double()))
    keys, diffs = [], []
    with torch.no_grad():
        for item in items:
            a, b = item_runs(mini, item)
            mini.model.model(input_ids=torch.tensor([a.ids]))
            out_a = seen["o"][a.positions]
            mini.model.model(input_ids=torch.tensor([b.ids]))
            keys.append(seen["k"][b.positions])
            diffs.append(out_a - seen["o"][b.positions])
    handle.remove()
    return torch.cat(keys), torch.cat(diffs)


def test_collection_matches_a_brute_force_pass(mini):
    target = "model.layers.2.mlp.down_proj"
    preserve = PreserveSet(texts=["hello there", "a neutral sentence"])
    stats = collect_distill(mini, ITEMS, preserve, [target], batch_size=2, progress=False)
    keys, diffs = _brute_force(mini, ITEMS, target)
    m = stats.keys[target]
    assert m.count == len(keys) == sum(len(i.response) + 1 for i in ITEMS)
    assert torch.allclose(m.key_moment, keys.T @ keys / len(keys), atol=1e-5)
    assert torch.allclose(m.cross_moment, diffs.T @ keys / len(keys), atol=1e-5)
    assert m.target_energy == pytest.approx(float(diffs.pow(2).sum() / len(keys)), rel=1e-5)
    assert float(diffs.abs().max()) > 1e-3         # the system prompt does change the output (not a vacuous test)
    assert m.preserve_moment is not None and m.preserve_count == sum(len(mini.chat_ids(t)) for t in preserve.texts)


def test_save_load_and_cache(mini, tmp_path):
    rt = TeacherRuntime({p.prompt: ([20 + i, 21 + i], False) for i, p in enumerate(PAIRS)})
    cache = tmp_path / "d.pt"
    first = collect_distill_statistics(rt, PAIRS[:2], None, "1-2", "writers", max_new_tokens=4, cache=cache,
                                       progress=False)
    assert cache.exists() and first.meta["layers"] == [1, 2] and len(first.keys) == 4
    again = collect_distill_statistics(rt, PAIRS[:2], None, "1-2", "writers", max_new_tokens=4, cache=cache,
                                       progress=False)
    assert len(rt.calls) == 1                      # the second call read the cache: no new teacher answers
    name = next(iter(first.keys))
    assert torch.equal(again.keys[name].cross_moment, first.keys[name].cross_moment)
    collect_distill_statistics(rt, PAIRS[:2], None, "1-2", "writers", max_new_tokens=5, cache=cache, progress=False)
    assert len(rt.calls) == 2                      # another token limit: other teacher answers
    assert isinstance(DistillStatistics.load(cache), DistillStatistics)


# --------------------------------------------------------------------------------------------- edit
def _last_layer(mini, ids: list[int], positions: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = mini.model.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    return hidden[-1][0, positions].double()


def _residual_gap(mini, items, prompted: list[torch.Tensor]) -> float:
    """Mean squared distance, at the aligned response positions, between the last layer's output in the
    unprompted run of the (possibly edited) model and ``prompted``, the unedited model's prompted run."""
    gap, count = 0.0, 0
    for item, target in zip(items, prompted, strict=True):
        _, b = item_runs(mini, item)
        gap += float((_last_layer(mini, b.ids, b.positions) - target).pow(2).sum())
        count += len(b.positions)
    return gap / count


def test_full_rank_edit_moves_the_unprompted_run_toward_the_prompted_one(mini):
    stats = collect_distill(mini, ITEMS, None, WRITERS, batch_size=3, progress=False)
    prompted = [_last_layer(mini, a.ids, a.positions) for a, _ in (item_runs(mini, i) for i in ITEMS)]
    before = _residual_gap(mini, ITEMS, prompted)
    patch = solve(stats, SolveSettings(method="distill", strength=1.0, rank=32, lam=0.0, mu=1e-6))
    assert all(i["fit"] > 0.99 for i in patch.metadata["targets"].values())   # full rank: each writer fits
    with patch.applied(mini):
        after = _residual_gap(mini, ITEMS, prompted)
    half = solve(stats, SolveSettings(method="distill", strength=0.5, rank=32, lam=0.0, mu=1e-6))
    with half.applied(mini):
        middle = _residual_gap(mini, ITEMS, prompted)
    assert after < middle < before and after < 0.5 * before
    assert _residual_gap(mini, ITEMS, prompted) == pytest.approx(before)      # the weights were restored


def test_methods_need_their_own_statistics(mini):
    stats = collect_distill(mini, ITEMS[:1], None, WRITERS[:1], progress=False)
    with pytest.raises(BlazeError, match="needs steer/nullspace statistics"):
        solve_factors(stats, "steer")
    zero = solve_factors(stats, "distill", strength=0.0, rank=2, lam=0.0)
    assert float(zero.factors[WRITERS[0]].V.abs().max()) == 0.0


# ---------------------------------------------------------------------------------------- blaze edit
def test_spec_and_search_know_distill():
    from variants.build import DISTILL_LAMBDA_FACTOR, DISTILL_START, alternatives
    from variants.spec import EditSettings

    assert EditSettings(method="distill").method == "distill"
    steer = alternatives(EditSettings(positions="shared_response", lam=2.0))
    assert steer[0] == ("distill", {"method": "distill", "strength": DISTILL_START,
                                    "lam": 2.0 * DISTILL_LAMBDA_FACTOR})   # the first alternative
    assert not any(name == "distill" for name, _ in alternatives(EditSettings(positions="response")))
    assert not any(name == "distill" for name, _ in alternatives(EditSettings(method="distill",
                                                                              positions="shared_response")))


def test_blaze_edit_with_distill_writes_a_variant_and_reuses_its_statistics(tiny_release, tmp_path):
    import json

    import faults_support

    from surgery.manifest import read_manifest
    from variants.build import BuildOptions, build_variant

    spec_path = faults_support.small_spec(tmp_path, method="distill", strength=1.0, rank=2)
    spec = json.loads(spec_path.read_text())
    spec["directions"][0].update(wanted_system="Answer in one word.", unwanted_system="Answer at length.")
    spec_path.write_text(json.dumps(spec))
    lines: list[str] = []
    for i in range(2):
        build_variant(BuildOptions(behavior=str(spec_path), out=tmp_path / f"v{i}", base=str(tiny_release),
                                   device="cpu", canary=False, cache_dir=tmp_path / "cache", progress=False),
                      echo=lines.append)
    assert sum("generating the teacher's answers" in line for line in lines) == 1    # the second run reused them
    assert any("statistics: reusing" in line for line in lines)
    manifest = read_manifest(tmp_path / "v1")
    assert manifest.edit.method == "distill" and manifest.edit.rank == 2
    assert manifest.edit.extra["statistics"]["n_items"] == len(faults_support.PAIRS)
