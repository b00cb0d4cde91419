"""`blaze publish`: verification, refusal, dry run offline, and a real upload to a local Hub stand-in."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from hub_standin import HubStandIn
from test_card import make_variant

from variants.cli import main
from variants.publish import folder_files, verify_variant

TOKEN = "hf_blazeTestToken0123456789secret"


def _publish(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, ["publish", *args], env=env, catch_exceptions=False)


@pytest.fixture()
def variant(tiny_release: Path, tmp_path: Path) -> Path:
    return make_variant(tiny_release, tmp_path / "variant", base_ref="Cloudflare/clef-flash")


@pytest.fixture()
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The stand-in server, with huggingface_hub pointed at it: online (127.0.0.1 only) and xet off.

    Shards over 300 kB go through LFS multipart (100 kB parts), smaller ones through LFS basic transfer.
    """
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    with HubStandIn(tmp_path / "hub", multipart_threshold=300_000, multipart_chunk=100_000) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        yield server


def _assert_same_files(hub: HubStandIn, repo: str, branch: str, folder: Path) -> None:
    stored = hub.files(repo, branch)
    stored.pop(".gitattributes")  # created with the repo, as on the Hub
    local = {name for name, _ in folder_files(folder)}
    assert set(stored) == local
    for name, path in stored.items():
        assert path.read_bytes() == (folder / name).read_bytes(), name


def test_publish_uploads_folder_byte_for_byte(variant: Path, hub: HubStandIn):
    result = _publish(str(variant), "--repo", "you/clef-flash-concise", "--private")
    assert result.exit_code == 0, result.output
    assert (variant / "README.md").is_file()  # the card was rendered into the folder and uploaded
    _assert_same_files(hub, "you/clef-flash-concise", "main", variant)
    assert hub.repo("you/clef-flash-concise")["private"] is True
    paths = [(r.method, r.path) for r in hub.requests]
    assert any(p.endswith("/complete") for _, p in paths), "a shard should take the multipart LFS path"
    assert any(m == "PUT" and "/part/" not in p for m, p in paths), "a shard should take the basic LFS path"
    assert all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in hub.requests
               if r.path.startswith("/api/") and r.path != "/api/validate-yaml")
    assert "published" in result.output and TOKEN not in result.output


def test_token_is_never_written(variant: Path, hub: HubStandIn, tmp_path: Path):
    result = _publish(str(variant), "--repo", "you/concise")
    assert result.exit_code == 0, result.output
    needle = TOKEN.encode()
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and not [p for p in written if needle in p.read_bytes()]


def test_publish_to_new_branch(variant: Path, hub: HubStandIn):
    result = _publish(str(variant), "--repo", "you/concise", "--revision", "v1")
    assert result.exit_code == 0, result.output
    _assert_same_files(hub, "you/concise", "v1", variant)
    assert set(hub.files("you/concise", "main")) == {".gitattributes"}
    again = _publish(str(variant), "--repo", "you/concise", "--revision", "v1")  # repo and branch exist: fine
    assert again.exit_code == 0, again.output


