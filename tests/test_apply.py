"""surgery.write.write_variant and `blaze apply`: a drop-in, deterministic, streaming variant; bad input fails clean."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from clef_model.checkpoint import INDEX_NAME, CheckpointReader, sha256_file
from clef_model.errors import BlazeError, ReleaseError
from clef_model.release import resolve_release
from surgery.manifest import MANIFEST_FILE, read_manifest, verify_manifest
from surgery.patch import PATCH_FILE, Patch, base_identity
from surgery.write import write_variant
from variants.cli import main

K = 2
LAYERS = (1, 2, 3)


def _targets(reader: CheckpointReader) -> list[str]:
    suffixes = ("mlp.down_proj.weight", "self_attn.o_proj.weight", "linear_attn.out_proj.weight")
    names = []
    for layer in LAYERS:
        prefix = f"model.language_model.layers.{layer}."
        names += [n[: -len(".weight")] for n in reader.names() if n.startswith(prefix) and n.endswith(suffixes)]
    return sorted(names)


def _patch(release, strength: float = 0.05, record_base: bool = True) -> Patch:
    """Random rank-K deltas on the residual writers of LAYERS, ‖ΔW‖ ≈ strength·‖W‖."""
    reader = CheckpointReader(release.path)
    gen = torch.Generator().manual_seed(1)
    factors = {}
    for name in _targets(reader):
        weight = reader.tensor(f"{name}.weight").float()
        u = torch.randn(weight.shape[0], K, generator=gen)
        v = torch.randn(weight.shape[1], K, generator=gen)
        scale = strength * float(weight.norm()) / float((u @ v.T).norm())
        factors[name] = (u * scale, v)
    identity = base_identity(release, list(factors)) if record_base else None
    return Patch(factors, identity, {"method": "random-test", "k": K})


def _hashes(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def _siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir())


@pytest.fixture(scope="module")
def base(tiny_release):
    return resolve_release(tiny_release)


@pytest.fixture(scope="module")
def variant(base, tmp_path_factory):
    before = _hashes(base.path)
    out = tmp_path_factory.mktemp("variant") / "v"
    patch = _patch(base)
    write_variant(base, patch, out, manifest_extra={"behavior_spec_sha256": "abc", "alpha": 0.05}, progress=False)
    assert _hashes(base.path) == before, "the base was modified"
    return out, patch


def test_side_files_and_untargeted_tensors_are_identical(base, variant):
    out, patch = variant
    for name in base.side_files():
        assert (out / name).read_bytes() == (base.path / name).read_bytes(), name
    assert (out / "joint_head.safetensors").read_bytes() == (base.path / "joint_head.safetensors").read_bytes()
    old, new = CheckpointReader(base.path), CheckpointReader(out)
    assert set(new.names()) == set(old.names())  # nothing dropped: mtp.* and model.visual.* kept
    assert any(n.startswith("mtp.") for n in new.names()) and any(n.startswith("model.visual.") for n in new.names())
    edited = {f"{n}.weight" for n in patch.names()}
    assert len(edited) == 2 * len(LAYERS)  # one attention writer (out_proj or o_proj) + down_proj per layer
    for name in old.names():
        assert new.dtype(name) == old.dtype(name) and new.shape(name) == old.shape(name)
        if name not in edited:
            assert new.raw_bytes(name) == old.raw_bytes(name), name
        else:
            assert new.raw_bytes(name) != old.raw_bytes(name), name
    for path in out.iterdir():
        assert path.stat().st_mode & 0o777 == 0o644


def test_edited_tensors_carry_the_low_rank_delta(base, variant):
    out, patch = variant
    old, new = CheckpointReader(base.path), CheckpointReader(out)
    for name in patch.names():
        w_old = old.tensor(f"{name}.weight").float()
        w_new = new.tensor(f"{name}.weight")
        realized = w_new.float() - w_old
        # bf16 rounding bound of the result, per entry half an ulp; its Frobenius norm bounds the noise
        exponent = torch.frexp(w_new.float()).exponent.float()
        half_ulp = torch.exp2(exponent - 9)
        noise = float(half_ulp.norm()) * 1.01 + 1e-6
        assert float((realized - patch.delta(name)).norm()) <= noise
        values = torch.linalg.svdvals(realized.double())
        assert int((values > noise).sum()) <= K, name  # numerical rank ≤ k above rounding level
        assert float(values[0]) > 10 * noise


def test_manifest_records_inputs_outputs_and_matrices(base, variant):
    out, patch = variant
    manifest = read_manifest(out).to_dict()
    assert verify_manifest(out) == []
    assert manifest["edit"] == {"behavior_spec_sha256": "abc", "alpha": 0.05}
    assert manifest["patch"]["metadata"] == patch.metadata
    assert manifest["base"]["files"] == {n: h for n, h in _hashes(base.path).items()}
    assert manifest["base"]["tensor_sha256"] == patch.base_identity["tensor_sha256"]
    assert manifest["base"]["index_sha256"] == patch.base_identity["index_sha256"]
    assert set(manifest["output"]["files"]) == set(_hashes(out)) - {MANIFEST_FILE}
    assert manifest["versions"]["torch"] == torch.__version__.split("+")[0]
    assert manifest["edited_tensors"] == [f"{n}.weight" for n in patch.names()]
    for facts in manifest["matrices"].values():
        assert facts["k"] == K and facts["numerical_rank"] <= K
        assert facts["relative_change"] == pytest.approx(0.05, rel=1e-3)
        assert facts["realized_relative_change"] == pytest.approx(0.05, rel=0.05)
    assert Patch.load(out).names() == patch.names()


def test_variant_loads_with_the_release_loader(base, variant):
    from clef_model.trust import import_release_code_file, vendored_release_code

    out, patch = variant
    release_code = import_release_code_file(vendored_release_code())
    model, processor = release_code.load_release_model(out, device="cpu", dtype=torch.float32)
    params = dict(model.backbone.named_parameters()) if hasattr(model, "backbone") else dict(model.named_parameters())
    reader = CheckpointReader(out)
    name = patch.names()[0]
    loaded = next(p for n, p in params.items() if n.endswith(name.split("model.", 1)[1] + ".weight"))
    assert torch.equal(loaded.detach(), reader.tensor(f"{name}.weight").float())
    assert processor is not None


def test_two_runs_and_apply_give_identical_folders(base, variant, tmp_path):
    out, patch = variant
    again = write_variant(base, Patch.load(out), tmp_path / "again", progress=False,
                          manifest_extra={"behavior_spec_sha256": "abc", "alpha": 0.05})
    assert _hashes(again) == _hashes(out)

    result = CliRunner().invoke(main, ["apply", str(out / PATCH_FILE), "--base", str(base.path),
                                       "--out", str(tmp_path / "applied")])
    assert result.exit_code == 0, result.output
    applied, original = _hashes(tmp_path / "applied"), _hashes(out)
    assert {n: h for n, h in applied.items() if n != MANIFEST_FILE} == \
        {n: h for n, h in original.items() if n != MANIFEST_FILE}
    assert f"{len(patch.names())} matrices edited" in result.output


def test_small_shard_budget_splits_and_keeps_every_tensor(base, variant, tmp_path):
    out, patch = variant
    small = write_variant(base, patch, tmp_path / "small", max_shard_bytes=100_000, progress=False)
    index = json.loads((small / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > len(set(json.loads((out / INDEX_NAME).read_text())["weight_map"].values()))
    a, b = CheckpointReader(out), CheckpointReader(small)
    assert all(a.raw_bytes(n) == b.raw_bytes(n) for n in a.names())
    assert index["metadata"]["total_size"] == a.total_bytes()


# -- bad input: clear error, no partial output, base untouched ---------------------------------------------


def test_patch_that_does_not_fit_is_refused_before_writing(base, tmp_path):
    name = "model.language_model.layers.1.mlp.down_proj"
    wrong_shape = Patch({name: (torch.ones(5, 1), torch.ones(7, 1))})
    missing = Patch({"model.language_model.layers.99.mlp.down_proj": (torch.ones(4, 1), torch.ones(4, 1))})
    for patch, match in ((wrong_shape, "U·Vᵀ is"), (missing, "not in the base")):
        with pytest.raises(BlazeError, match=match):
            write_variant(base, patch, tmp_path / "out", progress=False)
        assert _siblings(tmp_path / "out") == []


def test_corrupt_shard_is_a_clear_error(base, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(base.path, broken)
    shard = sorted(broken.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    release = dataclasses.replace(base, path=broken, ref=str(broken))
    before = _hashes(broken)
    with pytest.raises(ReleaseError, match="truncated"):
        write_variant(release, _patch(base), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and _hashes(broken) == before
    assert _siblings(tmp_path / "out") == ["broken"]
    shard.write_bytes(b"\xff" * 64)
    with pytest.raises(ReleaseError, match="not a valid safetensors"):
        write_variant(release, _patch(base), tmp_path / "out", progress=False)


def test_full_disk_mid_write_leaves_nothing(base, tmp_path, monkeypatch):
    from clef_model import checkpoint
    from surgery import write

    calls = {"n": 0}
    real_copy = checkpoint.copy_range

    def failing_copy(*args):  # the writer's raw copy hits a full disk part-way through the checkpoint
        calls["n"] += 1
        if calls["n"] == 60:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_copy(*args)

    monkeypatch.setattr(checkpoint, "copy_range", failing_copy)
    monkeypatch.setattr(write, "copy_range", failing_copy)
    before = _hashes(base.path)
    with pytest.raises(BlazeError, match="no space left"):
        write_variant(base, _patch(base), tmp_path / "out", progress=False)
    assert calls["n"] == 60
    assert _siblings(tmp_path / "out") == [] and _hashes(base.path) == before


def test_output_folder_rules(base, variant, tmp_path):
    out, patch = variant
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(BlazeError, match="not empty"):
        write_variant(base, patch, tmp_path / "busy", progress=False)
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    # --force replaces only blaze's own outputs: this folder keeps its file
    with pytest.raises(BlazeError, match="not written by blaze"):
        write_variant(base, patch, tmp_path / "busy", force=True, progress=False)
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    shutil.copytree(out, tmp_path / "earlier")  # an earlier variant (it has a blaze_manifest.json)
    (tmp_path / "earlier" / "stale.txt").write_text("old")
    write_variant(base, patch, tmp_path / "earlier", force=True, progress=False)
    assert not (tmp_path / "earlier" / "stale.txt").exists() and verify_manifest(tmp_path / "earlier") == []
    for bad in (base.path, base.path / "sub"):
        with pytest.raises(BlazeError, match="overlaps the base"):
            write_variant(base, patch, bad, force=True, progress=False)


def test_cli_apply_checks_base_identity(base, variant, tmp_path):
    out, patch = variant
    other = tmp_path / "other"
    shutil.copytree(base.path, other)
    reader = CheckpointReader(other)
    name = f"{patch.names()[0]}.weight"
    info = reader.info(name)
    with open(info.file, "r+b") as handle:  # flip one stored value of an edited tensor
        handle.seek(info.offset)
        byte = handle.read(1)
        handle.seek(info.offset)
        handle.write(bytes([byte[0] ^ 0x01]))
    runner = CliRunner()
    result = runner.invoke(main, ["apply", str(out / PATCH_FILE), "--base", str(other), "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "different values" in result.output and "--force" in result.output
    assert f"{name} has different values" in result.output and "weight.weight" not in result.output
    assert not (tmp_path / "x").exists()
    result = runner.invoke(main, ["apply", str(out / PATCH_FILE), "--base", str(other), "--out", str(tmp_path / "x"),
                                  "--force"])
    assert result.exit_code == 0, result.output
    assert "different base" in result.output and f"{patch.names()[0]}.weight" in result.output

    anonymous = tmp_path / "anon.safetensors"
    Patch(patch.factors, None, {}).save(anonymous)
    result = runner.invoke(main, ["apply", str(anonymous), "--base", str(base.path), "--out", str(tmp_path / "y")])
    assert result.exit_code == 0 and "no base identity" in result.output

    result = runner.invoke(main, ["apply", str(anonymous), "--base", str(base.path), "--out", str(tmp_path / "y")])
    assert result.exit_code == 2 and "not empty" in result.output


def test_extra_files_are_written_and_listed(base, variant, tmp_path):
    out, patch = variant
    report = b'{"gate": {"passed": true}}'
    written = write_variant(base, patch, tmp_path / "with", progress=False,
                            extra_files={"blaze_canary.json": report})
    assert (written / "blaze_canary.json").read_bytes() == report
    assert verify_manifest(written) == []
    for bad in ("LICENSE", "model-00001-of-00001.safetensors", "blaze_manifest.json", "../escape.txt"):
        with pytest.raises(BlazeError, match="would clash"):
            write_variant(base, patch, tmp_path / "bad", progress=False, extra_files={bad: b"x"})
        assert _siblings(tmp_path / "bad") == ["with"]


# -- one writer for `blaze edit` and `blaze apply`; no torch in apply; known hashes are not recomputed ----


def _float32_base(base, folder: Path):
    """A copy of the tiny base whose BF16 tensors are stored as F32 (same names, shards and side files)."""
    import numpy as np

    from clef_model.checkpoint import load_arrays, save_tensors

    shutil.copytree(base.path, folder)
    for shard in sorted(folder.glob("model-*.safetensors")):
        arrays, metadata = load_arrays(shard)
        arrays = {n: a.astype(np.float32) if a.dtype.name == "bfloat16" else a for n, a in arrays.items()}
        save_tensors(shard, arrays, metadata)
    index = json.loads((folder / INDEX_NAME).read_text())
    index["metadata"]["total_size"] = CheckpointReader(folder).total_bytes()
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2))
    return resolve_release(folder)


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_edit_writer_and_apply_agree_byte_for_byte(base, tmp_path, dtype):
    """The edit's write step (a torch Patch through write_variant) and `blaze apply` of the patch file it
    wrote (torch-free) give identical files, for a rank-2 patch on bf16 and float32 bases."""
    release = base if dtype == "BF16" else _float32_base(base, tmp_path / "f32")
    patch = _patch(release)
    assert CheckpointReader(release.path).dtype(f"{patch.names()[0]}.weight") == dtype
    edited = write_variant(release, patch, tmp_path / "edit", progress=False)
    result = CliRunner().invoke(main, ["apply", str(edited / PATCH_FILE), "--base", str(release.path),
                                       "--out", str(tmp_path / "applied")])
    assert result.exit_code == 0, result.output
    ours, theirs = _hashes(edited), _hashes(tmp_path / "applied")
    assert set(ours) == set(theirs)
    for name in ours:
        if name != MANIFEST_FILE:
            assert (edited / name).read_bytes() == (tmp_path / "applied" / name).read_bytes(), name
    # and the values are W + U Vᵀ rounded once to the stored dtype (float64 reference)
    old, new = CheckpointReader(release.path), CheckpointReader(edited)
    for name in patch.names():
        w = old.tensor(f"{name}.weight").double()
        expected = w + patch.delta(name).double()
        got = new.tensor(f"{name}.weight").double()
        eps = torch.finfo(torch.bfloat16 if dtype == "BF16" else torch.float32).eps
        assert float((got - expected).abs().max()) <= eps * float(expected.abs().max())


def test_block_update_is_addmm_for_rank_one_and_reproducible():
    """k = 1 matches torch's addmm + cast bit for bit; any k gives the same bytes for any row blocking."""
    import ml_dtypes
    import numpy as np

    from surgery.delta import RowBlockUpdate

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(37, 50, generator=gen).bfloat16()
    for k in (1, 3):
        u, v = torch.randn(37, k, generator=gen) * 0.05, torch.randn(50, k, generator=gen)
        stored = w.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        whole = RowBlockUpdate(u.numpy(), v.numpy(), "BF16").apply(stored, 0)[0]
        update = RowBlockUpdate(u.numpy(), v.numpy(), "BF16")
        blocks = np.concatenate([update.apply(stored[i : i + 8], i)[0] for i in range(0, 37, 8)])
        assert blocks.tobytes() == whole.tobytes()
        assert update.change_sq > 0 and update.weight_sq == pytest.approx(float(w.float().norm()) ** 2, rel=1e-5)
        if k == 1:
            reference = torch.addmm(w.float(), u, v.T).bfloat16()
            assert whole.tobytes() == reference.view(torch.int16).numpy().tobytes()


