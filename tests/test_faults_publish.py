"""The standing fault suite, `blaze publish` part (issue 14): kill -9 at each step of an upload.

`blaze publish` runs in a child process against the local Hub stand-in (`hub_standin.py`). The stand-in
holds one request of a chosen kind (repo creation, preupload, LFS batch, an LFS part, a basic LFS put,
the commit) until the test has killed the child with SIGKILL, then answers it to a closed socket. After
each kill:

- the repo holds no upload that looks complete: before the commit it holds nothing of the variant; a
  commit already sent is applied whole or not at all (publish makes ONE commit, atomic on the Hub);
- the variant folder is byte for byte as it was (no `README.md` card, no temporary file);
- the base is unchanged;
- a rerun succeeds and uploads the folder byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner
from hub_standin import HubStandIn
from test_card import make_variant

from variants.cli import main
from variants.publish import folder_files

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_blazeFaultToken0123456789"
REPO = "you/clef-flash-killed"
_RUN = "import sys\nfrom variants.cli import main\nmain(sys.argv[1:], prog_name='blaze')\n"


def _tree(folder: Path) -> dict[str, str]:
    """Every file under `folder`, hidden ones included, with its SHA-256."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@dataclass
class Hold:
    """Hold the `nth` request `method` + path pattern until `release` is set; `arrived` when it is held."""

    method: str
    pattern: str
    nth: int = 1
    seen: int = 0
    arrived: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _hold_requests(hub: HubStandIn, hold: Hold) -> None:
    """Swap the stand-in's request handler for one that holds the request `hold` names."""
    base = hub._server.RequestHandlerClass

    class Held(base):  # type: ignore[misc, valid-type]
        def _dispatch(self, method: str) -> None:
            if method != hold.method or not re.fullmatch(hold.pattern, urlsplit(self.path).path):
                return super()._dispatch(method)
            with hold.lock:
                hold.seen += 1
                mine = hold.seen == hold.nth
            if not mine:
                return super()._dispatch(method)
            hold.arrived.set()
            hold.release.wait(120)
            try:  # the client is dead: whatever it had sent is read and answered to a closed socket
                super()._dispatch(method)
            except Exception:  # noqa: BLE001, S110 - a broken pipe or a cut body; the server carries on
                pass
            finally:
                hold.done.set()

    hub._server.RequestHandlerClass = Held


@pytest.fixture()
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The stand-in, online for huggingface_hub (127.0.0.1 only, xet off); shards go multipart in 100 kB parts."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("BLAZE_CACHE", str(tmp_path / "blaze-cache"))
    with HubStandIn(tmp_path / "hub", multipart_threshold=300_000, multipart_chunk=100_000) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        yield server


def _spawn_publish(variant: Path, hub: HubStandIn, log: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "0",
           "HF_HUB_DISABLE_XET": "1", "BLAZE_QUIET": "1", "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-c", _RUN, "publish", str(variant), "--repo", REPO],
                                env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def _uploaded(hub: HubStandIn, variant: Path) -> str:
    """"nothing" (no file of the variant on main), "whole" (every file, byte for byte), or "part"."""
    if REPO not in hub.state.repos:
        return "nothing"
    stored = hub.files(REPO)
    stored.pop(".gitattributes", None)
    if not stored:
        return "nothing"
    local = {name for name, _ in folder_files(variant)}
    if set(stored) == local | {"README.md"} and all(
            path.read_bytes() == (variant / name).read_bytes() for name, path in stored.items() if name != "README.md"):
        return "whole"
    return "part"


POINTS = {
    "repo creation": Hold("POST", r"/api/repos/create"),
    "preupload": Hold("POST", r"/api/models/[^/]+/[^/]+/preupload/[^/]+"),
    "LFS batch": Hold("POST", r"/[^/]+/[^/]+\.git/info/lfs/objects/batch"),
    "LFS multipart, second part": Hold("PUT", r"/_lfs/[0-9a-f]{64}/part/\d+", nth=2),
    "LFS basic put": Hold("PUT", r"/_lfs/[0-9a-f]{64}"),
    "commit": Hold("POST", r"/api/models/[^/]+/[^/]+/commit/[^/]+"),
}
# Each case takes ~12 s on 2 cores (a child process plus a rerun): the steps before any data is sent are slow.
SLOW_POINTS = {"repo creation", "LFS batch"}


@pytest.mark.parametrize("point", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_POINTS else p
                                   for p in POINTS])
def test_publish_killed_with_sigkill_then_rerun(tiny_release: Path, tmp_path: Path, hub: HubStandIn, point: str):
    spec = POINTS[point]
    hold = Hold(spec.method, spec.pattern, spec.nth)
    _hold_requests(hub, hold)
    variant = make_variant(tiny_release, tmp_path / "variant", base_ref="Cloudflare/clef-flash")
    variant_before, base_before = _tree(variant), _tree(tiny_release)
    log = tmp_path / "publish.log"
    process = _spawn_publish(variant, hub, log)
    try:
        if not hold.arrived.wait(180):
            raise AssertionError(f"publish never reached the {point}: {log.read_text()}")
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL
    finally:
        process.kill()
        hold.release.set()
    assert hold.done.wait(30)

    state = _uploaded(hub, variant)
    if point == "commit":  # the commit request was sent whole: the Hub applies it whole, or not at all
        assert state in ("nothing", "whole")
    else:
        assert state == "nothing" and hub.state.commits == 0
    assert _tree(variant) == variant_before  # no card, no temporary file, nothing changed
    assert _tree(tiny_release) == base_before

    rerun = CliRunner().invoke(main, ["publish", str(variant), "--repo", REPO], catch_exceptions=False)
    assert rerun.exit_code == 0, rerun.output
    assert _uploaded(hub, variant) == "whole"
    assert hub.state.commits == 1  # the whole variant in one commit (a rerun after a landed commit adds none)
    assert (variant / "README.md").read_bytes() == hub.files(REPO)["README.md"].read_bytes()
    assert set(_tree(variant)) == set(variant_before) | {"README.md"}  # the card and nothing else was added
    assert _tree(tiny_release) == base_before
