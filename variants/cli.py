"""The `blaze` command line: one click group; each package's commands live in `variants/cli_*.py`."""

from __future__ import annotations

import sys

import click

from clef_model.errors import BlazeError
from variants import cli_apply, cli_canary, cli_runtime, cli_surgery, cli_variants


class _Group(click.Group):
    """Maps user-facing errors (BlazeError) to exit code 2 with a one-line message, no traceback."""

    def invoke(self, ctx: click.Context):  # noqa: D102
        try:
            return super().invoke(ctx)
        except BlazeError as error:
            click.echo(f"error: {error}", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="blaze")
def main() -> None:
    """blaze: behaviour variants of Clef-Flash by closed-form, rank-limited weight edits — no training.

    \b
    Typical use:
      blaze edit --behavior verbosity --out ./variant       # base defaults to Cloudflare/clef-flash
      blaze canary ./variant --against Cloudflare/clef-flash
      blaze publish ./variant --repo you/clef-flash-concise

    The embedded base `smollm2` (SmolLM2-135M-Instruct, shipped in a PyPI package) works offline.
    """


for _module in (cli_runtime, cli_surgery, cli_apply, cli_canary, cli_variants):
    _module.register(main)


if __name__ == "__main__":  # `python -m variants.cli …` works like the `blaze` command
    main()