def test_apply_runs_without_torch(base, variant, tmp_path):
    """`blaze apply` in a fresh interpreter never imports torch (its CUDA build alone is ≈ 700 MiB)."""
    import subprocess
    import sys

    out, _patch_unused = variant
    root = Path(__file__).resolve().parents[1]
    code = (
        "import json, sys\n"
        "from variants.cli import main\n"
        f"main.main(args=['apply', {str(out / PATCH_FILE)!r}, '--base', {str(base.path)!r}, "
        f"'--out', {str(tmp_path / 'applied')!r}], standalone_mode=False)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(root), BLAZE_QUIET="1", BLAZE_HASH_CACHE="0")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
    assert verify_manifest(tmp_path / "applied") == []


class _HashSpy:
    """Counts whole-file hashes and streaming hashers of surgery.write (to see what a run re-hashes)."""

    def __init__(self, monkeypatch):
        from surgery import write

        self.files: list[Path] = []  # every file hashed whole, as passed
        self.streams = 0
        real_file, real_stream = write.sha256_file, write._AsyncSha256

        def spy_file(path):
            self.files.append(Path(path))
            return real_file(path)

        spy = self

        class SpyStream(real_stream):
            def __init__(self):
                spy.streams += 1
                super().__init__()

        monkeypatch.setattr(write, "sha256_file", spy_file)
        monkeypatch.setattr(write, "_AsyncSha256", SpyStream)


def _aged_copy(base, folder: Path):
    """A copy of the base whose files are a minute old (hash-cache entries for them are not 'racy')."""
    import time

    shutil.copytree(base.path, folder)
    past = time.time_ns() - 60 * 10**9
    for path in folder.rglob("*"):
        os.utime(path, ns=(past, past))
    return dataclasses.replace(base, path=folder, ref=str(folder))


def test_hash_cache_spares_rehashing_the_inputs(base, variant, tmp_path, monkeypatch):
    from clef_model import filehash

    monkeypatch.setenv("BLAZE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("BLAZE_HASH_CACHE", "1")
    _out, patch = variant
    local = _aged_copy(base, tmp_path / "base")
    shards = {p.name for p in CheckpointReader(local.path).shard_files()}
    first_spy = _HashSpy(monkeypatch)
    first = write_variant(local, patch, tmp_path / "one", progress=False)
    written = len(CheckpointReader(first).shard_files())
    edited = len(patch.names())  # each edited tensor's stored bytes are hashed on a stream for the manifest
    reader = CheckpointReader(local.path)
    touched = {reader.info(f"{n}.weight").file.name for n in patch.names()}
    assert written == len(shards) and 0 < len(touched) < len(shards)  # the layout is kept
    # every output shard, plus the inputs of shards with edits (an untouched shard's bytes are its input's)
    assert first_spy.streams == written + len(touched) + edited
    for name in local.side_files():
        assert filehash.known_sha256(local.path / name) == sha256_file(local.path / name)
    cached = json.loads(filehash.cache_path().read_text())["files"]
    assert all(str((first / name).resolve()) in cached for name in read_manifest(first).output.files)

    second_spy = _HashSpy(monkeypatch)
    second = write_variant(local, patch, tmp_path / "two", progress=False)
    # shards with edits only (and the edited tensors): the others are copies of inputs whose hash is known
    assert second_spy.streams == len(touched) + edited
    assert first_spy.files and not [p for p in second_spy.files if p.is_relative_to(local.path)]
    assert read_manifest(second).base.files == read_manifest(first).base.files == _hashes(local.path)
    assert _hashes(second) == _hashes(first)

    monkeypatch.setenv("BLAZE_HASH_CACHE", "0")  # switched off: everything is hashed again
    off_spy = _HashSpy(monkeypatch)
    write_variant(local, patch, tmp_path / "three", progress=False)
    assert off_spy.streams == written + len(touched) + edited


def _hub_snapshot(folder: Path, repo: Path) -> tuple[Path, set[str]]:
    """A Hugging Face cache layout of `folder` under `repo`: LFS blobs named by SHA-256, others by git SHA-1."""
    snapshot = repo / "snapshots" / ("c" * 40)
    (repo / "blobs").mkdir(parents=True)
    lfs = set()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = path.relative_to(folder)
        if path.suffix == ".safetensors":
            blob = repo / "blobs" / sha256_file(path)
            lfs.add(relative.as_posix())
        else:
            blob = repo / "blobs" / hashlib.sha1(b"blob %d\0" % path.stat().st_size + path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        (snapshot / relative).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / relative).symlink_to(os.path.relpath(blob, (snapshot / relative).parent))
    return snapshot, lfs


def test_hub_cache_blob_names_are_used_as_hashes(base, variant, tmp_path, monkeypatch):
    """A base inside a Hugging Face cache: LFS blobs (64-hex names) are not read for hashing; the rest is."""
    monkeypatch.setenv("BLAZE_HASH_CACHE", "0")
    _out, patch = variant
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, lfs = _hub_snapshot(base.path, repo)
    release = resolve_release(snapshot)
    spy = _HashSpy(monkeypatch)
    out = write_variant(release, patch, tmp_path / "out", progress=False)
    # output shards with edits (and the edited tensors) only: inputs are named by their hash, and a shard
    # without edits is a copy of its input
    reader = CheckpointReader(base.path)
    touched = {reader.info(f"{n}.weight").file.name for n in patch.names()}
    assert 0 < len(touched) < len(CheckpointReader(out).shard_files())
    assert spy.streams == len(touched) + len(patch.names())
    # of the inputs, only the small (git SHA-1 named) index is hashed; side files are hashed from their copies
    assert [p for p in spy.files if p.resolve().is_relative_to(repo)] == [snapshot / INDEX_NAME]
    assert lfs and not [p for p in spy.files if p.name in lfs]
    assert read_manifest(out).base.files == _hashes(base.path)
    assert verify_manifest(out) == []


def test_kept_layout_changes_only_the_edited_bytes(base, variant, tmp_path):
    """The variant keeps the base's shards: same names and headers, other bytes equal outside edited tensors."""
    from safetensors.torch import load_file, save_file

    _out, patch = variant
    local = tmp_path / "base"
    shutil.copytree(base.path, local)
    reader = CheckpointReader(local)
    for shard in reader.shard_files():  # headers blaze would not write itself: other metadata, library order
        save_file(load_file(shard), shard, metadata={"format": "pt", "written_by": "another tool"})
    out = write_variant(resolve_release(local), patch, tmp_path / "out", progress=False)
    edited = {f"{n}.weight" for n in patch.names()}
    reader = CheckpointReader(local)
    for shard in reader.shard_files():
        before, after = shard.read_bytes(), (out / shard.name).read_bytes()
        assert len(before) == len(after)
        header = reader.info(min(reader.names(), key=lambda n: (reader.info(n).file != shard, reader.info(n).offset)))
        assert after[: header.offset] == before[: header.offset]  # header byte for byte, metadata included
        changed = [reader.info(n) for n in reader.names() if reader.info(n).file == shard and n in edited]
        if not changed:
            assert after == before
        position = 0
        for info in sorted(changed, key=lambda i: i.offset):  # outside the edited tensors nothing moved
            assert after[position : info.offset] == before[position : info.offset]
            assert after[info.offset : info.offset + info.nbytes] != before[info.offset : info.offset + info.nbytes]
            position = info.offset + info.nbytes
        assert after[position:] == before[position:]
    assert verify_manifest(out) == []
    assert json.loads((out / INDEX_NAME).read_text())["weight_map"] == reader.weight_map()


def test_apply_trusts_recorded_shard_hashes_of_a_hub_base(base, tmp_path, monkeypatch):
    """A patch made on a Hub base records its shards' hashes; applying it to the same Hub base then hashes no
    edited tensor, while a base whose shard differs is still verified tensor by tensor (and refused)."""
    monkeypatch.setenv("BLAZE_HASH_CACHE", "0")
    snapshot, _ = _hub_snapshot(base.path, tmp_path / "hub" / "models--org--tiny")
    release = resolve_release(snapshot)
    patch = _patch(release)
    reader = CheckpointReader(snapshot)
    touched = {reader.info(f"{n}.weight").file.name for n in patch.names()}
    assert set(patch.base_identity["shard_sha256"]) == touched
    patch_file = tmp_path / "patch.safetensors"
    patch.save(patch_file)
    runner = CliRunner()
    spy = _HashSpy(monkeypatch)
    result = runner.invoke(main, ["apply", str(patch_file), "--base", str(snapshot), "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert spy.streams == len(touched)  # the output shards with edits only: no edited tensor was hashed
    assert read_manifest(tmp_path / "a").base.tensor_sha256 == patch.base_identity["tensor_sha256"]
    assert verify_manifest(tmp_path / "a") == []

    other, _ = _hub_snapshot(base.path, tmp_path / "hub2" / "models--org--tiny")
    name = f"{patch.names()[0]}.weight"
    info = CheckpointReader(other).info(name)
    blob = info.file.resolve()
    data = bytearray(blob.read_bytes())
    data[info.offset] ^= 0x01  # one stored value of an edited tensor; the blob is renamed to its new hash
    renamed = blob.with_name(hashlib.sha256(data).hexdigest())
    renamed.write_bytes(data)
    blob.unlink()
    link = other / info.file.name
    link.unlink()
    link.symlink_to(os.path.relpath(renamed, link.parent))
    spy = _HashSpy(monkeypatch)
    result = runner.invoke(main, ["apply", str(patch_file), "--base", str(other), "--out", str(tmp_path / "b")])
    assert result.exit_code == 2 and "different values" in result.output
    assert not (tmp_path / "b").exists()


def test_patch_editing_tensors_its_identity_does_not_list_is_refused(base, tmp_path):
    """A patch whose recorded base identity covers some tensors, with an extra edit (embed-like) smuggled in:
    nothing would check that tensor's base values, so apply refuses it and names the tensor."""
    patch = _patch(base)
    reader = CheckpointReader(base.path)
    extra = next(n[: -len(".weight")] for n in reader.names() if "embed_tokens" in n)
    rows, cols = reader.shape(f"{extra}.weight")
    patch.factors[extra] = (torch.zeros(rows, 1), torch.zeros(cols, 1))
    patch.save(tmp_path / "smuggled.safetensors")
    result = CliRunner().invoke(main, ["apply", str(tmp_path / "smuggled.safetensors"), "--base", str(base.path),
                                       "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "does not list" in result.output and f"{extra}.weight" in result.output
    assert not (tmp_path / "out").exists()


def test_nan_patch_factor_is_blamed_on_the_patch(base, tmp_path):
    patch = _patch(base)
    name = patch.names()[0]
    u, v = patch.factors[name]
    u = u.clone()
    u[0, 0] = float("nan")
    patch.factors[name] = (u, v)
    patch.save(tmp_path / "nan.safetensors")
    result = CliRunner().invoke(main, ["apply", str(tmp_path / "nan.safetensors"), "--base", str(base.path),
                                       "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "the patch" in result.output and f"{name}.U holds NaN" in result.output
    assert "base was not the problem" in result.output and not (tmp_path / "out").exists()


def test_matrix_names_with_weight_suffix_are_refused_clearly(base, tmp_path):
    from clef_model.checkpoint import save_tensors
    from surgery.delta import PATCH_FORMAT

    name = _patch(base).names()[0]

    save_tensors(tmp_path / "suffixed.safetensors", {f"{name}.weight.U": torch.zeros(4, 1),
                                                     f"{name}.weight.V": torch.zeros(4, 1)},
                 {"blaze_format": PATCH_FORMAT})
    result = CliRunner().invoke(main, ["apply", str(tmp_path / "suffixed.safetensors"), "--base", str(base.path),
                                       "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "`.weight` suffix" in result.output
    assert "weight.weight" not in result.output


def test_cli_force_never_deletes_a_folder_blaze_did_not_write(base, variant, tmp_path):
    out, _ = variant
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    result = CliRunner().invoke(main, ["apply", str(out / PATCH_FILE), "--base", str(base.path), "--out", str(mine),
                                       "--force"])
    assert result.exit_code == 2 and "not written by blaze" in result.output
    assert [p.name for p in mine.iterdir()] == ["thesis.tex"] and (mine / "thesis.tex").read_text() == "years of work"


def test_first_write_and_rerun_give_identical_patch_and_manifest(tiny_release, tmp_path, monkeypatch):
    """With the hash cache on, the first edit fills it and the rerun finds it warm: the patch (its recorded
    base identity) and the manifest must not change with that (issue 14)."""
    import time

    monkeypatch.setenv("BLAZE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("BLAZE_HASH_CACHE", "1")
    local = tmp_path / "base"
    shutil.copytree(tiny_release, local)
    past = time.time_ns() - 3600 * 10**9  # an old download: its cache entries are not "racy"
    for path in local.iterdir():
        os.utime(path, ns=(past, past))
    release = resolve_release(local)
    outputs = []
    for run in ("first", "rerun"):
        patch = _patch(release)  # base identity taken now: cold cache on the first run, warm on the rerun
        out = write_variant(release, patch, tmp_path / run, progress=False)
        outputs.append(((out / PATCH_FILE).read_bytes(), (out / MANIFEST_FILE).read_bytes()))
    from clef_model.filehash import known_sha256

    assert all(known_sha256(p) for p in local.glob("model-*.safetensors"))  # the rerun did see a warm cache
    assert outputs[0][0] == outputs[1][0]
    assert outputs[0][1] == outputs[1][1]


def test_cli_apply_keeps_the_behaviour_spec_hash_of_the_patch(base, tmp_path):
    """The manifest of an applied variant names the behaviour and its spec hash, as `blaze edit` records them
    in the patch (the card reads edit.spec_hash)."""
    patch = _patch(base)
    patch = Patch(patch.factors, patch.base_identity, {**patch.metadata, "behavior": "verbosity",
                                                       "spec_hash": "d" * 64, "spec_version": 1})
    patch_file = tmp_path / "p.safetensors"
    patch.save(patch_file)
    result = CliRunner().invoke(main, ["apply", str(patch_file), "--base", str(base.path), "--out",
                                       str(tmp_path / "v")])
    assert result.exit_code == 0, result.output
    edit = json.loads((tmp_path / "v" / MANIFEST_FILE).read_text())["edit"]
    assert edit["behavior"] == "verbosity" and edit["spec_hash"] == "d" * 64 and edit["spec_version"] == 1
