"""A Hub that serves files from a folder on 127.0.0.1, for tests and offline trials of `magistral fetch`.

It answers the file-download endpoint the way huggingface.co does, so the real
``huggingface_hub`` client runs against it (``HF_ENDPOINT=http://127.0.0.1:PORT``):

``HEAD|GET /{owner}/{name}/resolve/{revision}/{path}`` serves ``root/{owner}/{name}/{revision}/{path}``
with ``X-Repo-Commit``, ``ETag`` (the git blob SHA-1 of small files), for LFS-like files
(``*.safetensors`` or larger than ``lfs_threshold``) ``X-Linked-Etag`` (their SHA-256) and
``X-Linked-Size``, ``Content-Length`` and ``Accept-Ranges``; ``Range: bytes=N-`` gives a 206.
Unknown repositories, revisions and files get the Hub's 401/404 answers with ``X-Error-Code``.

Uploads, the endpoints ``huggingface_hub``'s ``create_repo``, ``create_branch`` and
``upload_folder`` call (with the client's legacy LFS transfer: set ``HF_HUB_DISABLE_XET=1`` before
``huggingface_hub`` is imported, or ``huggingface_hub.constants.HF_HUB_DISABLE_XET = True``; Xet
storage is not served): ``POST /api/repos/create``, ``POST /api/validate-yaml`` (the model card's
metadata, read with ``yaml.safe_load``), ``POST /api/models/{repo}/branch/{branch}``,
``POST /api/models/{repo}/preupload/{rev}`` (``*.safetensors`` and files over ``lfs_threshold``
go by LFS), ``POST /{repo}.git/info/lfs/objects/batch`` and ``PUT /lfs-upload/{oid}`` (the bytes
are checked against their SHA-256), ``POST /api/models/{repo}/commit/{rev}`` (the ndjson commit:
each file lands at ``root/{repo}/{rev}/{path}``, served by the download endpoint from then on).
Every write needs a token (any one, or ``token`` when set); ``refused_namespaces`` answer 403 as
the Hub does for a namespace the token may not write to. ``repos`` records each created repository
(``{"private": bool}``) and ``commits`` each commit (repo, revision, summary, paths).

Faults for tests: ``cut_once`` (paths whose first GET is cut after half the body), ``cut_always``
(paths whose every GET is cut before the body: a connection that never delivers), ``corrupt``
(paths served with one byte flipped), ``token`` (require ``Authorization: Bearer <token>``).
Every request is recorded in ``requests`` (method, path, Range header, whether a token came).

Run by hand: ``python -m magistral_cli.testing.local_hub ROOT [--port N]``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import re
import shutil
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_REPO_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/(?P<action>preupload|commit|branch)/(?P<rev>.+)$")
_LFS_BATCH = re.compile(r"^/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch$")
_LFS_UPLOAD = re.compile(r"^/lfs-upload/(?P<oid>[0-9a-f]{64})$")
#: The user a token belongs to on this hub (a repository id without a namespace goes there).
LOCAL_USER = "local-user"


@dataclass
class SeenCommit:
    repo: str
    revision: str
    summary: str
    paths: list[str]


@dataclass
class SeenRequest:
    method: str
    path: str
    range: str | None
    authorized: bool


@dataclass
class LocalHub:
    """Serve ``root`` as a Hub. Use as a context manager; ``endpoint`` is the URL for HF_ENDPOINT."""

    root: Path
    port: int = 0
    token: str | None = None
    lfs_threshold: int = 10 * 1024 * 1024
    cut_once: set[str] = field(default_factory=set)
    cut_always: set[str] = field(default_factory=set)
    corrupt: set[str] = field(default_factory=set)
    requests: list[SeenRequest] = field(default_factory=list)
    refused_namespaces: set[str] = field(default_factory=set)
    repos: dict[str, dict] = field(default_factory=dict)
    commits: list[SeenCommit] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._meta: dict[Path, tuple[str, str]] = {}
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "start the hub first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> LocalHub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="local-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def add_file(self, repo: str, revision: str, name: str, data: bytes) -> Path:
        """Put ``data`` at ``name`` in ``repo`` at ``revision``."""
        path = self.root / repo / revision / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        with self._lock:
            self._meta.pop(path, None)
        return path

    def etags(self, path: Path) -> tuple[str, str]:
        """``(git blob sha1, sha256)`` of a served file, cached."""
        with self._lock:
            if path not in self._meta:
                data = path.read_bytes()
                blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
                self._meta[path] = (blob, hashlib.sha256(data).hexdigest())
            return self._meta[path]

    def lfs_store(self) -> Path:
        """Where uploaded LFS objects wait for their commit (outside every repository's folder)."""
        store = self.root / ".lfs-objects"
        store.mkdir(parents=True, exist_ok=True)
        return store

    def ranges_seen(self, name: str) -> list[str]:
        """The Range headers of the GET requests for files named ``name``."""
        return [
            r.range for r in self.requests if r.method == "GET" and r.path.endswith("/" + name) and r.range
        ]


class _Handler(BaseHTTPRequestHandler):
    hub: LocalHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # quiet: tests read hub.requests instead
        pass

    def do_HEAD(self):
        self._serve(head=True)

    def do_GET(self):
        self._serve(head=False)

    def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _record(self) -> tuple[str, str | None]:
        """(the URL's path, the Authorization header), the request recorded."""
        auth = self.headers.get("Authorization")
        url_path = self.path.split("?", 1)[0]
        self.hub.requests.append(
            SeenRequest(self.command, unquote(url_path), self.headers.get("Range"), auth is not None)
        )
        return url_path, auth

    def _serve(self, head: bool) -> None:
        hub = self.hub
        url_path, auth = self._record()
        if hub.token is not None and auth != f"Bearer {hub.token}":
            return self._error(401, "RepoNotFound", "Repository not found or invalid credentials.")
        m = _RESOLVE.match(url_path)
        if not m:
            return self._error(404, "EntryNotFound", "Unknown endpoint.")
        repo, rev, name = unquote(m["repo"]), unquote(m["rev"]), unquote(m["path"])
        repo_dir = hub.root / repo
        if ".." in repo.split("/") or ".." in name.split("/") or not repo_dir.is_dir():
            return self._error(401, "RepoNotFound", "Repository not found.")
        rev_dir = repo_dir / rev
        if ".." in rev or not rev_dir.is_dir():
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        path = rev_dir / name
        if not path.is_file():
            return self._error(404, "EntryNotFound", "Entry not found", commit=rev)

        data = path.read_bytes()
        key = f"{repo}/{rev}/{name}"
        if key in hub.corrupt and data:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        size = len(data)
        blob_sha1, sha256 = hub.etags(path)
        lfs = name.endswith(".safetensors") or size > hub.lfs_threshold

        start = 0
        status = 200
        rng = self.headers.get("Range")
        if rng and not head:
            rm = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if not rm or int(rm[1]) >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start, status = int(rm[1]), 206
        body = data[start:]

        self.send_response(status)
        self.send_header("X-Repo-Commit", rev)
        self.send_header("ETag", f'"{sha256 if lfs else blob_sha1}"')
        if lfs:
            self.send_header("X-Linked-Etag", f'"{sha256}"')
            self.send_header("X-Linked-Size", str(size))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if head:
            return
        if key in hub.cut_always or (key in hub.cut_once and status == 200):
            hub.cut_once.discard(key)
            self.wfile.write(body[: 0 if key in hub.cut_always else len(body) // 2])
            self.wfile.flush()
            # Drop the connection midway: the client sees a body shorter than Content-Length.
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(body)

    # ---- uploads ---------------------------------------------------------------------------

    def _body(self) -> bytes:
        """The request body, sent with a Content-Length or in chunks."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()  # the CRLF after each chunk
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _json(self, status: int, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _may_write(self, auth: str | None, repo: str | None = None) -> bool:
        """Answer 401 (no or wrong token) or 403 (a refused namespace) and return False, or True."""
        hub = self.hub
        if (
            auth is None
            or not auth.startswith("Bearer ")
            or (hub.token is not None and auth != f"Bearer {hub.token}")
        ):
            self._error(401, "Unauthorized", "Invalid username or password.")
            return False
        if repo is not None and repo.split("/")[0] in hub.refused_namespaces:
            self._error(
                403,
                "Forbidden",
                f"You don't have the rights to create a model under the namespace {repo.split('/')[0]}",
            )
            return False
        return True

    def _repo_dir(self, repo: str) -> Path | None:
        parts = repo.split("/")
        if len(parts) != 2 or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            return None
        return self.hub.root / repo

    def do_PUT(self):
        url_path, auth = self._record()
        data = self._body()
        m = _LFS_UPLOAD.match(url_path)
        if not m:
            return self._error(404, "EntryNotFound", "Unknown endpoint.")
        if hashlib.sha256(data).hexdigest() != m["oid"]:
            return self._error(400, "BadRequest", "The uploaded bytes do not match their SHA-256.")
        store = self.hub.lfs_store()
        (store / m["oid"]).write_bytes(data)
        self._json(200, {})

    def do_POST(self):
        hub = self.hub
        url_path, auth = self._record()
        data = self._body()
        if url_path == "/api/validate-yaml":
            return self._validate_yaml(data)
        if url_path == "/api/repos/create":
            if not self._may_write(auth):
                return
            request = json.loads(data or b"{}")
            repo = f"{request.get('organization') or LOCAL_USER}/{request.get('name')}"
            repo_dir = self._repo_dir(repo)
            if repo_dir is None:
                return self._error(400, "BadRequest", f"Invalid repository name {repo!r}.")
            if not self._may_write(auth, repo):
                return
            if repo_dir.is_dir():  # the Hub's conflict answer names the repository's URL too
                return self._json(
                    409, {"error": "You already created this model repo", "url": f"{hub.endpoint}/{repo}"}
                )
            (repo_dir / "main").mkdir(parents=True)
            hub.repos[repo] = {
                "private": request.get("visibility") == "private" or bool(request.get("private"))
            }
            return self._json(200, {"url": f"{hub.endpoint}/{repo}", "name": repo})
        m = _LFS_BATCH.match(url_path)
        if m:
            if not self._may_write(auth, unquote(m["repo"])):
                return
            request = json.loads(data)
            store = hub.lfs_store()
            objects = []
            for obj in request.get("objects", []):
                entry = {"oid": obj["oid"], "size": obj["size"], "authenticated": True}
                if not (store / obj["oid"]).is_file():
                    entry["actions"] = {"upload": {"href": f"{hub.endpoint}/lfs-upload/{obj['oid']}"}}
                objects.append(entry)
            return self._json(200, {"transfer": "basic", "objects": objects})
        m = _REPO_API.match(url_path)
        if not m:
            return self._error(404, "EntryNotFound", "Unknown endpoint.")
        repo, action, rev = unquote(m["repo"]), m["action"], unquote(m["rev"])
        repo_dir = self._repo_dir(repo)
        if repo_dir is None or not repo_dir.is_dir():
            return self._error(404, "RepoNotFound", "Repository not found.")
        if not self._may_write(auth, repo):
            return
        if ".." in rev.split("/"):
            return self._error(400, "BadRequest", f"Invalid rev id: {rev}")
        if action == "branch":
            if (repo_dir / rev).is_dir():
                return self._error(409, "Conflict", f"Reference already exists: refs/heads/{rev}")
            shutil.copytree(repo_dir / "main", repo_dir / rev)
            return self._json(200, {})
        if not (repo_dir / rev).is_dir():
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if action == "preupload":
            files = json.loads(data)["files"]
            return self._json(
                200,
                {
                    "files": [
                        {
                            "path": f["path"],
                            "uploadMode": "lfs"
                            if f["path"].endswith(".safetensors") or f["size"] > hub.lfs_threshold
                            else "regular",
                            "shouldIgnore": False,
                        }
                        for f in files
                    ]
                },
            )
        return self._commit(repo, repo_dir / rev, rev, data)

    def _validate_yaml(self, data: bytes) -> None:
        import yaml

        content = json.loads(data).get("content", "")
        match = re.match(r"^---\n(.*?)\n---\n", content, re.S)
        try:
            meta = yaml.safe_load(match.group(1)) if match else {}
        except yaml.YAMLError as exc:
            return self._error(400, "BadRequest", f"Invalid metadata in README.md: {exc}")
        if meta is not None and not isinstance(meta, dict):
            return self._error(400, "BadRequest", "Invalid metadata in README.md: not a mapping")
        self._json(200, {"errors": [], "warnings": []})

    def _commit(self, repo: str, rev_dir: Path, rev: str, data: bytes) -> None:
        """Apply an ndjson commit: every file is checked before any is written."""
        hub = self.hub
        lines = [json.loads(line) for line in data.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            return self._error(400, "BadRequest", "The commit has no header.")
        summary = lines[0]["value"].get("summary", "")
        staged: dict[str, bytes] = {}
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value", {})
            path = value.get("path", "")
            if not path or path.startswith("/") or ".." in path.split("/"):
                return self._error(400, "BadRequest", f"Invalid path {path!r}.")
            if key == "file":
                staged[path] = base64.b64decode(value["content"])
            elif key == "lfsFile":
                blob = hub.lfs_store() / value["oid"]
                if not blob.is_file():
                    return self._error(
                        422, "BadRequest", f"LFS object {value['oid']} was never uploaded ({path})."
                    )
                staged[path] = blob.read_bytes()
                if len(staged[path]) != value.get("size", len(staged[path])):
                    return self._error(422, "BadRequest", f"{path}: size does not match its LFS object.")
            else:
                return self._error(400, "BadRequest", f"Unsupported commit operation {key!r}.")
        for path, content in staged.items():
            hub.add_file(repo, rev, path, content)
        oid = hashlib.sha1(data).hexdigest()
        hub.commits.append(SeenCommit(repo, rev, summary, sorted(staged)))
        self._json(
            200, {"commitUrl": f"{hub.endpoint}/{repo}/commit/{oid}", "commitOid": oid, "success": True}
        )


#: Repositories of the synthetic model ``add_synthetic_model`` serves (revisions are full commit hashes).
SYNTHETIC_OFFICIAL = ("synthetic-org/Tiny-Magistral", hashlib.sha1(b"official").hexdigest())
SYNTHETIC_THIRD_PARTY = ("synthetic-tok/Tiny-Magistral", hashlib.sha1(b"unsloth").hexdigest())


def add_synthetic_model(hub: LocalHub, shard_sizes: tuple[int, ...] = (3_000_000, 24_000_000)) -> dict:
    """Serve a small synthetic model laid out like Magistral-Small-2509's two repositories and
    return a lock (as a dict) that pins it: config, index, tekken.json and shards in the official
    repository, tokenizer files in the third-party one, and the native layout's ``params.json`` and
    ``consolidated.safetensors`` (the lock's ``native`` entry, fetched with ``--native``). Shard
    contents are random bytes (the hub does not care what they are); the default second shard is
    over 10 MiB so that a cut download has whole client chunks to resume from."""
    import os

    official, third = SYNTHETIC_OFFICIAL, SYNTHETIC_THIRD_PARTY
    n = len(shard_sizes)
    shards = {
        f"model-{i + 1:05d}-of-{n:05d}.safetensors": os.urandom(size) for i, size in enumerate(shard_sizes)
    }
    index = {
        "metadata": {"total_size": sum(shard_sizes)},
        "weight_map": {f"layer.{i}.weight": name for i, name in enumerate(shards)},
    }
    files = {
        official: {
            "config.json": json.dumps(
                {"model_type": "mistral3", "vision_config": {"patch_size": 14}}
            ).encode(),
            "model.safetensors.index.json": json.dumps(index, indent=2).encode(),
            "tekken.json": json.dumps({"config": {"pattern": "synthetic"}, "vocab": ["a"] * 1000}).encode(),
        },
        third: {
            "tokenizer.json": json.dumps({"model": {"type": "BPE"}, "pad": "x" * 5000}).encode(),
            "tokenizer_config.json": b'{"model_max_length": 131072}',
        },
    }
    lock_files = []
    for (repo, rev), entries in files.items():
        for name, data in entries.items():
            hub.add_file(repo, rev, name, data)
            lock_files.append(
                {
                    "name": name,
                    "repo": repo,
                    "revision": rev,
                    "sha256": hashlib.sha256(data).hexdigest(),
                    "bytes": len(data),
                    "source": "official" if (repo, rev) == official else "unsloth",
                }
            )
    for name, data in shards.items():
        hub.add_file(*official, name, data)
    native = {
        "params.json": json.dumps({"dim": 64, "n_layers": 2, "vocab_size": 1000}).encode(),
        "consolidated.safetensors": os.urandom(sum(shard_sizes) // 8),
    }
    for name, data in native.items():
        hub.add_file(*official, name, data)
    return {
        "format": 1,
        "model": official[0],
        "files": lock_files,
        "weights": {
            "repo": official[0],
            "revision": official[1],
            "index": "model.safetensors.index.json",
            "pattern": "model-*.safetensors",
            "sha256": None,
            "note": "synthetic",
        },
        "native": {"repo": official[0], "revision": official[1], "files": list(native), "note": "synthetic"},
    }


def main() -> None:  # pragma: no cover - manual use
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", type=Path, help="folder laid out as ROOT/owner/name/revision/files")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="first put a small synthetic model into ROOT and write its lock to ROOT/lock.json",
    )
    args = parser.parse_args()
    hub = LocalHub(args.root, port=args.port)
    if args.synthetic:
        lock = args.root / "lock.json"
        lock.write_text(json.dumps(add_synthetic_model(hub), indent=2) + "\n")
        print(f"wrote a synthetic model under {args.root} and its lock {lock}", flush=True)
    hub.start()
    print(f"serving {args.root} at {hub.endpoint}; export HF_ENDPOINT={hub.endpoint}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        hub.stop()


if __name__ == "__main__":  # pragma: no cover
    main()
