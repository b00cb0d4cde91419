"""`blaze edit`: make a behaviour variant (statistics → closed-form solve → strength search → variant + canary)."""

from __future__ import annotations

from pathlib import Path

import click


def _strength(value: str | None) -> float | str | None:
    if value is None or value == "auto":
        return value
    try:
        return float(value)
    except ValueError:
        raise click.BadParameter("a number (e.g. 0.15) or 'auto'") from None


def register(group: click.Group) -> None:
    """Add `edit` to the blaze group."""

    @group.command("edit")
    @click.option("--behavior", "-b", required=True,
                  help="Behaviour spec: a catalogue name (see `blaze behaviors`) or a path to a spec JSON file.")
    @click.option("--out", "-o", required=True, type=click.Path(path_type=Path),
                  help="Output folder for the variant (a drop-in release). Refused if not empty, unless --force.")
    @click.option("--base", default=None,
                  help="Base release: a folder, a Hub id, or `smollm2` (the embedded SmolLM2-135M-Instruct). "
                       "Default: Cloudflare/clef-flash.")
    @click.option("--revision", default=None, help="Hub revision of the base (branch, tag or commit).")
    @click.option("--method", type=click.Choice(["steer", "nullspace", "ablate"]), default=None,
                  help="steer: ridge edit with a penalty on preserved inputs; nullspace: edit only in the null "
                       "space of preserved inputs (AlphaEdit); ablate: remove the direction (Arditi et al.). "
                       "Default: the spec's.")
    @click.option("--rank", type=int, default=None, help="Rank k of each matrix's edit ΔW = U Vᵀ. Default: the spec's.")
    @click.option("--strength", default=None,
                  help="Strength α, or `auto` to sweep the spec's grid on its validation prompts and keep the "
                       "strongest edit that passes the gate. α = shift each edited layer adds at the mean "
                       "behaviour input, as a fraction of that layer's contrastive mean difference "
                       "(docs/METHOD.md). Default: the spec's.")
    @click.option("--layers", default=None,
                  help="Layers to edit: `8-24`, fractions of the depth `0.4-0.8`, lists `3,5,7`, or `auto` "
                       "(best contiguous band by separation score). Default: the spec's.")
    @click.option("--kinds", default=None,
                  help="Matrices: `writers` (o_proj/out_proj/down_proj), `readers`, `all`, or names such as "
                       "`mlp.down_proj`. Default: the spec's.")
    @click.option("--lambda", "lam", type=float, default=None,
                  help="Weight of the preserved-input penalty in `steer` (0 = none). Default: the spec's.")
    @click.option("--threshold", type=float, default=None,
                  help="`nullspace`: eigenvalues of the preserved inputs' second moment below threshold × the "
                       "largest count as null. Default: the spec's.")
    @click.option("--device", default=None, help="cuda, cpu, cuda:1, … Default: cuda when available.")
    @click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default=None,
                  help="Compute dtype. Default: bfloat16 on CUDA, float32 on CPU.")
    @click.option("--batch-size", type=int, default=8, show_default=True, help="Sequences per forward pass.")
    @click.option("--force", is_flag=True, help="Overwrite a non-empty --out folder.")
    @click.option("--no-canary", is_flag=True, help="Skip the final canary (held-out + general suites).")
    @click.option("--export-lora", type=click.Path(path_type=Path), default=None,
                  help="Also write a PEFT LoRA adapter equal to the edit into this folder.")
    @click.option("--trust-release-code", is_flag=True,
                  help="Run a base's release code even if its SHA-256 is not on blaze's allowlist.")
    @click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
                  help="Where activation statistics are cached (default: $BLAZE_CACHE or ~/.cache/blaze).")
    def edit(behavior, out, base, revision, method, rank, strength, layers, kinds, lam, threshold, device, dtype,
             batch_size, force, no_canary, export_lora, trust_release_code, cache_dir) -> None:
        """Make a behaviour variant of a base release by closed-form, rank-limited weight edits.

        \b
        Example:
          blaze edit --behavior verbosity --out ./clef-flash-concise
          blaze edit --base smollm2 --behavior verbosity --out ./smollm2-concise --device cpu
        """
        from clef_model.env import quiet
        from variants.build import BuildOptions, build_variant

        build_variant(BuildOptions(
            behavior=behavior, out=out, base=base, revision=revision, method=method, rank=rank,
            strength=_strength(strength), layers=layers, kinds=kinds, lam=lam, threshold=threshold, device=device,
            dtype=dtype, force=force, canary=not no_canary, export_lora=export_lora,
            trust_release_code=trust_release_code, batch_size=batch_size, cache_dir=cache_dir,
            progress=not quiet(),
        ), echo=lambda message: click.echo(message, err=True))
