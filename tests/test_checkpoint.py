"""clef_model.checkpoint: lazy reader, streaming sharded writer, atomic output, hashing."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from clef_model.checkpoint import (
    INDEX_NAME,
    CheckpointReader,
    ShardedWriter,
    atomic_output,
    dtype_name,
    read_header,
    sha256_file,
)
from clef_model.errors import BlazeError, ReleaseError


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.w": torch.randn(8, 16, generator=gen).to(torch.bfloat16),
        "model.layers.0.b": torch.randn(8, generator=gen).to(torch.float16),
        "model.layers.1.w": torch.randn(16, 8, generator=gen),
        "ids": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "mask": torch.tensor([True, False, True]),
    }


def _layout(tensors):
    return [(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors.items()]


@pytest.mark.parametrize("planned", [False, True], ids=["spooled", "planned"])
def test_writer_roundtrip_with_safetensors_and_reader(tmp_path, planned):
    tensors = _tensors()
    writer = ShardedWriter(tmp_path, max_shard_bytes=300, layout=_layout(tensors) if planned else None)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    index = writer.close()

    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert json.loads((tmp_path / INDEX_NAME).read_text()) == index
    # the budget holds for every shard holding more than one tensor
    for shard in shards:
        members = [n for n, s in index["weight_map"].items() if s == shard]
        size = sum(tensors[n].numel() * tensors[n].element_size() for n in members)
        assert len(members) == 1 or size <= 300
        assert os.stat(tmp_path / shard).st_mode & 0o777 == 0o644
        with safe_open(tmp_path / shard, "pt") as handle:  # the official reader accepts our files
            assert handle.metadata() == {"format": "pt"}
    assert sorted(os.listdir(tmp_path)) == sorted(shards + [INDEX_NAME])  # no spool files left

    loaded = {}
    for shard in shards:
        loaded.update(load_file(tmp_path / shard))
    reader = CheckpointReader(tmp_path)
    assert set(reader.names()) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype
        assert torch.equal(reader.tensor(name), tensor)
        assert reader.dtype(name) == dtype_name(tensor.dtype)
        assert reader.shape(name) == tuple(tensor.shape)
        assert reader.raw_bytes(name) == tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes() \
            if tensor.dim() else True


def test_planned_and_spooled_outputs_are_byte_identical_and_deterministic(tmp_path):
    tensors = _tensors()
    digests = []
    for run, planned in enumerate([True, False, True]):
        out = tmp_path / str(run)
        writer = ShardedWriter(out, max_shard_bytes=300, layout=_layout(tensors) if planned else None)
        for name, tensor in tensors.items():
            writer.add_tensor(name, tensor)
        writer.close()
        digests.append({p.name: sha256_file(p) for p in sorted(out.iterdir())})
    assert digests[0] == digests[1] == digests[2]


def test_copy_from_is_bit_identical_and_reader_reads_single_file(tmp_path):
    tensors = _tensors()
    nan_bits = torch.tensor([0x7FC1, -1, 0x0001], dtype=torch.int16).view(torch.bfloat16)  # odd NaNs/denormals
    tensors["weird"] = nan_bits
    save_file(tensors, tmp_path / "model.safetensors")
    reader = CheckpointReader(tmp_path)
    out = tmp_path / "out"
    writer = ShardedWriter(out, layout=[(n, reader.dtype(n), reader.shape(n)) for n in reader.names()])
    for name in reader.names():
        writer.copy_from(reader, name)
    writer.close()
    copy = CheckpointReader(out)
    for name in reader.names():
        assert copy.raw_bytes(name) == reader.raw_bytes(name)
    assert b"".join(copy.iter_raw("model.layers.1.w", chunk_bytes=100)) == reader.raw_bytes("model.layers.1.w")


def test_writer_rejects_misuse(tmp_path):
    tensors = _tensors()
    writer = ShardedWriter(tmp_path / "a", layout=_layout(tensors))
    with pytest.raises(ValueError, match="planned order"):
        writer.add_tensor("ids", tensors["ids"])
    writer = ShardedWriter(tmp_path / "b")
    writer.add_tensor("x", tensors["ids"])
    with pytest.raises(ValueError, match="twice"):
        writer.add_tensor("x", tensors["ids"])
    with pytest.raises(ValueError, match="expected"):
        writer.add_raw("y", "F32", (2, 2), b"\0" * 12)


def _write_shard(path, tensors):
    save_file(tensors, path)


def test_truncated_shard_is_a_clear_error(tmp_path):
    _write_shard(tmp_path / "model.safetensors", _tensors())
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(ReleaseError, match="truncated"):
        CheckpointReader(tmp_path)


@pytest.mark.parametrize(
    "payload,match",
    [
        (b"\x01\x02", "shorter than"),
        (struct.pack("<Q", 10**12) + b"{}", "header length"),
        (struct.pack("<Q", 4) + b"nope", "not JSON"),
        (struct.pack("<Q", 56) + b'{"t":{"dtype":"Q9","shape":[1],"data_offsets":[0,1]}}'.ljust(56) + b"x", "unknown dtype"),
        (struct.pack("<Q", 56) + b'{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}'.ljust(56) + b"x" * 4,
         "4 bytes for F32"),
        (struct.pack("<Q", 112) + b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
         b'"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}'.ljust(112) + b"x" * 8, "share bytes"),
    ],
)
def test_bad_header_is_a_clear_error(tmp_path, payload, match):
    (tmp_path / "model.safetensors").write_bytes(payload)
    with pytest.raises(ReleaseError, match=match):
        read_header(tmp_path / "model.safetensors")
    with pytest.raises(BlazeError):
        CheckpointReader(tmp_path)


def test_zero_size_tensors_may_share_an_offset(tmp_path):
    """Only tensors with bytes can overlap: an empty tensor at a neighbour's offset is a valid file."""
    save_file({"empty": torch.zeros(0, 3), "a": torch.ones(2), "b": torch.zeros(0)}, tmp_path / "model.safetensors")
    header, _start = read_header(tmp_path / "model.safetensors")
    assert header["empty"]["data_offsets"][0] == header["empty"]["data_offsets"][1]
    assert CheckpointReader(tmp_path).array("a").tolist() == [1.0, 1.0]


