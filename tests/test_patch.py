"""surgery.patch: the delta file, scaling, rank facts, in-memory toggling, base identity."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from clef_model.checkpoint import CheckpointReader, ShardedWriter, save_tensors
from clef_model.errors import BlazeError
from surgery.patch import PATCH_FILE, Patch, base_identity, identity_mismatches


def _factors(seed=0, k=2):
    gen = torch.Generator().manual_seed(seed)
    return {
        "model.layers.0.mlp.down_proj": (torch.randn(6, k, generator=gen), torch.randn(10, k, generator=gen)),
        "model.layers.1.self_attn.o_proj": (torch.randn(6, 1, generator=gen), torch.randn(6, 1, generator=gen)),
    }


def test_save_load_roundtrip_is_exact(tmp_path):
    patch = Patch(_factors(), {"ref": "x", "index_sha256": "ab"}, {"method": "steer", "alpha": 0.15, "k": 2})
    patch.save(tmp_path / PATCH_FILE)
    loaded = Patch.load(tmp_path)  # a folder holding the file works too
    assert loaded.names() == patch.names()
    for name in patch.names():
        for a, b in zip(loaded.factors[name], patch.factors[name], strict=True):
            assert a.dtype == torch.float32 and torch.equal(a, b)
    assert loaded.base_identity == patch.base_identity and loaded.metadata == patch.metadata
    reader = CheckpointReader(tmp_path / PATCH_FILE)
    assert set(reader.names()) == {f"{n}.{p}" for n in patch.names() for p in "UV"}
    assert all(reader.dtype(n) == "F32" for n in reader.names())
    # deterministic bytes
    patch.save(tmp_path / "again.safetensors")
    assert (tmp_path / "again.safetensors").read_bytes() == (tmp_path / PATCH_FILE).read_bytes()


def test_rank_norm_and_scaling_facts():
    patch = Patch(_factors(k=3))
    name = "model.layers.0.mlp.down_proj"
    delta = patch.delta(name)
    assert delta.shape == (6, 10)
    assert patch.numerical_rank(name) == 3 == torch.linalg.matrix_rank(delta)
    assert patch.delta_norm(name) == pytest.approx(float(delta.norm()), rel=1e-5)
    assert torch.allclose(patch.delta_singular_values(name), torch.linalg.svdvals(delta.double())[:3], rtol=1e-6)
    half = patch.scaled(0.5)
    assert torch.allclose(half.delta(name), 0.5 * delta) and half.metadata["scale"] == 0.5
    assert torch.equal(patch.delta(name), delta)  # the original is untouched
    u, v = patch.factors[name]
    dependent = Patch({name: (torch.cat([u[:, :1], 2 * u[:, :1]], 1), torch.cat([v[:, :1], v[:, :1]], 1))})
    assert dependent.numerical_rank(name) == 1


def test_bad_factors_and_files_are_clear_errors(tmp_path):
    with pytest.raises(BlazeError, match="same k"):
        Patch({"a": (torch.zeros(3, 2), torch.zeros(4, 1))})
    save_tensors(tmp_path / "other.safetensors", {"a": torch.zeros(2)})
    with pytest.raises(BlazeError, match="not a blaze patch"):
        Patch.load(tmp_path / "other.safetensors")
    with pytest.raises(BlazeError, match="no such patch"):
        Patch.load(tmp_path / "missing.safetensors")
    save_tensors(tmp_path / "half.safetensors", {"a.U": torch.zeros(2, 1)}, {"blaze_format": "blaze-delta/1"})
    with pytest.raises(BlazeError, match="only one of its two factors"):
        Patch.load(tmp_path / "half.safetensors")


class _Runtime:
    def __init__(self, dtype):
        torch.manual_seed(0)
        self.model = torch.nn.ModuleDict({
            "down": torch.nn.Linear(10, 6, bias=False).to(dtype),
            "o": torch.nn.Linear(6, 6, bias=False).to(dtype),
        })

    def named_linears(self):
        return {"model.layers.0.mlp.down_proj": self.model["down"], "model.layers.1.self_attn.o_proj": self.model["o"]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_applied_adds_delta_and_restores_exactly(dtype):
    runtime = _Runtime(dtype)
    patch = Patch(_factors())
    before = {n: m.weight.detach().clone() for n, m in runtime.named_linears().items()}
    x = torch.randn(3, 10).to(dtype)
    with patch.applied(runtime, scale=0.3):
        for name, module in runtime.named_linears().items():
            expected = (before[name].float() + 0.3 * patch.delta(name)).to(dtype)
            torch.testing.assert_close(module.weight.detach(), expected)
        edited_out = runtime.model["down"](x)
    for name, module in runtime.named_linears().items():
        assert torch.equal(module.weight, before[name])
    assert not torch.equal(edited_out, runtime.model["down"](x))

    with pytest.raises(RuntimeError):  # restored on error too
        with patch.applied(runtime):
            raise RuntimeError("canary crashed")
    assert all(torch.equal(m.weight, before[n]) for n, m in runtime.named_linears().items())

    wrong = Patch({"model.layers.9.mlp.down_proj": (torch.zeros(6, 1), torch.zeros(10, 1))})
    with pytest.raises(BlazeError, match="no linear layer"):
        with wrong.applied(runtime):
            pass


def _checkpoint(folder, seed=0):
    gen = torch.Generator().manual_seed(seed)
    writer = ShardedWriter(folder)
    writer.add_tensor("model.layers.0.mlp.down_proj.weight", torch.randn(6, 10, generator=gen).bfloat16())
    writer.add_tensor("model.layers.1.self_attn.o_proj.weight", torch.randn(6, 6, generator=gen).bfloat16())
    writer.add_tensor("model.norm.weight", torch.zeros(6, dtype=torch.int32))
    writer.close()
    return SimpleNamespace(path=folder, ref=str(folder), revision=None)


def test_fit_checks_and_base_identity(tmp_path):
    base = _checkpoint(tmp_path / "base")
    reader = CheckpointReader(base.path)
    patch = Patch(_factors())
    assert patch.problems_with(reader) == []
    bad = Patch({
        "model.layers.0.mlp.down_proj": (torch.zeros(6, 1), torch.zeros(9, 1)),
        "model.layers.7.mlp.down_proj": (torch.zeros(6, 1), torch.zeros(10, 1)),
        "model.norm": (torch.zeros(6, 1), torch.zeros(1, 1)),
    })
    problems = bad.problems_with(reader)
    assert len(problems) == 3
    with pytest.raises(BlazeError, match="does not fit"):
        bad.check_fits(reader)

    identity = base_identity(base, patch.names())
    assert set(identity["tensor_sha256"]) == set(patch.names())
    patch.base_identity = identity
    assert identity_mismatches(patch, base) == []
    other = _checkpoint(tmp_path / "other", seed=1)
    mismatches = identity_mismatches(patch, other)
    assert any("different values" in m for m in mismatches)
    assert identity_mismatches(Patch(_factors()), other) == []  # nothing recorded: nothing to compare
