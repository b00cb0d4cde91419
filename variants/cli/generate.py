"""`blaze generate`: answer a prompt with a release's backbone (greedy, the release's chat template)."""

from __future__ import annotations

import click

from variants.cli.options import load_runtime, runtime_options


@click.command("generate")
@click.argument("ref")
@click.argument("prompt")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1),
              help="Stop after this many new tokens.")
@click.option("--system", default=None, help="A system prompt placed before the user message.")
@click.option("--stats", is_flag=True, help="Also print token counts to stderr.")
@runtime_options
def generate(ref: str, prompt: str, max_new_tokens: int, system: str | None, stats: bool, revision: str | None,
             device: str | None, trust_release_code: bool) -> None:
    """Answer PROMPT with REF's backbone (greedy, the release's chat template, thinking off).

    REF: a release folder, a Hub id, or `smollm2`.
    """
    runtime = load_runtime(ref, revision, device, trust_release_code)
    generation = runtime.generate([prompt], max_new_tokens=max_new_tokens, system=system)[0]
    click.echo(generation.text)
    if stats:
        click.echo(
            f"prompt tokens {generation.prompt_tokens}, new tokens {generation.new_tokens}"
            + (" (hit --max-new-tokens)" if generation.hit_limit else ""),
            err=True,
        )
