"""A local stand-in for the Hugging Face Hub API, enough for `huggingface_hub`'s upload path.

It serves, on 127.0.0.1, the endpoints that ``HfApi.create_repo``, ``create_branch`` and
``upload_folder``/``create_commit`` call (checked against huggingface_hub 2.4's client code):

- ``POST /api/repos/create``                              create a model repo (409 + url when it exists)
- ``GET  /api/models/{repo}[/revision/{rev}]``            repo info (after a commit with nothing new)
- ``POST /api/validate-yaml``                             README front matter check (parsed with PyYAML)
- ``POST /api/models/{repo}/branch/{branch}``             create a branch from main (or ``startingPoint``)
- ``POST /api/models/{repo}/preupload/{revision}``        upload mode per file ("lfs"/"regular") + current oid
- ``POST /{repo}.git/info/lfs/objects/batch``             LFS batch: basic transfer, or multipart over a size
- ``PUT  /_lfs/{oid}`` / ``PUT /_lfs/{oid}/part/{n}``      object upload (sha256 checked) / one part
- ``POST /_lfs/{oid}/complete`` / ``POST /_lfs/{oid}/verify``   multipart completion / verify
- ``POST /api/models/{repo}/commit/{revision}``           ndjson commit: file (base64), lfsFile, deletedFile

Xet storage is a client-side choice (``huggingface_hub`` uses it whenever ``hf_xet`` is importable unless
``HF_HUB_DISABLE_XET`` is set): tests that talk to this server must disable it (``constants.HF_HUB_DISABLE_XET``).
The server never hands out xet tokens, so a client that tried xet would fail loudly rather than silently.

Files land on disk as ``root/repos/{namespace}/{name}/{branch}/{path}`` so tests compare them byte for byte.
Every request is recorded (method, path, headers) for assertions.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import yaml

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".onnx", ".msgpack", ".zip",
                ".tar", ".gz", ".npy", ".npz", ".pkl", ".model")
INITIAL_GITATTRIBUTES = b"".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n".encode() for s in LFS_SUFFIXES)


@dataclass
class Request:
    """One request the server saw."""

    method: str
    path: str
    headers: dict[str, str]
    body_size: int


@dataclass
class HubState:
    """Repos (branches on disk), LFS objects, and the request log."""

    root: Path
    lfs_threshold: int
    multipart_threshold: int
    multipart_chunk: int
    repos: dict[str, dict[str, Any]] = field(default_factory=dict)  # repo_id -> {"private", "branches": {b: sha}}
    requests: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    commits: int = 0
    commit_messages: list[str] = field(default_factory=list)  # each commit's summary, in order
    fail_commits: bool = False  # answer every commit with HTTP 500 (tests of a failed upload)

    def branch_dir(self, repo_id: str, branch: str) -> Path:
        return self.root / "repos" / repo_id / branch

    def lfs_path(self, oid: str) -> Path:
        return self.root / "lfs" / oid


class HubStandIn:
    """Run the stand-in in a background thread: ``with HubStandIn(tmp) as hub: HfApi(endpoint=hub.url)``."""

    def __init__(self, root: Path, *, lfs_threshold: int = 10 * 1024 * 1024,
                 multipart_threshold: int = 1 << 62, multipart_chunk: int = 1 << 20) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.state = HubState(root, lfs_threshold, multipart_threshold, multipart_chunk)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self.state))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    @property
    def requests(self) -> list[Request]:
        return list(self.state.requests)

    def repo(self, repo_id: str) -> dict[str, Any]:
        return self.state.repos[repo_id]

    def files(self, repo_id: str, branch: str = "main") -> dict[str, Path]:
        """Relative path -> stored file, for one branch of a repo."""
        base = self.state.branch_dir(repo_id, branch)
        return {p.relative_to(base).as_posix(): p for p in sorted(base.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------------------------------


def _make_handler(state: HubState) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        hub = state

    return Handler


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, extra: dict | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.extra, self.code = status, message, extra or {}, code


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: HubState

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence stderr logging
        pass

    # -- plumbing -----------------------------------------------------------------------------------

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))

    def _send(self, status: int, payload: Any = None, headers: dict[str, str] | None = None) -> None:
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _dispatch(self, method: str) -> None:
        body = self._body()
        path = urlsplit(self.path).path
        with self.hub.lock:
            self.hub.requests.append(Request(method, path, dict(self.headers.items()), len(body)))
        try:
            for pattern, handler_method, handler in _ROUTES:
                match = re.fullmatch(pattern, path)
                if match and handler_method == method:
                    status, payload, headers = handler(self, body, *[unquote(g) for g in match.groups()])
                    self._send(status, payload, headers)
                    return
            raise _HTTPError(404, f"no route for {method} {path}")
        except _HTTPError as error:
            headers = {"X-Error-Message": error.message}
            if error.code:
                headers["X-Error-Code"] = error.code
            self._send(error.status, {"error": error.message, **error.extra}, headers)

    def do_GET(self) -> None:  # noqa: N802
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    # -- helpers ------------------------------------------------------------------------------------

    def _base(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def _require_auth(self) -> None:
        if not self.headers.get("authorization", "").startswith("Bearer "):
            raise _HTTPError(401, "Invalid credentials in Authorization header")

    def _repo(self, repo_id: str, revision: str | None = None) -> dict:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            raise _HTTPError(404, "Repository not found", code="RepoNotFound")
        if revision is not None and revision not in repo["branches"]:
            raise _HTTPError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
        return repo


def _json(body: bytes) -> dict:
    try:
        return json.loads(body or b"{}")
    except json.JSONDecodeError as error:
        raise _HTTPError(400, f"invalid JSON body: {error}") from None


def _create_repo(h: _Handler, body: bytes):
    h._require_auth()
    payload = _json(body)
    if payload.get("type", "model") != "model":
        raise _HTTPError(400, "the stand-in serves model repos only")
    repo_id = f"{payload.get('organization') or 'user'}/{payload['name']}"
    url = f"{h._base()}/{repo_id}"
    with h.hub.lock:
        if repo_id in h.hub.repos:
            raise _HTTPError(409, "You already created this model repo", {"url": url})
        h.hub.repos[repo_id] = {"private": payload.get("visibility") == "private" or bool(payload.get("private")),
                                "branches": {"main": "0" * 40}}
        main = h.hub.branch_dir(repo_id, "main")
        main.mkdir(parents=True)
        (main / ".gitattributes").write_bytes(INITIAL_GITATTRIBUTES)
    return 200, {"url": url, "name": repo_id, "id": repo_id}, None


def _validate_yaml(h: _Handler, body: bytes):
    content = _json(body).get("content", "")
    match = re.match(r"\A---\n(.*?)\n---\n", content, re.S)
    if match is None:
        return 200, {"errors": [], "warnings": [{"message": "empty or missing yaml metadata in repo card"}]}, None
    try:
        meta = yaml.safe_load(match.group(1))
    except yaml.YAMLError as error:
        return 400, {"errors": [{"message": f"invalid YAML: {error}"}]}, None
    if not isinstance(meta, dict):
        return 400, {"errors": [{"message": "metadata must be a YAML mapping"}]}, None
    return 200, {"errors": [], "warnings": []}, None


def _create_branch(h: _Handler, body: bytes, repo_id: str, branch: str):
    h._require_auth()
    start = _json(body).get("startingPoint") or "main"
    repo = h._repo(repo_id, start)
    with h.hub.lock:
        if branch in repo["branches"]:
            raise _HTTPError(409, f"Reference already exists: refs/heads/{branch}")
        shutil.copytree(h.hub.branch_dir(repo_id, start), h.hub.branch_dir(repo_id, branch))
        repo["branches"][branch] = repo["branches"][start]
    return 200, {}, None


def _preupload(h: _Handler, body: bytes, repo_id: str, revision: str):
    h._require_auth()
    h._repo(repo_id, revision)
    files = []
    folder = h.hub.branch_dir(repo_id, revision)
    for item in _json(body).get("files", []):
        path, size = item["path"], int(item["size"])
        lfs = size >= h.hub.lfs_threshold or path.endswith(LFS_SUFFIXES)
        stored = folder / path
        oid = None
        if stored.is_file():  # the Hub reports the current oid so unchanged files are skipped
            data = stored.read_bytes()
            oid = hashlib.sha256(data).hexdigest() if lfs else _git_blob_sha1(data)
        files.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
    return 200, {"files": files, "commitOid": "0" * 40}, None


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _repo_info(h: _Handler, body: bytes, repo_id: str, revision: str = "main"):
    repo = h._repo(repo_id, revision)
    folder = h.hub.branch_dir(repo_id, revision)
    siblings = [{"rfilename": p.relative_to(folder).as_posix()} for p in sorted(folder.rglob("*")) if p.is_file()]
    return 200, {"id": repo_id, "modelId": repo_id, "sha": repo["branches"][revision], "private": repo["private"],
                 "siblings": siblings}, None


def _lfs_batch(h: _Handler, body: bytes, repo_id: str):
    h._require_auth()
    payload = _json(body)
    if payload.get("operation") != "upload":
        raise _HTTPError(400, "only upload batches are supported")
    if "basic" not in payload.get("transfers", ["basic"]):
        raise _HTTPError(400, "the stand-in offers basic and multipart transfers only (xet is not served)")
    h._repo(repo_id, (payload.get("ref") or {}).get("name"))
    objects = []
    for obj in payload.get("objects", []):
        oid, size = obj["oid"], int(obj["size"])
        entry: dict[str, Any] = {"oid": oid, "size": size}
        if not h.hub.lfs_path(oid).is_file():
            base = f"{h._base()}/_lfs/{oid}"
            verify = {"href": f"{base}/verify", "header": {}}
            if size > h.hub.multipart_threshold and "multipart" in payload.get("transfers", []):
                chunk = h.hub.multipart_chunk
                parts = {str(i + 1): f"{base}/part/{i + 1}" for i in range(-(-size // chunk))}
                entry["actions"] = {"upload": {"href": f"{base}/complete", "header": {"chunk_size": str(chunk),
                                                                                      **parts}},
                                    "verify": verify}
            else:
                entry["actions"] = {"upload": {"href": base, "header": {}}, "verify": verify}
        objects.append(entry)
    return 200, {"transfer": "basic", "objects": objects}, None


def _store_lfs(h: _Handler, oid: str, data: bytes) -> None:
    if hashlib.sha256(data).hexdigest() != oid:
        raise _HTTPError(400, f"uploaded bytes do not hash to {oid}")
    path = h.hub.lfs_path(oid)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _lfs_put(h: _Handler, body: bytes, oid: str):
    _store_lfs(h, oid, body)
    return 200, None, None


def _lfs_put_part(h: _Handler, body: bytes, oid: str, part: str):
    path = h.hub.root / "parts" / oid / f"{int(part):06d}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body)
    return 200, None, {"ETag": f'"{hashlib.md5(body).hexdigest()}"'}


def _lfs_complete(h: _Handler, body: bytes, oid: str):
    payload = _json(body)
    if payload.get("oid") != oid:
        raise _HTTPError(400, "completion oid mismatch")
    folder = h.hub.root / "parts" / oid
    data = b""
    for part in sorted(payload["parts"], key=lambda p: p["partNumber"]):
        chunk = (folder / f"{part['partNumber']:06d}").read_bytes()
        if part["etag"].strip('"') != hashlib.md5(chunk).hexdigest():
            raise _HTTPError(400, f"etag mismatch for part {part['partNumber']}")
        data += chunk
    _store_lfs(h, oid, data)
    shutil.rmtree(folder)
    return 200, {}, None


def _lfs_verify(h: _Handler, body: bytes, oid: str):
    payload = _json(body)
    path = h.hub.lfs_path(oid)
    if not path.is_file() or path.stat().st_size != int(payload.get("size", -1)):
        raise _HTTPError(404, f"object {oid} not stored or size differs")
    return 200, {}, None


def _commit(h: _Handler, body: bytes, repo_id: str, revision: str):
    h._require_auth()
    repo = h._repo(repo_id, revision)
    lines = [json.loads(line) for line in body.splitlines() if line.strip()]
    if not lines or lines[0].get("key") != "header":
        raise _HTTPError(400, "commit payload must start with a header line")
    if h.hub.fail_commits:
        raise _HTTPError(500, "the stand-in was told to fail commits")
    staged: list[tuple[str, str, Any]] = []
    for line in lines[1:]:
        key, value = line["key"], line["value"]
        path = value["path"]
        if path.startswith("/") or ".." in Path(path).parts:
            raise _HTTPError(400, f"invalid path {path!r}")
        if key == "file":
            if value.get("encoding") != "base64":
                raise _HTTPError(400, "file content must be base64")
            staged.append(("write", path, base64.b64decode(value["content"])))
        elif key == "lfsFile":
            lfs = h.hub.lfs_path(value["oid"])
            if not lfs.is_file() or lfs.stat().st_size != int(value["size"]):
                raise _HTTPError(422, f"LFS object {value['oid']} for {path} was never uploaded")
            staged.append(("copy", path, lfs))
        elif key == "deletedFile":
            staged.append(("delete", path, None))
        else:
            raise _HTTPError(400, f"unsupported commit operation {key!r}")
    with h.hub.lock:
        folder = h.hub.branch_dir(repo_id, revision)
        for action, path, source in staged:
            target = folder / path
            if action == "delete":
                target.unlink(missing_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if action == "write":
                target.write_bytes(source)
            else:
                shutil.copyfile(source, target)
        h.hub.commits += 1
        h.hub.commit_messages.append(str(lines[0]["value"].get("summary", "")))
        oid = hashlib.sha1(f"{repo_id}:{revision}:{h.hub.commits}".encode()).hexdigest()
        repo["branches"][revision] = oid
    return 200, {"commitUrl": f"{h._base()}/{repo_id}/commit/{oid}", "commitOid": oid,
                 "pullRequestUrl": None, "success": True}, None


_REPO = r"([^/]+/[^/]+)"
_ROUTES = [
    (r"/api/repos/create", "POST", _create_repo),
    (rf"/api/models/{_REPO}", "GET", _repo_info),
    (rf"/api/models/{_REPO}/revision/([^/]+)", "GET", _repo_info),
    (r"/api/validate-yaml", "POST", _validate_yaml),
    (rf"/api/models/{_REPO}/branch/([^/]+)", "POST", _create_branch),
    (rf"/api/models/{_REPO}/preupload/([^/]+)", "POST", _preupload),
    (rf"/{_REPO}\.git/info/lfs/objects/batch", "POST", _lfs_batch),
    (r"/_lfs/([0-9a-f]{64})", "PUT", _lfs_put),
    (r"/_lfs/([0-9a-f]{64})/part/(\d+)", "PUT", _lfs_put_part),
    (r"/_lfs/([0-9a-f]{64})/complete", "POST", _lfs_complete),
    (r"/_lfs/([0-9a-f]{64})/verify", "POST", _lfs_verify),
    (rf"/api/models/{_REPO}/commit/([^/]+)", "POST", _commit),
]
