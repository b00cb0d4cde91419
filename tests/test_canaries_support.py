"""Helpers for the canary tests: variants of a release made in-process (no surgery code needed).

`make_variant` copies a release folder and adds a random rank-r delta to a few matrices, re-writing only the
shards that hold them, so integrity sees exactly those tensors changed. Options alter the joint head or the
release code, to check integrity catches it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from clef_model.checkpoint import CheckpointReader, load_tensors, save_tensors

WRITERS = ["model.language_model.layers.2.mlp.down_proj.weight",
           "model.language_model.layers.5.linear_attn.out_proj.weight"]


def low_rank_delta(weight: torch.Tensor, rank: int, relative: float, seed: int) -> torch.Tensor:
    """A random rank-`rank` matrix with ‖Δ‖ = relative·‖W‖."""
    generator = torch.Generator().manual_seed(seed)
    u = torch.randn(weight.shape[0], rank, generator=generator)
    v = torch.randn(weight.shape[1], rank, generator=generator)
    delta = u @ v.T
    return delta * (relative * weight.float().norm() / delta.norm())


def make_variant(base: Path, out: Path, names: list[str] | None = None, *, rank: int = 1, relative: float = 0.5,
                 seed: int = 1, alter_head: bool = False, alter_code: bool = False,
                 manifest: dict | None = None) -> Path:
    """Copy `base` to `out` and add a rank-`rank` delta of relative size `relative` to each of `names`."""
    names = WRITERS if names is None else names
    shutil.copytree(base, out)
    reader = CheckpointReader(out)
    by_shard: dict[str, list[str]] = {}
    for name in names:
        by_shard.setdefault(reader.weight_map()[name], []).append(name)
    for shard, shard_names in by_shard.items():
        tensors, metadata = load_tensors(out / shard)
        for index, name in enumerate(shard_names):
            weight = tensors[name]
            tensors[name] = (weight.float() + low_rank_delta(weight, rank, relative, seed + index)).to(weight.dtype)
        metadata.pop("format", None)
        save_tensors(out / shard, tensors, metadata)
    if alter_head:
        head, head_meta = load_tensors(out / "joint_head.safetensors")
        first = sorted(head)[0]
        head[first] = head[first] + 0.01
        head_meta.pop("format", None)
        save_tensors(out / "joint_head.safetensors", head, head_meta)
    if alter_code:
        code = out / "joint_schema_model.py"
        code.write_text(code.read_text() + "\n# altered\n")
    if manifest is not None:
        (out / "blaze_manifest.json").write_text(json.dumps(manifest))
    return out
