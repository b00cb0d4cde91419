"""Caches of the base's canary outputs, so the base runs once per suite and settings.

- `MemoryCache`: a dict, for strength sweeps that call `run_canary` many times against one base.
- `DiskCache`: one `torch.save` file per key under `$BLAZE_CACHE/canary/` (default `~/.cache/blaze/canary/`),
  for running base and variant one after the other when both do not fit in memory. Read back with
  `torch.load(weights_only=True)`, so a cache file is data, never code: a file that needs anything but plain
  containers, numbers, strings and tensors is ignored and recomputed.

Keys hash the base's identity, the suite contents and the settings (`cache_key`). The base's identity for the
disk cache is `base_key`: `release_fingerprint` (SHA-256 of every weight shard and side file, through blaze's
persistent hash cache, so a 19 GB base is hashed once) and the device. Format 3: on the CPU, answers from the
decode that drops stopped rows (`clef_model.greedy`); on a GPU, from transformers' `generate` (plain causal LMs)
or the fast path (Clef); the device's default batch. A base's answers must come from the same decode as the
variant's: in bfloat16 on an H200 the two decodes gave different tokens for 19 of 160 SmolLM2 answers and one
loop more, with no edit (BENCHMARKS, "loop noise").
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Protocol

import torch


def cache_root() -> Path:
    """`$BLAZE_CACHE/canary` when set, else `~/.cache/blaze/canary`."""
    from clef_model.env import cache_root as blaze_cache

    return blaze_cache() / "canary"


def _json_default(value: Any) -> Any:
    if hasattr(value, "tobytes") and hasattr(value, "size"):  # PIL images in SystemOne requests
        return {"image_sha256": hashlib.sha256(value.tobytes()).hexdigest(), "size": list(value.size),
                "mode": getattr(value, "mode", None)}
    if isinstance(value, (set, tuple)):
        return list(value)
    return repr(value)


def content_hash(value: Any) -> str:
    """SHA-256 of a JSON rendering of plain data (images hashed by their pixels)."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, default=_json_default)
    return hashlib.sha256(text.encode()).hexdigest()


def cache_key(base_identity: str, suite: dict[str, Any], settings: dict[str, Any]) -> str:
    """The key of a base's outputs: base identity + suite contents + settings."""
    return content_hash({"base": base_identity, "suite": suite, "settings": settings, "format": 3})


def release_fingerprint(folder: Path) -> str:
    """SHA-256 over every file of a release folder (name + content hash); each file's hash comes from blaze's
    persistent hash cache (`clef_model.filehash`), so a 19 GB base is read once."""
    from clef_model.filehash import file_sha256

    folder = Path(folder)
    parts = [f"{path.name}:{file_sha256(path)}"
             for path in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def base_key(folder: Path, device: str | Any, dtype: Any) -> str:
    """The disk cache's name for a base on a device in a compute dtype: `blaze edit`'s final canary and `blaze
    canary` use the same one, so the canary reuses the base answers the edit generated (same suite and settings).
    The dtype is part of it: bfloat16 and float32 answers of one base differ (BENCHMARKS, "loop noise")."""
    import torch

    return f"{release_fingerprint(folder)}|{torch.device(device)}|{str(dtype).removeprefix('torch.')}"


class BaseCache(Protocol):
    """Where base outputs are kept between runs."""

    def get(self, key: str) -> dict | None: ...
    def put(self, key: str, value: dict) -> None: ...


class MemoryCache:
    """In-process cache (a dict)."""

    def __init__(self) -> None:
        self.entries: dict[str, dict] = {}

    def get(self, key: str) -> dict | None:  # noqa: D102
        return self.entries.get(key)

    def put(self, key: str, value: dict) -> None:  # noqa: D102
        self.entries[key] = value


class DiskCache:
    """One file per key under `folder` (default `cache_root()`); written atomically."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = Path(folder) if folder else cache_root()

    def _path(self, key: str) -> Path:
        return self.folder / f"base-{key[:32]}.pt"

    def get(self, key: str) -> dict | None:  # noqa: D102
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            # weights_only: plain containers, numbers, strings and tensors only; a pickle that would run code
            # when loaded (a planted or foreign file) raises instead, and is recomputed
            value = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # a damaged or unsafe cache file is recomputed, never trusted
            return None
        return value if isinstance(value, dict) else None

    def put(self, key: str, value: dict) -> None:  # noqa: D102
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self._path(key).with_suffix(f".tmp{os.getpid()}")
        torch.save(value, tmp)
        tmp.replace(self._path(key))
