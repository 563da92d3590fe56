"""Registry digests for images.lock, read from the registry (OCI distribution API), never invented.

``serving-truth lock resolve PIN`` asks the pin's registry for the manifest of ``image`` (by
digest) or ``image_tag``, computes the digest of the bytes it received, and records it together with
the per-platform manifest digests of a multi-arch index (linux/amd64 and linux/arm64; attestation
entries are skipped). A single-platform manifest records its own platform from its config blob.
Anonymous bearer tokens are fetched when the registry asks for them. Standard library only.
"""
from __future__ import annotations

import hashlib
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from audit.errors import LockError, RegistryError, UsageError
from audit.fsutil import write_atomic
from audit.tomlpos import header_lines

INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
               "application/vnd.docker.distribution.manifest.list.v2+json")
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
PLATFORMS = ("linux/amd64", "linux/arm64")
TIMEOUT_S = 30


def parse_ref(ref: str) -> tuple[str, str, str]:
    """``repo@sha256:..`` or ``repo:tag`` -> (registry host, repository name, reference)."""
    if "@" in ref:
        repo, reference = ref.split("@", 1)
    else:
        slash = ref.rfind("/")
        colon = ref.rfind(":")
        if colon <= slash:
            raise UsageError(f"{ref!r} names neither a tag nor a digest")
        repo, reference = ref[:colon], ref[colon + 1:]
    first, _, rest = repo.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, name = first, rest
    else:
        registry, name = "registry-1.docker.io", repo if "/" in repo else f"library/{repo}"
    return registry, name, reference


