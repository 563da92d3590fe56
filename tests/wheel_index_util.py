"""Test helpers: a loopback HTTP server holding a per-commit wheel index laid out as vLLM's is, small
synthetic wheels with a real RECORD, and a fake GitHub commits API.

The layout follows vLLM's index generator (.buildkite/scripts/generate-nightly-index.py, described in
audit/pins/wheelindex.py): wheels directly under ``<commit>/``, a project list ``<commit>/index.html``, and per
variant (the default one at the root) ``vllm/index.html`` (PEP 503 links relative to that directory, ``+``
quoted as ``%2B``) and ``vllm/metadata.json``. Only 127.0.0.1 is ever bound.
"""
from __future__ import annotations

import base64
import hashlib
import http.server
import json
import os
import socket
import threading
import urllib.parse
import zipfile
from pathlib import Path


def make_wheel(directory: Path, version: str, *, commit: str = "", plat: str = "manylinux_2_28_x86_64",
               files: dict[str, bytes] | None = None) -> Path:
    """A minimal vLLM wheel: METADATA, WHEEL, vllm/_version.py reporting *commit*, *files*, and a RECORD
    with the sha256 of each."""
    directory.mkdir(parents=True, exist_ok=True)
    name = f"vllm-{version}-cp38-abi3-{plat}.whl"
    info = f"vllm-{version}.dist-info"
    content = {
        "vllm/__init__.py": b"__version__ = '" + version.encode() + b"'\n",
        "vllm/_version.py": (f"__version__ = version = '{version}'\n"
                             f"__commit_id__ = commit_id = {('g' + commit)!r}\n" if commit else
                             f"__version__ = version = '{version}'\n__commit_id__ = commit_id = None\n").encode(),
        **(files or {}),
        f"{info}/METADATA": f"Metadata-Version: 2.4\nName: vllm\nVersion: {version}\n\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: false\nTag: cp38-abi3-any\n",
    }
    record = []
    for rel, data in content.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{rel},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    path = directory / name
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for rel, data in content.items():
            zf.writestr(rel, data)
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def sha256_of(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _quote(rel: str) -> str:
    return urllib.parse.quote(rel, safe=":%/")  # as vLLM's generator quotes (S3 needs '+' as %2B)


def publish_commit(root: Path, commit: str, wheels: dict[str | None, list[Path]], *, sha_fragment: dict | None = None,
                   metadata: bool = True) -> None:
    """Lay out ``<root>/<commit>/`` as vLLM's index does. *wheels* maps a variant (None: the default one) to
    wheel files, which are linked (not copied) into the commit directory. *sha_fragment* maps a file name to
    the sha256 its package-index link announces (vLLM's own index announces none)."""
    base = root / commit
    base.mkdir(parents=True, exist_ok=True)
    variants = sorted(v for v in wheels if v)
    project = ["vllm"] if None in wheels else []
    _html(base / "index.html", [(f"{n}/", f"{n}/") for n in sorted(project + variants)])
    for variant, files in wheels.items():
        pkg = base / (variant or "") / "vllm"
        pkg.mkdir(parents=True, exist_ok=True)
        up = "../../" if variant else "../"
        links, meta = [], []
        for f in files:
            target = base / f.name
            if not target.exists():
                os.symlink(f.resolve(), target)
            href = _quote(up + f.name)
            frag = (sha_fragment or {}).get(f.name)
            links.append((href + (f"#sha256={frag}" if frag else ""), f.name))
            stem = f.name[:-4].split("-")
            meta.append({"package_name": "vllm", "version": stem[1], "build_tag": None, "python_tag": stem[-3],
                         "abi_tag": stem[-2], "platform_tag": stem[-1], "variant": variant, "filename": f.name,
                         "path": href})
        if variant:
            _html(base / variant / "index.html", [("vllm/", "vllm/")])
        _html(pkg / "index.html", links)
        if metadata:
            (pkg / "metadata.json").write_text(json.dumps(meta, indent=2))


def publish_nightly(root: Path, commit: str, wheels: list[Path]) -> None:
    """``<root>/nightly/``: the default-variant indexes of *commit*, linking into its directory as vLLM's
    moving nightly index does (``../../<commit>/<file>``)."""
    pkg = root / "nightly" / "vllm"
    pkg.mkdir(parents=True, exist_ok=True)
    _html(root / "nightly" / "index.html", [("vllm/", "vllm/")])
    links, meta = [], []
    for f in wheels:
        href = _quote(f"../../{commit}/{f.name}")
        stem = f.name[:-4].split("-")
        links.append((href, f.name))
        meta.append({"package_name": "vllm", "version": stem[1], "build_tag": None, "python_tag": stem[-3],
                     "abi_tag": stem[-2], "platform_tag": stem[-1], "variant": None, "filename": f.name, "path": href})
    _html(pkg / "index.html", links)
    (pkg / "metadata.json").write_text(json.dumps(meta, indent=2))


def _html(path: Path, links: list[tuple[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    items = "\n".join(f'    <a href="{href}">{text}</a><br/>' for href, text in links)
    path.write_text('<!DOCTYPE html>\n<html>\n  <meta name="pypi:repository-version" content="1.0">\n  <body>\n'
                    f"{items}\n  </body>\n</html>\n")


class IndexServer:
    """``with IndexServer(root) as srv:`` serves *root* on 127.0.0.1; ``srv.truncate`` holds URL paths whose
    body is cut in half (Content-Length announces the whole file); ``srv.commits`` is what the fake GitHub API
    (``srv.api``) answers for ``/repos/<repo>/commits``; ``srv.requests`` records every path asked for."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.truncate: set[str] = set()
        #: URL path -> a Content-Length to announce in place of the file's own (a server that lies about its size;
        #: None: none announced)
        self.announce: dict[str, int | None] = {}
        self.commits: list[dict] = []
        self.requests: list[str] = []
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *a, **k):
                super().__init__(*a, directory=str(server.root), **k)

            def log_message(self, *a):
                pass

            def do_GET(self):
                server.requests.append(self.path)
                path = urllib.parse.urlsplit(self.path).path
                if path.startswith("/api/"):
                    return self._api(path[len("/api"):])
                if path in server.truncate:
                    return self._truncated(path)
                if path in server.announce:
                    data = Path(self.translate_path(path)).read_bytes()
                    self.send_response(200)
                    if server.announce[path] is not None:  # None: no length at all, the body ends with the connection
                        self.send_header("Content-Length", str(server.announce[path]))
                    self.end_headers()
                    self.wfile.write(data)
                    self.close_connection = True
                    return None
                return super().do_GET()

            def _api(self, path):
                parts = path.strip("/").split("/")
                if len(parts) == 4 and parts[0] == "repos" and parts[3] == "commits":
                    body = json.dumps(server.commits).encode()
                elif len(parts) == 5 and parts[0] == "repos" and parts[3] == "commits":
                    hit = [c for c in server.commits if c["sha"].startswith(parts[4])]
                    if not hit:
                        self.send_error(404)
                        return
                    body = json.dumps(hit[0]).encode()
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _truncated(self, path):
                data = Path(self.translate_path(path)).read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.api = self.url + "/api"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "IndexServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
