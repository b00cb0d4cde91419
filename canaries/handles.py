"""ModelView: one side of a canary comparison (the base or the variant) as a Runtime plus how to switch it on."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelView:
    """A model to run canaries on.

    `runtime` is a `clef_model.runtime.Runtime`. `activate` returns a context manager inside which the runtime
    behaves as this model: base and variant may share one Runtime with the edit toggled in memory
    (`activate=lambda: patch.applied(rt, s)`), or be two Runtimes (the default `nullcontext`).
    """

    runtime: Any
    activate: Callable[[], AbstractContextManager] = field(default=contextlib.nullcontext)
    label: str = "variant"
