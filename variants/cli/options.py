"""Option helpers shared by the `blaze` commands: the options of a command that loads a release.

(The options generated from settings dataclasses join this module when `variants/cli_options.py` moves in.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

if TYPE_CHECKING:
    from clef_model.runtime import Runtime

F = TypeVar("F", bound=Callable[..., Any])

def runtime_options(command: F) -> F:
    """Options shared by the commands that load a release: --revision, --device, --trust-release-code."""
    command = click.option(
        "--trust-release-code",
        is_flag=True,
        help="Run the release's joint_schema_model.py even if its SHA-256 is not a known Cloudflare file. "
        "It is executable code: read it first.",
    )(command)
    command = click.option(
        "--device", default=None, help="torch device, e.g. cuda, cuda:1, cpu. Default: cuda when available, else cpu."
    )(command)
    command = click.option("--revision", default=None, help="Hub revision (branch, tag or commit) of REF.")(command)
    return command


def load_runtime(ref: str, revision: str | None, device: str | None, trust_release_code: bool) -> Runtime:
    """Load REF for a command (imports torch: only when the command runs, so `--help` stays fast)."""
    from clef_model.runtime import Runtime

    return Runtime.load(ref, revision=revision, device=device, trust_release_code=trust_release_code)
