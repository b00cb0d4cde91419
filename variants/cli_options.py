"""Transition shim: `variants/cli_canary.py` imports from here until it moves to `variants/cli/canary.py`."""

from variants.cli.options import dataclass_options  # noqa: F401
