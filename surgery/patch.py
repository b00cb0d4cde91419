"""The patch: low-rank weight deltas ΔW = U Vᵀ per matrix, saved as `blaze_delta.safetensors` — torch view.

A patch is what an edit produces and what `blaze apply` re-applies. It records the identity of the base it
was computed on (checkpoint index hash and a hash of every targeted tensor), so applying it to another
base can be refused. `Patch.applied` toggles the edit on a loaded model in memory (used by the strength
sweep and the canaries) and restores the exact original weights afterwards.

`Patch` holds torch tensors for the code that runs models. The file format, the rank/norm facts, the fit
checks and the base identity are implemented once, torch-free, in `surgery.delta` (`PatchArrays`), which
`blaze apply` uses without importing torch; `Patch.arrays()` is the zero-copy bridge.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from clef_model.checkpoint import CheckpointReader
from clef_model.errors import BlazeError
from surgery.delta import (  # noqa: F401  (re-exported: the historical home of these names)
    FLOAT_DTYPES,
    PATCH_FILE,
    PATCH_FORMAT,
    PatchArrays,
    base_identity,
    check_factor_shapes,
    identity_mismatches,
    tensor_sha256,
)

if TYPE_CHECKING:
    from clef_model.runtime import Runtime


@dataclass
class Patch:
    """Per-matrix factors NAME -> (U: d_out×k, V: d_in×k) in float32, with ΔW = U Vᵀ.

    NAME is the on-disk tensor name without `.weight` (as `Runtime.named_linears()` keys it); the stored
    tensor is `NAME.weight`. `base_identity` (or None) says which base the deltas belong to; `metadata`
    holds JSON-serialisable facts about how the patch was made (method, strength, rank, …).
    """

    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    base_identity: dict | None = None
    metadata: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        clean: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, (u, v) in self.factors.items():
            check_factor_shapes(name, tuple(u.shape), tuple(v.shape))
            clean[name] = (u.detach().to("cpu", torch.float32).contiguous(), v.detach().to("cpu", torch.float32).contiguous())
        self.factors = clean

    # -- facts --------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Edited matrix names (without `.weight`), sorted."""
        return sorted(self.factors)

    def rank(self, name: str) -> int:
        """k of one matrix's factors (an upper bound on the rank of its delta)."""
        return int(self.factors[name][0].shape[1])

    def delta(self, name: str) -> torch.Tensor:
        """ΔW = U Vᵀ of one matrix, float32 (d_out × d_in)."""
        u, v = self.factors[name]
        return u @ v.T

    def delta_norm(self, name: str) -> float:
        """‖U Vᵀ‖_F computed from the k×k Gram matrices (never forms ΔW)."""
        return self.arrays().delta_norm(name)

    def delta_singular_values(self, name: str) -> torch.Tensor:
        """Singular values of U Vᵀ (float64, length k), from thin QR factors — cheap even for big matrices."""
        return torch.from_numpy(self.arrays().delta_singular_values(name))

    def numerical_rank(self, name: str) -> int:
        """Numerical rank of U Vᵀ (singular values above max(d) · ε_fp32 · σ_max)."""
        return self.arrays().numerical_rank(name)

    def arrays(self) -> PatchArrays:
        """The same patch as numpy arrays sharing this patch's memory (for the torch-free writer and file I/O)."""
        def host(t: torch.Tensor) -> np.ndarray:
            return t.detach().to("cpu", torch.float32).contiguous().numpy()  # no copy for the usual factors

        return PatchArrays({n: (host(u), host(v)) for n, (u, v) in self.factors.items()},
                           self.base_identity, self.metadata)

    @classmethod
    def from_arrays(cls, arrays: PatchArrays) -> Patch:
        """A torch `Patch` over a `PatchArrays` (sharing its memory)."""
        return cls({n: (torch.from_numpy(u), torch.from_numpy(v)) for n, (u, v) in arrays.factors.items()},
                   arrays.base_identity, arrays.metadata)

    # -- transforms -----------------------------------------------------------------------------------------
    def scaled(self, s: float) -> Patch:
        """The same edit at `s` times the strength (U scaled by s); metadata["scale"] is multiplied by s."""
        metadata = dict(self.metadata)
        metadata["scale"] = float(metadata.get("scale", 1.0)) * float(s)
        return Patch({n: (u * float(s), v.clone()) for n, (u, v) in self.factors.items()},
                     dict(self.base_identity) if self.base_identity else None, metadata)

    # -- files --------------------------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Write `NAME.U` / `NAME.V` float32 tensors, with base identity and metadata as JSON in the header."""
        self.arrays().save(path)

    @classmethod
    def load(cls, path: Path) -> Patch:
        """Read a patch file (or a variant folder holding `blaze_delta.safetensors`); BlazeError if it is not one."""
        return cls.from_arrays(PatchArrays.load(path))

    # -- fitting a base -----------------------------------------------------------------------------------
    def problems_with(self, reader: CheckpointReader) -> list[str]:
        """Why this patch cannot be applied to a checkpoint (empty list: it fits)."""
        return self.arrays().problems_with(reader)

    def check_fits(self, reader: CheckpointReader) -> None:
        """Raise BlazeError listing every reason the patch does not fit the checkpoint."""
        self.arrays().check_fits(reader)

    # -- in memory ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def applied(self, runtime: Runtime, scale: float = 1.0) -> Iterator[None]:
        """Add scale·U Vᵀ to the live weights of `runtime` (in fp32, cast back); restore the originals on exit."""
        linears: Mapping[str, torch.nn.Linear] = runtime.named_linears()
        missing = [n for n in self.names() if n not in linears]
        if missing:
            raise BlazeError(f"the loaded model has no linear layer {missing[0]!r} (and {len(missing) - 1} more "
                             "missing); the patch was made for another architecture.")
        originals: dict[str, torch.Tensor] = {}
        try:
            with torch.no_grad():
                for name in self.names():
                    weight = linears[name].weight
                    u, v = self.factors[name]
                    if tuple(weight.shape) != (u.shape[0], v.shape[0]):
                        raise BlazeError(f"{name}.weight is {list(weight.shape)} but the patch's U·Vᵀ is "
                                         f"{[u.shape[0], v.shape[0]]}; the patch was made for another base.")
                    originals[name] = weight.detach().clone()
                    u, v = u.to(weight.device), v.to(weight.device)
                    updated = weight.detach().float().addmm_(u, v.T, alpha=float(scale))
                    weight.copy_(updated.to(weight.dtype))
                    del updated
            yield
        finally:
            with torch.no_grad():
                for name, original in originals.items():
                    linears[name].weight.copy_(original)

