"""The `blaze` command line: one click group; each command lives in its own module of this package.

`variants/cli/NAME.py` defines the click command `NAME` (a module-level object of the same name) and only
parses options and prints: the work is in the domain modules. `options.py` holds the option helpers the
commands share. They are added to the group in one place, at the bottom of this module.

Exit codes (the contract scripts rely on; README "Exit codes"):

- 0: ok;
- 1: the gate failed (a verdict, not a crash: `canary`, `edit` without a passing strength);
- 2: bad input or refused (`BlazeError`, a usage error, a full disk, an unwritable output);
- 3: internal error: one line saying what happened and where the full log is (the traceback is written to
  `$BLAZE_CACHE/logs/`); `blaze --debug …` prints the traceback as well.

The mapping lives here, once, in `_Group.invoke`: commands raise, they do not pick exit codes (except the
gate verdict, which they return as 1).
"""

from __future__ import annotations

import datetime
import errno
import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

import click

from clef_model.errors import BlazeError

EXIT_OK, EXIT_GATE_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def log_folder() -> Path:
    """Where internal-error logs go: `$BLAZE_CACHE/logs` (default `~/.cache/blaze/logs`)."""
    from clef_model.env import cache_root

    return cache_root() / "logs"


def write_error_log(error: BaseException, argv: list[str] | None = None) -> Path | None:
    """Write the traceback of `error` (with the command line) to a new log file; None if it cannot be written."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    command = " ".join(sys.argv[1:] if argv is None else argv)
    text = (f"blaze {command}\n{stamp} pid {os.getpid()}\n\n"
            + "".join(traceback.format_exception(type(error), error, error.__traceback__)))
    try:
        folder = log_folder()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"blaze-{stamp}-{os.getpid()}.log"
        path.write_text(text, encoding="utf-8")
        return path
    except OSError:
        return None


def _where(error: BaseException) -> str:
    """`file:line in function` of the innermost frame of the error's traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "an unknown place"
    frame = frames[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"


def _os_error_message(error: OSError) -> str | None:
    """A user-facing message for an environment OSError (full disk, no permission), or None for others."""
    where = error.filename or "the output"
    if error.errno in _DISK_FULL:
        free = "unknown"
        try:
            probe = Path(where)
            while not probe.exists() and probe != probe.parent:
                probe = probe.parent
            free = f"{shutil.disk_usage(probe).free / 1e9:.1f}"
        except OSError:
            pass
        return f"no space left on device at {where}, free {free} GB; free some space or write elsewhere."
    if error.errno in _NOT_WRITABLE:
        return f"permission denied at {where} ({error.strerror}); choose a location you can write to."
    return None


class _Group(click.Group):
    """Maps every failure to the exit-code contract; no raw traceback unless `--debug`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:  # noqa: D102
        ctx.meta["blaze.argv"] = list(args)  # the command line, for the internal-error log
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:  # noqa: D102
        debug = bool(ctx.params.get("debug"))
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise  # usage errors exit 2, --help/--version 0: click's own handling
        except BlazeError as error:
            if debug:
                traceback.print_exc()
            click.echo(f"error: {error}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except KeyboardInterrupt:
            click.echo("interrupted.", err=True)
            sys.exit(130)
        except OSError as error:
            message = _os_error_message(error)
            if message is None:
                self._internal(error, debug, ctx.meta.get("blaze.argv"))
            if debug:
                traceback.print_exc()
            click.echo(f"error: {message}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except Exception as error:  # noqa: BLE001 - the one place internal errors are reported
            self._internal(error, debug, ctx.meta.get("blaze.argv"))

    @staticmethod
    def _internal(error: BaseException, debug: bool, argv: list[str] | None) -> None:
        log = write_error_log(error, argv)
        if debug:
            traceback.print_exc()
        summary = str(error).splitlines()[0] if str(error) else ""
        where = f"full log: {log}" if log else "the log could not be written"
        click.echo(f"internal error: {type(error).__name__}{': ' + summary if summary else ''} (at {_where(error)}); "
                   f"{where}. This is a bug in blaze: please report it with the log"
                   f"{'' if debug else ' (or rerun with --debug to see the traceback)'}.", err=True)
        sys.exit(EXIT_INTERNAL)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="blaze")
@click.option("--debug", is_flag=True, help="Print the full traceback of an error (it is always written to "
                                            "$BLAZE_CACHE/logs/ for internal errors).")
def main(debug: bool) -> None:
    """blaze: behaviour variants of Clef-Flash by closed-form, rank-limited weight edits — no training.

    \b
    Typical use:
      blaze edit --behavior verbosity --out ./variant       # base defaults to Cloudflare/clef-flash
      blaze canary ./variant --against Cloudflare/clef-flash
      blaze publish ./variant --repo you/clef-flash-concise

    \b
    Exit codes: 0 ok; 1 the gate failed; 2 bad input or refused; 3 internal error (log in $BLAZE_CACHE/logs).

    The embedded base `smollm2` (SmolLM2-135M-Instruct, shipped in a PyPI package) works offline.
    """


from variants.cli import apply, behaviors, canary, edit, fixture, generate, publish, systemone

for _command in (apply.apply, behaviors.behaviors, canary.canary, edit.edit, fixture.fixture, generate.generate,
                 publish.publish, systemone.systemone):
    main.add_command(_command)