class Registry:
    def __init__(self, host: str):
        self.host = host
        local = host.split(":")[0] in ("localhost", "127.0.0.1")
        self.base = f"{'http' if local else 'https'}://{host}"
        self.token: str | None = None

    def get(self, path: str, accept: tuple[str, ...] = ()) -> tuple[bytes, dict]:
        for attempt in (0, 1):
            req = urllib.request.Request(self.base + path, headers={"Accept": ", ".join(accept)} if accept else {})
            if self.token:
                req.add_header("Authorization", f"Bearer {self.token}")
            try:
                with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
                    return resp.read(), {k.lower(): v for k, v in resp.headers.items()}
            except urllib.error.HTTPError as exc:
                challenge = exc.headers.get("WWW-Authenticate", "")
                if exc.code == 401 and attempt == 0 and challenge.lower().startswith("bearer"):
                    self.token = self._token(challenge)
                    continue
                if exc.code == 404:
                    raise RegistryError(f"{path} not found on {self.host}", registry=self.host,
                                        hint="check the repository and tag/digest in images.lock") from None
                raise RegistryError(f"{self.host} answered HTTP {exc.code} for {path}", registry=self.host,
                                    hint="private repositories need credentials, which lock resolve does not use") from None
            except (urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                raise RegistryError(f"cannot reach {self.base}: {reason}", registry=self.host,
                                    hint="lock resolve needs the registry; on an air-gapped host, pin the image by "
                                         "image_config_digest (and image_tarball) instead") from None
        raise RegistryError(f"{self.host} refused the token it issued", registry=self.host)

    def _token(self, challenge: str) -> str:
        fields = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
        realm = fields.pop("realm", "")
        if not realm:
            raise RegistryError("the registry's auth challenge names no realm", registry=self.host)
        url = realm + "?" + urllib.parse.urlencode(fields)
        try:
            with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:
                data = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise RegistryError(f"cannot get an anonymous token from {realm}: {exc}", registry=self.host) from None
        return data.get("token") or data.get("access_token") or ""

    def manifest(self, name: str, reference: str) -> tuple[str, dict]:
        body, headers = self.get(f"/v2/{name}/manifests/{reference}", INDEX_TYPES + MANIFEST_TYPES)
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if reference.startswith("sha256:") and digest != reference:
            raise RegistryError(f"asked for {reference}, received content with digest {digest}", registry=self.host)
        try:
            doc = json.loads(body)
        except ValueError:
            raise RegistryError(f"the manifest of {name}@{reference} is not JSON", registry=self.host) from None
        doc.setdefault("mediaType", headers.get("content-type", ""))
        return digest, doc

    def platforms(self, name: str, digest: str, doc: dict) -> dict[str, str]:
        if doc.get("mediaType") in INDEX_TYPES or "manifests" in doc:
            out = {}
            for m in doc.get("manifests", []):
                plat = m.get("platform") or {}
                key = f"{plat.get('os')}/{plat.get('architecture')}"
                if key in PLATFORMS and key not in out:
                    out[key] = m["digest"]
            return out
        config = (doc.get("config") or {}).get("digest")
        if not config:
            return {}
        body, _ = self.get(f"/v2/{name}/blobs/{config}")
        arch = json.loads(body).get("architecture", "")
        return {f"linux/{arch}": digest} if f"linux/{arch}" in PLATFORMS else {}


def resolve_ref(ref: str) -> tuple[str, dict[str, str]]:
    """(``repo@digest``, per-platform digests) for an image reference, from its registry."""
    host, name, reference = parse_ref(ref)
    reg = Registry(host)
    digest, doc = reg.manifest(name, reference)
    repo = ref.split("@", 1)[0] if "@" in ref else ref[:ref.rfind(":")]
    return f"{repo}@{digest}", reg.platforms(name, digest, doc)


def resolve_pin(lock_path: str | Path, pin_name: str) -> dict:
    """Fill in ``image`` and ``platform_digests`` of a pin; returns the keys that changed."""
    from audit.pins import lock as lockmod

    lock_path = Path(lock_path)
    pin = lockmod.load(lock_path).get(pin_name)
    source = pin.image or pin.image_tag
    if not source:
        raise UsageError(f"pin {pin_name!r} names no registry image (image or image_tag) to resolve",
                         hint='add image_tag = "repo:tag" to its [[pin]] table')
    image, platforms = resolve_ref(source)
    changes = {}
    if image != pin.image:
        changes["image"] = image
    if platforms != pin.platform_digests:
        changes["platform_digests"] = platforms
    if changes:
        from audit.fsutil import DirLock

        with DirLock(lock_path):  # the same lock `lock add` takes: edits of images.lock never interleave
            pin = lockmod.load(lock_path).get(pin_name)  # where the pin is now
            text = lock_path.read_text(encoding="utf-8")
            new = _edit_pin(text, pin.line, image=image, platform_digests=platforms, path=str(lock_path))
            write_atomic(lock_path, new)
            lockmod.load(lock_path)  # what was written must parse
    return changes


def _edit_pin(text: str, header_line: int, *, image: str, platform_digests: dict, path: str) -> str:
    lines = text.splitlines(keepends=True)
    headers = header_lines(text, "[[pin]]")
    if header_line not in headers:
        raise LockError("cannot find the pin's [[pin]] header to edit", path=path, line=header_line)
    start = header_line  # 0-based index of the first line after the header
    later = [h for h in headers if h > header_line]
    end = (later[0] - 1) if later else len(lines)
    plats = "{ " + ", ".join(f'"{k}" = "{v}"' for k, v in sorted(platform_digests.items())) + " }" \
        if platform_digests else "{}"
    values = {"image": f'image = "{image}"\n', "platform_digests": f"platform_digests = {plats}\n"}
    block = lines[start:end]
    for key, new_line in values.items():
        for i, line in enumerate(block):
            if re.match(rf"^\s*{key}\s*=", line):
                block[i] = new_line
                break
        else:
            anchor = next((i for i, line in enumerate(block) if re.match(r"^\s*vllm_version\s*=", line)), -1)
            block.insert(anchor + 1, new_line)
    return "".join(lines[:start] + block + lines[end:])


__all__ = ["parse_ref", "resolve_pin", "resolve_ref", "Registry"]
