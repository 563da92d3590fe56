"""A real registry (Debian's ``docker-registry``, the CNCF distribution server) on localhost, and a
minimal OCI pusher for tiny single-file images of any architecture (no emulation needed: the
images are pushed and pulled, never run)."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import socket
import subprocess
import tarfile
import time
import urllib.request
from pathlib import Path

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRegistry:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.port = free_port()
        self.host = f"localhost:{self.port}"
        self.proc = None

    def start(self) -> "LocalRegistry":
        binary = shutil.which("docker-registry")
        if not binary:
            raise RuntimeError("docker-registry is not installed (apt-get install docker-registry)")
        config = self.workdir / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log:\n  level: warn\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.workdir / 'data'}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n", encoding="utf-8")
        self.log = open(self.workdir / "registry.log", "wb")
        self.proc = subprocess.Popen([binary, "serve", str(config)], stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1).read()
                return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("docker-registry did not start: " + (self.workdir / "registry.log").read_text())

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(timeout=20)
        self.log.close()

    # -- pushing -----------------------------------------------------------------------------
    def _request(self, method: str, url: str, data: bytes = b"", headers: dict | None = None):
        req = urllib.request.Request(url, data=data if method in ("PUT", "POST") else None, method=method,
                                     headers=headers or {})
        return urllib.request.urlopen(req, timeout=30)

    def push_blob(self, name: str, data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        resp = self._request("POST", f"http://{self.host}/v2/{name}/blobs/uploads/")
        location = resp.headers["Location"]
        if location.startswith("/"):
            location = f"http://{self.host}{location}"
        sep = "&" if "?" in location else "?"
        self._request("PUT", f"{location}{sep}digest={digest}", data,
                      {"Content-Type": "application/octet-stream"})
        return digest

    def push_manifest(self, name: str, ref: str, doc: dict, media_type: str) -> tuple[str, int]:
        body = json.dumps(doc, separators=(",", ":")).encode()
        self._request("PUT", f"http://{self.host}/v2/{name}/manifests/{ref}", body, {"Content-Type": media_type})
        return "sha256:" + hashlib.sha256(body).hexdigest(), len(body)

    def push_image(self, name: str, tag: str, arch: str, content: str) -> tuple[str, int, str]:
        """A one-file image for linux/<arch>; returns (manifest digest, size, config digest)."""
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w") as tar:
            data = content.encode()
            info = tarfile.TarInfo("hello.txt")
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
        layer_raw = raw.getvalue()
        layer = gzip.compress(layer_raw, mtime=0)
        config = json.dumps({
            "architecture": arch, "os": "linux", "config": {"Cmd": ["/hello.txt"]},
            "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer_raw).hexdigest()]},
            "created": "2026-01-01T00:00:00Z",
        }, separators=(",", ":")).encode()
        config_digest = self.push_blob(name, config)
        layer_digest = self.push_blob(name, layer)
        manifest = {
            "schemaVersion": 2, "mediaType": DOCKER_MANIFEST,
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": len(config),
                       "digest": config_digest},
            "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip", "size": len(layer),
                        "digest": layer_digest}],
        }
        digest, size = self.push_manifest(name, tag, manifest, DOCKER_MANIFEST)
        return digest, size, config_digest

    def push_index(self, name: str, tag: str, entries: list[tuple[str, int, str]]) -> str:
        """A manifest list over (digest, size, arch) entries, plus an attestation-like unknown entry."""
        doc = {"schemaVersion": 2, "mediaType": DOCKER_LIST, "manifests": [
            {"mediaType": DOCKER_MANIFEST, "digest": d, "size": s, "platform": {"architecture": a, "os": "linux"}}
            for d, s, a in entries]}
        digest, _ = self.push_manifest(name, tag, doc, DOCKER_LIST)
        return digest
