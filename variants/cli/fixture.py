"""`blaze fixture`: build a random-weight Clef-Flash release in the release layout (offline, for tests)."""

from __future__ import annotations

from pathlib import Path

import click

from clef_model.errors import BlazeError


@click.command("fixture")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--preset", type=click.Choice(["tiny", "9b", "27b", "decisions"]), default="tiny", show_default=True,
              help="tiny: small widths, runs anywhere in seconds; 9b: the real Qwen3.5-9B shapes (≈19.3 GB); "
                   "27b: the real Qwen3.5-27B shapes (≈55.6 GB; needs that much free disk); "
                   "decisions: the tiny release with trained typed decisions (clef-finetune) and a held-out "
                   "labelled decision_eval.jsonl (first build ≤ 3 min on CPU, then cached).")
@click.option("--num-layers", default=None, type=click.IntRange(min=1),
              help="Keep only the first N decoder layers (for benchmarks).")
@click.option("--seed", default=0, show_default=True, type=int, help="Random seed; the same seed gives the same bytes.")
@click.option("--force", is_flag=True, help="Replace a non-empty OUT.")
def fixture(out: Path, preset: str, num_layers: int | None, seed: int, force: bool) -> None:
    """Build a random-weight Clef-Flash release at OUT in exactly the release layout (offline)."""
    from clef_model.fixtures import build_fixture

    if preset == "decisions":
        from clef_model.decision_fixture import build_decision_fixture

        if num_layers is not None:
            raise BlazeError("--num-layers does not apply to --preset decisions (its layers are trained).")
        click.echo(str(build_decision_fixture(out, seed=seed, force=force)))
        return
    path = build_fixture(out, preset, num_layers=num_layers, seed=seed, force=force)
    click.echo(str(path))
