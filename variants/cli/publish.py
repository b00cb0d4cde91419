"""`blaze publish`: upload a variant folder to the Hugging Face Hub with a generated model card."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("publish")
@click.argument("variant", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--repo", "repo_id", required=True, help="Hub repo id to publish to, NAMESPACE/NAME.")
@click.option("--private", is_flag=True, help="Create the repo private (applies when the repo is created).")
@click.option("--revision", default=None, help="Branch to upload to (created from main when new). Default: main.")
@click.option("--dry-run", is_flag=True, help="Print the file list and the model card; no upload, works offline.")
@click.option("--force", is_flag=True, help="Publish even if the manifest, canary gate or integrity checks fail.")
@click.option("--token-env", default="HF_TOKEN", show_default=True,
              help="Environment variable holding the Hub token (else huggingface_hub's stored login). "
                   "The token is never written anywhere.")
def publish(variant: Path, repo_id: str, private: bool, revision: str | None, dry_run: bool, force: bool,
            token_env: str) -> None:
    """Upload a variant folder to the Hugging Face Hub with a generated model card (README.md).

    Refuses a folder whose files do not match blaze_manifest.json, or whose canary report
    (blaze_canary.json) is missing, failed its gate or failed integrity — unless --force.
    HF_ENDPOINT selects another Hub endpoint.
    """
    from variants.publish import publish as upload

    upload(variant, repo_id, private=private, revision=revision, dry_run=dry_run, force=force,
           token_env=token_env, echo=click.echo)
