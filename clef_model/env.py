"""blaze's environment variables: each one is read and parsed here, and only here.

The functions read the environment when called (not at import), so a test that sets a variable with
`monkeypatch.setenv` sees it at once. One rule for switches (`flag`): `1`, `true`, `yes`, `on` mean on;
`0`, `false`, `no`, `off` mean off (any case, spaces ignored); unset or empty means the default; anything
else is a `BlazeError` that names the variable.

| variable                   | meaning                                                           | default          |
|----------------------------|-------------------------------------------------------------------|------------------|
| `BLAZE_QUIET`              | no progress bars                                                  | off              |
| `BLAZE_CACHE`              | cache folder (`~` expanded): statistics, canary, hashes, logs, …  | `~/.cache/blaze` |
| `BLAZE_FAST`               | fast CUDA-graph paths: on, off, or unset = on for CUDA only; `0` also makes plain LMs decode through transformers' `generate` | unset            |
| `BLAZE_FAST_HEAD`          | `vector`: the vectorised joint head (allowlisted release code)    | unset            |
| `BLAZE_FAST_COMPILE`       | compiled SystemOne backbone (not bit-compatible)                  | off              |
| `BLAZE_HASH_CACHE`         | the persistent SHA-256 cache                                      | on               |
| `BLAZE_STATS_CACHE_MAX_GB` | largest statistics file kept in the cache, in GB                  | 2                |
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from clef_model.errors import BlazeError

QUIET = "BLAZE_QUIET"
CACHE = "BLAZE_CACHE"
FAST = "BLAZE_FAST"
FAST_HEAD = "BLAZE_FAST_HEAD"
FAST_COMPILE = "BLAZE_FAST_COMPILE"
HASH_CACHE = "BLAZE_HASH_CACHE"
STATS_CACHE_MAX_GB = "BLAZE_STATS_CACHE_MAX_GB"

_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"0", "false", "no", "off"})


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def flag(name: str, default: bool | None) -> bool | None:
    """A switch by the one rule (module docstring); `default` when unset or empty."""
    value = _raw(name).lower()
    if not value:
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise BlazeError(f"{name}={os.environ[name]!r} is not a switch: set it to 1 or 0 (or true/false, yes/no, on/off), "
                     "or unset it")


def quiet() -> bool:
    """`BLAZE_QUIET`: no progress bars (blaze's and the libraries' it drives)."""
    return bool(flag(QUIET, False))


def cache_root() -> Path:
    """`BLAZE_CACHE` with `~` expanded, else `~/.cache/blaze`: the one root of every blaze cache and log."""
    value = _raw(CACHE)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "blaze"


def fast() -> bool | None:
    """`BLAZE_FAST`: True forces the fast paths on (any device), False off, None (unset) = on for CUDA only."""
    value = _raw(FAST).lower()
    return None if value == "auto" else flag(FAST, None)


def fast_head() -> str:
    """`BLAZE_FAST_HEAD`, lower case ('' when unset); `vector` selects the vectorised joint head."""
    return _raw(FAST_HEAD).lower()


def fast_compile() -> bool:
    """`BLAZE_FAST_COMPILE`: the SystemOne backbone through torch.compile (faster, not bit-compatible)."""
    return bool(flag(FAST_COMPILE, False))


def hash_cache() -> bool:
    """`BLAZE_HASH_CACHE`: whether the persistent SHA-256 cache is used (on unless switched off)."""
    return bool(flag(HASH_CACHE, True))


def stats_cache_max_bytes(default_gb: float = 2.0) -> float:
    """`BLAZE_STATS_CACHE_MAX_GB` in bytes: the largest statistics file the cache keeps."""
    value = _raw(STATS_CACHE_MAX_GB)
    if not value:
        return default_gb * 1e9
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number < 0:
        raise BlazeError(f"{STATS_CACHE_MAX_GB} must be a number of gigabytes, 0 or more (got {value!r})")
    return number * 1e9
