"""A Hub that serves files from a folder on 127.0.0.1, for tests and offline trials of `magistral fetch`.

It answers the file-download endpoint the way huggingface.co does, so the real
``huggingface_hub`` client runs against it (``HF_ENDPOINT=http://127.0.0.1:PORT``):

``HEAD|GET /{owner}/{name}/resolve/{revision}/{path}`` serves ``root/{owner}/{name}/{revision}/{path}``
with ``X-Repo-Commit``, ``ETag`` (the git blob SHA-1 of small files), for LFS-like files
(``*.safetensors`` or larger than ``lfs_threshold``) ``X-Linked-Etag`` (their SHA-256) and
``X-Linked-Size``, ``Content-Length`` and ``Accept-Ranges``; ``Range: bytes=N-`` gives a 206.
Unknown repositories, revisions and files get the Hub's 401/404 answers with ``X-Error-Code``.

Faults for tests: ``cut_once`` (paths whose first GET is cut after half the body), ``corrupt``
(paths served with one byte flipped), ``token`` (require ``Authorization: Bearer <token>``).
Every request is recorded in ``requests`` (method, path, Range header, whether a token came).

Run by hand: ``python -m magistral_cli.testing.local_hub ROOT [--port N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


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
    corrupt: set[str] = field(default_factory=set)
    requests: list[SeenRequest] = field(default_factory=list)

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

    def _serve(self, head: bool) -> None:
        hub = self.hub
        auth = self.headers.get("Authorization")
        url_path = self.path.split("?", 1)[0]
        hub.requests.append(
            SeenRequest(self.command, unquote(url_path), self.headers.get("Range"), auth is not None)
        )
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
        if key in hub.cut_once and status == 200:
            hub.cut_once.discard(key)
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            # Drop the connection midway: the client sees a body shorter than Content-Length.
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(body)


#: Repositories of the synthetic model ``add_synthetic_model`` serves (revisions are full commit hashes).
SYNTHETIC_OFFICIAL = ("synthetic-org/Tiny-Magistral", hashlib.sha1(b"official").hexdigest())
SYNTHETIC_THIRD_PARTY = ("synthetic-tok/Tiny-Magistral", hashlib.sha1(b"unsloth").hexdigest())


def add_synthetic_model(hub: LocalHub, shard_sizes: tuple[int, ...] = (3_000_000, 24_000_000)) -> dict:
    """Serve a small synthetic model laid out like Magistral-Small-2509's two repositories and
    return a lock (as a dict) that pins it: config, index, tekken.json and shards in the official
    repository, tokenizer files in the third-party one. Shard contents are random bytes (the hub
    does not care what they are); the default second shard is over 10 MiB so that a cut download
    has whole client chunks to resume from."""
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