def test_index_naming_missing_shard_or_tensor(tmp_path):
    _write_shard(tmp_path / "model-00001-of-00001.safetensors", {"a": torch.zeros(2)})
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ReleaseError, match="missing"):
        CheckpointReader(tmp_path)
    (tmp_path / INDEX_NAME).write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors"}})
    )
    with pytest.raises(ReleaseError, match="absent"):
        CheckpointReader(tmp_path)
    with pytest.raises(ReleaseError, match="no model.safetensors"):
        CheckpointReader(tmp_path / "nothing")


def test_atomic_output_renames_on_success_and_cleans_up_on_error(tmp_path):
    dest = tmp_path / "variant"
    with atomic_output(dest) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".variant.tmp-")
        (tmp / "f").write_text("1")
        (tmp / "blaze_manifest.json").write_text('{"blaze_manifest": 1}')  # a variant: --force may replace it
    assert (dest / "f").read_text() == "1"
    assert [p.name for p in tmp_path.iterdir()] == ["variant"]
    assert sorted(p.name for p in dest.iterdir()) == ["blaze_manifest.json", "f"]  # the temporary marker is gone

    with pytest.raises(BlazeError, match="not empty"):
        with atomic_output(dest):
            pass
    with pytest.raises(RuntimeError):
        with atomic_output(dest, force=True) as tmp:
            (tmp / "g").write_text("2")
            raise RuntimeError("boom")
    assert [p.name for p in tmp_path.iterdir()] == ["variant"] and (dest / "f").read_text() == "1"

    with pytest.raises(BlazeError, match="no space left"):
        with atomic_output(tmp_path / "other"):
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "other" / "x"))
    assert [p.name for p in tmp_path.iterdir()] == ["variant"]

    with atomic_output(dest, force=True) as tmp:
        (tmp / "g").write_text("2")
    assert [p.name for p in dest.iterdir()] == ["g"]
    assert [p.name for p in tmp_path.iterdir()] == ["variant"]

    (tmp_path / "empty").mkdir()
    with atomic_output(tmp_path / "empty") as tmp:
        (tmp / "h").write_text("3")
    assert (tmp_path / "empty" / "h").read_text() == "3"


def test_sha256_file(tmp_path):
    (tmp_path / "x").write_bytes(b"blaze" * 1000)
    assert sha256_file(tmp_path / "x") == hashlib.sha256(b"blaze" * 1000).hexdigest()


def test_force_replaces_only_what_blaze_wrote(tmp_path):
    """--force over a folder blaze did not write is refused and the folder keeps its files."""
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "holiday.jpg").write_bytes(b"precious")
    with pytest.raises(BlazeError, match="not written by blaze"):
        with atomic_output(foreign, force=True) as tmp:
            (tmp / "x").write_text("1")
    assert [p.name for p in foreign.iterdir()] == ["holiday.jpg"]
    assert (foreign / "holiday.jpg").read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["photos"]


def test_unwritable_output_is_refused_before_work(tmp_path, monkeypatch):
    from clef_model import outputs

    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o555)
    try:
        if os.access(locked, os.W_OK):  # root ignores permissions: simulate a read-only filesystem instead
            def read_only(*args, **kwargs):
                raise OSError(errno.EROFS, "Read-only file system")

            monkeypatch.setattr(outputs.tempfile, "mkdtemp", read_only)
        with pytest.raises(BlazeError, match="cannot write"):
            outputs.check_output(locked / "variant")
    finally:
        os.chmod(locked, 0o755)


def test_stale_temporary_folders_of_dead_processes_are_removed(tmp_path):
    """A temporary folder whose owner died (kill -9) is removed by the next write into the same parent; one
    whose owner lives, and hidden folders that are not blaze's, are kept."""
    import json
    import subprocess
    import sys

    from clef_model.outputs import MARKER, _start_token

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / ".variant.tmp-abc123"
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"half")
    import socket

    (stale / MARKER).write_text(json.dumps({"pid": dead_pid, "start": "1", "host": socket.gethostname()}))
    alive = tmp_path / ".other.tmp-def456"
    alive.mkdir()
    (alive / MARKER).write_text(json.dumps({"pid": os.getpid(), "start": _start_token(os.getpid()),
                                            "host": socket.gethostname()}))
    reused = tmp_path / ".reused.tmp-ghi789"  # the PID lives, but it is another process (start time differs)
    reused.mkdir()
    (reused / MARKER).write_text(json.dumps({"pid": os.getpid(), "start": "-1", "host": socket.gethostname()}))
    foreign = tmp_path / ".cache.tmp-keep"
    foreign.mkdir()
    with atomic_output(tmp_path / "variant") as tmp:
        (tmp / "f").write_text("1")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".cache.tmp-keep", ".other.tmp-def456", "variant"]
