"""CLI commands (placeholder until implemented)."""

import click


def register(group: click.Group) -> None:
    """Add this module's commands to the blaze group."""