def test_token_env_option(variant: Path, hub: HubStandIn, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HF_TOKEN")
    missing = _publish(str(variant), "--repo", "you/concise", "--token-env", "MY_HUB_TOKEN")
    assert missing.exit_code == 2 and "MY_HUB_TOKEN is not set" in missing.output
    monkeypatch.setenv("MY_HUB_TOKEN", "hf_other")
    result = _publish(str(variant), "--repo", "you/concise", "--token-env", "MY_HUB_TOKEN")
    assert result.exit_code == 0, result.output
    assert any(r.headers.get("authorization") == "Bearer hf_other" for r in hub.requests)


@pytest.mark.parametrize("spoil, message", [
    ({"gate_passes": False}, "the canary gate did not pass (failed: effect)"),
    ({"integrity_passes": False}, "the canary integrity check failed"),
    ({"canary": None}, "blaze_canary.json is missing"),
])
def test_refuses_failed_checks_unless_forced(tiny_release: Path, tmp_path: Path, hub: HubStandIn, spoil, message):
    folder = make_variant(tiny_release, tmp_path / "bad", **spoil)
    result = _publish(str(folder), "--repo", "you/bad")
    assert result.exit_code == 2 and message in result.output and "--force" in result.output
    assert hub.requests == [] and not (folder / "README.md").exists()  # nothing sent, nothing written
    forced = _publish(str(folder), "--repo", "you/bad", "--force")
    assert forced.exit_code == 0, forced.output
    assert "warning (--force)" in forced.output
    _assert_same_files(hub, "you/bad", "main", folder)


def test_refuses_changed_missing_or_unlisted_files(variant: Path):
    shard = next(variant.glob("model-0000*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    (variant / "generation_config.json").unlink()
    (variant / "notes.txt").write_text("stray file")
    problems = "\n".join(verify_variant(variant).problems)
    assert f"{shard.name}: SHA-256 differs from the manifest" in problems
    assert "generation_config.json: listed in the manifest but missing" in problems
    assert "notes.txt: not listed in the manifest" in problems
    (variant / "blaze_manifest.json").unlink()
    assert "blaze_manifest.json is missing" in "\n".join(verify_variant(variant).problems)


def test_dry_run_works_offline_and_changes_nothing(variant: Path):
    from huggingface_hub import constants

    assert os.environ.get("HF_HUB_OFFLINE") == "1" and constants.is_offline_mode()
    before = {p: p.stat().st_mtime_ns for p in variant.iterdir()}
    result = _publish(str(variant), "--repo", "you/concise", "--dry-run")
    assert result.exit_code == 0, result.output
    for name, size in folder_files(variant):
        line = next(l for l in result.output.splitlines() if l.strip().startswith(name + " "))
        value, unit = line.split()[1:3]
        scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}[unit]
        assert abs(float(value) * scale - size) <= 0.05 * scale, line  # printed size, rounded to 0.1 unit
    assert "README.md" in result.output and "(model card, generated)" in result.output
    assert "base_model_relation: finetune" in result.output and "## Observed behaviour shift" in result.output
    assert {p: p.stat().st_mtime_ns for p in variant.iterdir()} == before  # no card written, nothing touched


def test_upload_offline_is_a_clear_error(variant: Path):
    result = _publish(str(variant), "--repo", "you/concise")
    assert result.exit_code == 2 and "HF_HUB_OFFLINE is set" in result.output and "--dry-run" in result.output


def test_bad_repo_id(variant: Path):
    result = _publish(str(variant), "--repo", "no-namespace", "--dry-run")
    assert result.exit_code == 2 and "invalid repo id" in result.output


def test_edit_style_report_uses_manifest_side_file_check(tiny_release: Path, tmp_path: Path, hub: HubStandIn):
    """`blaze edit` stores its canary report inside the manifest without an integrity verdict."""
    import json

    folder = make_variant(tiny_release, tmp_path / "edit", canary="edit")
    assert "blaze_canary.json" in json.loads((folder / "blaze_manifest.json").read_text())["output"]["files"]
    result = _publish(str(folder), "--repo", "you/edited")
    assert result.exit_code == 0, result.output
    assert "side files checked against the base hashes in the manifest: identical" in result.output
    _assert_same_files(hub, "you/edited", "main", folder)


def test_edit_style_report_refuses_changed_joint_head(tiny_release: Path, tmp_path: Path):
    """A joint head that differs from the base's is refused even when the manifest was re-hashed to match."""
    import json

    from clef_model.checkpoint import sha256_file

    folder = make_variant(tiny_release, tmp_path / "edit", canary="edit")
    head = folder / "joint_head.safetensors"
    data = bytearray(head.read_bytes())
    data[-1] ^= 1
    head.write_bytes(bytes(data))
    manifest = json.loads((folder / "blaze_manifest.json").read_text())
    manifest["output"]["files"][head.name] = sha256_file(head)
    (folder / "blaze_manifest.json").write_text(json.dumps(manifest))
    result = _publish(str(folder), "--repo", "you/edited", "--dry-run")
    assert result.exit_code == 2
    assert "integrity: joint_head.safetensors: differs from the base's (SHA-256)" in result.output


def test_republishing_unchanged_folder_uploads_nothing(variant: Path, hub: HubStandIn):
    first = _publish(str(variant), "--repo", "you/concise")
    assert first.exit_code == 0, first.output
    before = len(hub.requests)
    again = _publish(str(variant), "--repo", "you/concise")
    assert again.exit_code == 0, again.output
    later = hub.requests[before:]
    assert not [r for r in later if r.method == "PUT" or "/commit/" in r.path]  # every file's oid matched
    _assert_same_files(hub, "you/concise", "main", variant)


def test_commit_message_names_the_behaviour(variant: Path, hub: HubStandIn):
    """The behaviour is stored at `edit.behavior`; the upload's commit message names it."""
    result = _publish(str(variant), "--repo", "you/concise")
    assert result.exit_code == 0, result.output
    assert hub.state.commit_messages == ["blaze: publish verbosity variant"]


def test_report_of_other_weights_is_refused_own_report_accepted(tiny_release: Path, tmp_path: Path):
    """A passing report copied from another variant is refused (it names that variant's manifest)."""
    import shutil

    own = make_variant(tiny_release, tmp_path / "own")
    other = make_variant(tiny_release, tmp_path / "other")
    accepted = _publish(str(own), "--repo", "you/own", "--dry-run")
    assert accepted.exit_code == 0, accepted.output
    assert "Canary gate: passed" in accepted.output

    # another variant: its manifest says another strength, so it is other weights than `own`
    manifest = json.loads((other / "blaze_manifest.json").read_text())
    manifest["edit"]["strength"] = 0.3
    (other / "blaze_manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    shutil.copyfile(own / "blaze_canary.json", other / "blaze_canary.json")  # the transplant
    refused = _publish(str(other), "--repo", "you/other", "--dry-run")
    assert refused.exit_code == 2
    assert "blaze_canary.json belongs to other weights" in refused.output and "re-run `blaze canary" in refused.output
    assert "Traceback" not in refused.output


def test_report_that_names_no_weights_is_refused(variant: Path):
    report = json.loads((variant / "blaze_canary.json").read_text())
    del report["meta"]["variant_manifest_sha256"]
    (variant / "blaze_canary.json").write_text(json.dumps(report))
    result = _publish(str(variant), "--repo", "you/concise", "--dry-run")
    assert result.exit_code == 2 and "does not record which weights it was run on" in result.output


def test_edit_report_replaced_by_a_later_canary_run_is_accepted(tiny_release: Path, tmp_path: Path):
    """`blaze canary` over an edit's folder replaces the listed report; its manifest hash binds it instead."""
    from test_card import canary_report

    from canaries.integrity import REPORT_MANIFEST_KEY, manifest_sha256

    folder = make_variant(tiny_release, tmp_path / "edit", canary="edit")
    report = canary_report()
    report.setdefault("meta", {})[REPORT_MANIFEST_KEY] = manifest_sha256(folder)
    (folder / "blaze_canary.json").write_text(json.dumps(report))
    result = _publish(str(folder), "--repo", "you/edited", "--dry-run")
    assert result.exit_code == 0, result.output


def test_failed_upload_leaves_no_card_behind(variant: Path, hub: HubStandIn):
    hub.state.fail_commits = True
    result = _publish(str(variant), "--repo", "you/concise")
    assert result.exit_code == 2 and "upload to you/concise failed (HTTP 500)" in result.output
    assert not (variant / "README.md").exists()
    assert not [p.name for p in variant.iterdir() if p.name.startswith(".")]  # no temp file either


def test_failed_upload_puts_the_earlier_card_back(variant: Path, hub: HubStandIn):
    """A folder that already held a README.md (e.g. the base's card, copied along) gets it back unchanged."""
    (variant / "README.md").write_text("the base's card\n")
    hub.state.fail_commits = True
    result = _publish(str(variant), "--repo", "you/concise")
    assert result.exit_code == 2
    assert (variant / "README.md").read_text() == "the base's card\n"


def test_wrong_hashes_name_the_files_not_a_cause(variant: Path):
    """A manifest whose recorded hashes are wrong: the message names each file, and does not claim an edit."""
    manifest = json.loads((variant / "blaze_manifest.json").read_text())
    wrong = sorted(name for name in manifest["output"]["files"] if name.endswith(".json"))[:2]
    for name in wrong:
        manifest["output"]["files"][name] = "0" * 64
    (variant / "blaze_manifest.json").write_text(json.dumps(manifest))
    result = _publish(str(variant), "--repo", "you/concise", "--dry-run")
    assert result.exit_code == 2
    for name in wrong:
        assert f"{name}: SHA-256 differs from the manifest's" in result.output
    assert "changed after the edit" not in result.output


def test_blaze_canary_report_is_bound_to_its_variant(tiny_release: Path, tmp_path: Path):
    """`blaze canary --json` records the variant's manifest SHA-256; publish accepts it there and nowhere else."""
    import shutil

    from canaries.integrity import manifest_sha256
    from canaries.suites import default_decision_suite

    folder = make_variant(tiny_release, tmp_path / "variant", canary=None)
    chat, requests = tmp_path / "chat.jsonl", tmp_path / "requests.jsonl"
    chat.write_text(json.dumps({"prompt": "What is the speed of light?", "keywords": ["299"]}) + "\n")
    request = {k: v for k, v in default_decision_suite()[0].items() if k != "images"}
    requests.write_text(json.dumps(request) + "\n")
    ran = CliRunner().invoke(main, [
        "canary", str(folder), "--against", str(tiny_release), "--suite", str(chat), "--suite", str(requests),
        "--max-new-tokens", "4", "--damage-tokens", "4", "--device", "cpu", "--no-prompted", "--effect", "none",
        "--max-first-token-kl", "10", "--max-mean-token-kl", "10", "--max-decision-drift", "1",
        "--max-argmax-flips", "100", "--json", str(folder / "blaze_canary.json"),
        "--markdown", str(folder / "blaze_canary.md")], catch_exceptions=False)
    assert ran.exit_code == 0, ran.output
    report = json.loads((folder / "blaze_canary.json").read_text())
    assert report["meta"]["variant_manifest_sha256"] == manifest_sha256(folder)
    assert verify_variant(folder).problems == []

    other = make_variant(tiny_release, tmp_path / "other", canary=None)
    manifest = json.loads((other / "blaze_manifest.json").read_text())
    manifest["edit"]["rank"] = 2  # another variant's manifest
    (other / "blaze_manifest.json").write_text(json.dumps(manifest))
    for name in ("blaze_canary.json", "blaze_canary.md"):
        shutil.copyfile(folder / name, other / name)
    assert any("belongs to other weights" in p for p in verify_variant(other).problems)


def test_damaged_manifest_is_a_clear_refusal(variant: Path):
    manifest = json.loads((variant / "blaze_manifest.json").read_text())
    manifest["blaze_manifest"] = 2
    (variant / "blaze_manifest.json").write_text(json.dumps(manifest))
    newer = _publish(str(variant), "--repo", "you/concise", "--dry-run")
    assert newer.exit_code == 2 and "written by a newer blaze" in newer.output and "Traceback" not in newer.output
    (variant / "blaze_manifest.json").write_text("{broken")
    broken = _publish(str(variant), "--repo", "you/concise", "--dry-run")
    assert broken.exit_code == 2 and "is not valid JSON" in broken.output and "Traceback" not in broken.output
