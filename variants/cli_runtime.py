"""`blaze generate`, `blaze systemone`, `blaze fixture`: run a release both ways, and build test releases."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from clef_model.errors import BlazeError

_REF_HELP = "A release folder, a Hub id (default base: Cloudflare/clef-flash), or `smollm2` (embedded)."


def _runtime_options(command):
    """Options shared by the commands that load a release."""
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


def _load(ref: str, revision: str | None, device: str | None, trust_release_code: bool):
    from clef_model.runtime import Runtime

    return Runtime.load(ref, revision=revision, device=device, trust_release_code=trust_release_code)


def _read_requests(source: str) -> object:
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except OSError as error:
        raise BlazeError(f"cannot read {source} ({error.strerror}); pass a JSON request file or - for stdin.") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise BlazeError(f"{source} is not valid JSON ({error.msg} at line {error.lineno}); fix the request file.") from None


def register(group: click.Group) -> None:
    """Add `generate`, `systemone` and `fixture` to the blaze group."""

    @group.command("generate")
    @click.argument("ref")
    @click.argument("prompt")
    @click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1),
                  help="Stop after this many new tokens.")
    @click.option("--system", default=None, help="A system prompt placed before the user message.")
    @click.option("--stats", is_flag=True, help="Also print token counts to stderr.")
    @_runtime_options
    def generate(ref, prompt, max_new_tokens, system, stats, revision, device, trust_release_code):
        """Answer PROMPT with REF's backbone (greedy, the release's chat template, thinking off).

        REF: a release folder, a Hub id, or `smollm2`.
        """
        runtime = _load(ref, revision, device, trust_release_code)
        generation = runtime.generate([prompt], max_new_tokens=max_new_tokens, system=system)[0]
        click.echo(generation.text)
        if stats:
            click.echo(
                f"prompt tokens {generation.prompt_tokens}, new tokens {generation.new_tokens}"
                + (" (hit --max-new-tokens)" if generation.hit_limit else ""),
                err=True,
            )

    @group.command("systemone")
    @click.argument("ref")
    @click.argument("request", metavar="REQUEST.json")
    @click.option("--batch-size", default=8, show_default=True, type=click.IntRange(min=1),
                  help="Requests per forward pass when the file holds a list of requests.")
    @click.option("--indent", default=None, type=click.IntRange(min=0),
                  help="Pretty-print the JSON with this indent (default: one line, like the API).")
    @_runtime_options
    def systemone(ref, request, batch_size, indent, revision, device, trust_release_code):
        """Answer a SystemOne request (JSON file, or - for stdin) with REF's joint head.

        Prints the response body exactly as the release's own `systemone` returns it. A file holding a
        JSON list of requests is answered in batches and printed as a list.
        """
        body = _read_requests(request)
        runtime = _load(ref, revision, device, trust_release_code)
        try:
            if isinstance(body, list):
                response = runtime.systemone_batch(body, batch_size=batch_size)
            else:
                response = runtime.systemone(body)
        except ValueError as error:
            raise BlazeError(f"invalid SystemOne request: {error}") from None
        click.echo(json.dumps(response, ensure_ascii=False, indent=indent))

    @group.command("fixture")
    @click.argument("out", type=click.Path(path_type=Path))
    @click.option("--preset", type=click.Choice(["tiny", "9b", "decisions"]), default="tiny", show_default=True,
                  help="tiny: small widths, runs anywhere in seconds; 9b: the real Qwen3.5-9B shapes (≈19.3 GB); "
                       "decisions: the tiny release with trained typed decisions (clef-finetune) and a held-out "
                       "labelled decision_eval.jsonl (first build ≤ 3 min on CPU, then cached).")
    @click.option("--num-layers", default=None, type=click.IntRange(min=1),
                  help="Keep only the first N decoder layers (for benchmarks).")
    @click.option("--seed", default=0, show_default=True, type=int, help="Random seed; the same seed gives the same bytes.")
    @click.option("--force", is_flag=True, help="Replace a non-empty OUT.")
    def fixture(out, preset, num_layers, seed, force):
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
