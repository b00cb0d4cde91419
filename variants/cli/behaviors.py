"""`blaze behaviors`: list, show and scaffold behaviour specs."""

from __future__ import annotations

from pathlib import Path

import click

from variants.spec import list_behaviors, load_behavior, scaffold_behavior


@click.group("behaviors", invoke_without_command=True)
@click.pass_context
def behaviors(ctx: click.Context) -> None:
    """List the shipped behaviours (name, description, pair counts).

    A behaviour is a JSON spec (schema: docs/BEHAVIORS.md). Use its name with `blaze edit --behavior NAME`,
    or pass a path to your own spec file; `blaze behaviors new NAME` scaffolds one.
    """
    if ctx.invoked_subcommand is not None:
        return
    names = list_behaviors()
    if not names:
        click.echo("no behaviours shipped; `blaze behaviors new NAME` scaffolds one")
        return
    specs = [load_behavior(name) for name in names]
    width = max(len(s.name) for s in specs)
    click.echo(f"{'name':<{width}}  {'dirs':>4}  {'train':>5}  {'valid':>5}  {'held':>4}  {'keep':>4}  description")
    for spec in specs:
        c = spec.pair_counts()
        click.echo(f"{spec.name:<{width}}  {len(spec.directions):>4}  {c['train']:>5}  {c['validation']:>5}  "
                   f"{c['heldout']:>4}  {c['preserve']:>4}  {spec.description}")


@behaviors.command("show")
@click.argument("name")
def behaviors_show(name: str) -> None:
    """Show one behaviour (catalogue NAME or a path): directions, sizes, defaults, gate, hash."""
    spec = load_behavior(name)
    click.echo(f"{spec.name} (version {spec.version}) — {spec.description}")
    click.echo(f"source: {spec.source}")
    click.echo(f"spec sha256: {spec.spec_hash}")
    for direction in spec.directions:
        click.echo(f"direction {direction.name}: {len(direction.pairs.train)} train pairs, "
                   f"{len(direction.pairs.validation)} validation items")
        if direction.wanted_system or direction.unwanted_system:
            click.echo(f"  wanted system:   {direction.wanted_system}")
            click.echo(f"  unwanted system: {direction.unwanted_system}")
    counts = spec.pair_counts()
    click.echo(f"held-out canary prompts: {counts['heldout']}; extra preserve prompts: {counts['preserve']}; "
               f"training-question check items: {counts['checks']}; quality check: {spec.quality}")
    click.echo("defaults: " + ", ".join(f"{k}={v}" for k, v in spec.defaults.to_dict().items()))
    click.echo("gate: " + ", ".join(f"{k}={v}" for k, v in spec.gate.to_dict().items()))


@behaviors.command("new")
@click.argument("name")
@click.option("--dir", "folder", type=click.Path(file_okay=False, path_type=Path), default=Path("."),
              show_default=True, help="Folder to write NAME.json into.")
def behaviors_new(name: str, folder: Path) -> None:
    """Scaffold a valid spec file NAME.json to edit (refuses to overwrite an existing file)."""
    path = scaffold_behavior(name, folder)
    click.echo(f"wrote {path}: replace the examples, then `blaze behaviors show {path}` to validate it")
