"""Option helpers the `blaze` commands share.

- Click options generated from settings dataclasses (``EditSettings``, ``Thresholds``): one definition per
  setting (:func:`dataclass_options`).
- The options of a command that loads a release (:func:`runtime_options`, :func:`load_runtime`).

Each dataclass field that carries ``metadata["help"]`` becomes one option, ``--field-name`` (or
``metadata["flag"]``), default ``None`` ("not given": the spec's or the dataclass's value applies). Numbers
are checked where they are parsed: a NaN, an infinity or a negative value is a usage error (exit 2) before
any work starts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from clef_model.errors import BlazeError

if TYPE_CHECKING:
    from clef_model.runtime import Runtime

F = TypeVar("F", bound=Callable[..., Any])


class FiniteNumber(click.ParamType):
    """A finite number ≥ ``minimum`` (and ≤ ``maximum`` when given); ``integer`` for whole numbers."""

    def __init__(self, integer: bool = False, minimum: float = 0, maximum: float | None = None) -> None:
        self.integer, self.minimum, self.maximum = integer, minimum, maximum
        self.name = "integer" if integer else "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """Parse and bound-check; a bad value fails with a message naming the bound."""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = value
        else:
            try:
                number = int(value) if self.integer else float(value)
            except (TypeError, ValueError):
                self.fail(f"{value!r} is not {'an integer' if self.integer else 'a number'}", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if number < self.minimum:
            self.fail(f"{value!r} is below the minimum {self.minimum:g}", param, ctx)
        if self.maximum is not None and number > self.maximum:
            self.fail(f"{value!r} is above the maximum {self.maximum:g}", param, ctx)
        return number


class Converted(click.ParamType):
    """A value parsed by a settings module's own function (e.g. ``parse_strength``): one parser for the
    command line, spec files and the Python API; its ``BlazeError`` becomes a usage error (exit 2)."""

    def __init__(self, convert: Callable[[Any], Any], name: str) -> None:
        self.convert_value, self.name = convert, name

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """Parse with the settings' function; its message is the usage error's."""
        try:
            return self.convert_value(value)
        except BlazeError as error:
            self.fail(str(error), param, ctx)


def _param_type(f: dataclasses.Field) -> click.ParamType:
    meta = f.metadata
    if "click_type" in meta:
        return meta["click_type"]
    if "convert" in meta:
        return Converted(meta["convert"], f.name.upper())
    if "choices" in meta:
        return click.Choice(list(meta["choices"]))
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if kind == "int":
        return FiniteNumber(integer=True, minimum=meta.get("minimum", 0))
    if kind == "float":
        return FiniteNumber(minimum=meta.get("minimum", 0), maximum=meta.get("maximum"))
    return click.STRING


def dataclass_options(cls: type, *, default_note: str = "", skip: tuple[str, ...] = ()) -> Callable[[F], F]:
    """A decorator adding one option per documented field of ``cls`` (in field order); values arrive under
    the field names (``None`` when not given). ``default_note`` is appended to every help text."""
    fields = [f for f in dataclasses.fields(cls) if "help" in f.metadata and f.name not in skip]

    def decorate(command: F) -> F:
        for f in reversed(fields):
            flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
            help_text = f.metadata["help"] + (f" {default_note}" if default_note else "")
            command = click.option(flag, f.name, type=_param_type(f), default=None, help=help_text)(command)
        return command

    return decorate


def field_names(cls: type, skip: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The names :func:`dataclass_options` adds for ``cls``."""
    return tuple(f.name for f in dataclasses.fields(cls) if "help" in f.metadata and f.name not in skip)


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
