"""images.lock: the pinned audit targets.

Format (TOML, read with :mod:`tomllib`)::

    schema = 1

    [[pin]]
    name = "v0.33.0"                # what users type: make audit PIN=v0.33.0
    vllm_version = "0.33.0"
    python = "3.12"                  # interpreter the local runtime builds the env with
    wheel = "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel_sha256 = "..."             # sha256 of that exact file on PyPI
    image = ""                       # repo@sha256:<digest> (a manifest list or one manifest)
    platform_digests = {}            # {"linux/amd64" = "sha256:...", "linux/arm64" = "sha256:..."}
    image_config_digest = ""         # sha256 of the image config = Docker's image ID
    image_tarball = ""               # `docker save` output, relative to this file; needs the config digest
    image_tag = ""                   # repo:tag that `serving-truth lock resolve` turns into `image`; never run
    vllm_commit = ""                 # git sha the build reports, empty when not known
    note = ""

A pin with a wheel can be audited by the local runtime; a pin with an image by the docker runtime.
An image is named by a registry digest (``image``, with per-platform manifest digests for multi-arch
images, so an arm64 system is never checked against the amd64 entry), or by its config digest when it
travels without a registry (``docker save``/``docker load`` drops the registry digest, the config
digest survives): ``image_config_digest`` plus, optionally, the ``image_tarball`` to load it from.
``serving-truth lock resolve PIN`` fills registry digests in from a reachable registry. Unknown facts
stay empty strings: nothing is ever invented.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import LockError, UnknownPinError
from .tomlpos import header_lines, key_line, read_toml

SCHEMA = 1
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_IMAGE = re.compile(r"^(?P<repo>[a-z0-9][a-z0-9._/:-]*?)@(?P<digest>sha256:[0-9a-f]{64})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_PY = re.compile(r"^3\.\d{1,2}$")
_PLATFORMS = ("linux/amd64", "linux/arm64")
_KNOWN_KEYS = {
    "name", "vllm_version", "python", "wheel", "wheel_sha256", "image", "platform_digests",
    "vllm_commit", "note", "image_config_digest", "image_tarball", "image_tag",
}


@dataclass(frozen=True)
class Pin:
    name: str
    vllm_version: str
    python: str = "3.12"
    wheel: str = ""
    wheel_sha256: str = ""
    image: str = ""
    platform_digests: dict[str, str] = field(default_factory=dict)
    vllm_commit: str = ""
    note: str = ""
    image_config_digest: str = ""
    image_tarball: str = ""
    image_tag: str = ""
    line: int = 0

    @property
    def has_wheel(self) -> bool:
        return bool(self.wheel and self.wheel_sha256)

    @property
    def has_image(self) -> bool:
        return bool(self.image or self.image_config_digest)

    @property
    def repo(self) -> str:
        return self.image.split("@", 1)[0] if self.image else ""

    def image_for(self, platform: str) -> str:
        """The reference to run on *platform*: its own manifest digest when the lock records one."""
        if not self.image:
            return self.image_config_digest
        digest = self.platform_digests.get(platform)
        return f"{self.repo}@{digest}" if digest else self.image

    @property
    def runtimes(self) -> list[str]:
        """Runtimes that can audit this pin, in order of preference."""
        out = []
        if self.has_wheel:
            out.append("local")
        if self.has_image:
            out.append("docker")
        return out

    def as_provenance(self) -> dict:
        return {
            "name": self.name,
            "vllm_version": self.vllm_version,
            "python": self.python,
            "wheel": self.wheel,
            "wheel_sha256": self.wheel_sha256,
            "image": self.image,
            "platform_digests": dict(sorted(self.platform_digests.items())),
            "vllm_commit": self.vllm_commit,
            "image_config_digest": self.image_config_digest,
            "image_tarball": self.image_tarball,
        }


@dataclass(frozen=True)
class Lock:
    path: Path
    pins: dict[str, Pin]

    def get(self, name: str) -> Pin:
        try:
            return self.pins[name]
        except KeyError:
            raise UnknownPinError(name, known=sorted(self.pins), path=str(self.path)) from None


def load(path: str | Path) -> Lock:
    path = Path(path)
    spath = str(path)
    text, data = read_toml(path, LockError, hint="run from the project root or pass --lock PATH")

    schema = data.get("schema")
    if schema != SCHEMA:
        raise LockError(
            f"schema is {schema!r}, this harness reads schema {SCHEMA}",
            path=spath, line=key_line(text, 1, "schema"),
            hint=f"add 'schema = {SCHEMA}' at the top, or upgrade the harness",
        )
    extra_top = sorted(set(data) - {"schema", "pin"})
    if extra_top:
        raise LockError(f"unknown top-level key(s): {', '.join(extra_top)}", path=spath,
                        line=key_line(text, 1, extra_top[0]), hint="pins go in [[pin]] tables")
    raw_pins = data.get("pin", [])
    if not isinstance(raw_pins, list) or not raw_pins:
        raise LockError("no [[pin]] tables", path=spath, hint="see the format at the top of audit/lock.py")
    headers = header_lines(text, "[[pin]]")
    pins: dict[str, Pin] = {}
    for idx, raw in enumerate(raw_pins):
        line = headers[idx] if idx < len(headers) else None
        pin = _parse_pin(raw, text=text, line=line, path=spath)
        if pin.name in pins:
            raise LockError(
                f"duplicate pin name {pin.name!r} (first defined at line {pins[pin.name].line})",
                path=spath, line=line, hint="pin names must be unique; rename or delete one",
            )
        pins[pin.name] = pin
    return Lock(path=path, pins=pins)


def _parse_pin(raw: dict, *, text: str, line: int | None, path: str) -> Pin:
    def err(msg: str, key: str | None = None, hint: str | None = None) -> LockError:
        return LockError(msg, path=path, line=key_line(text, (line or 0) + 1, key) if key else line, hint=hint)

    unknown = sorted(set(raw) - _KNOWN_KEYS)
    if unknown:
        raise err(f"unknown key {unknown[0]!r} in [[pin]]", unknown[0],
                  hint="known keys: " + ", ".join(sorted(_KNOWN_KEYS)))
    for key, value in raw.items():
        if key == "platform_digests":
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise err("platform_digests must be a table of strings", key)
        elif not isinstance(value, str):
            raise err(f"{key} must be a string, got {type(value).__name__}", key)
    name = raw.get("name", "")
    if not name:
        raise err("pin without a name", hint='add name = "..."')
    if not _NAME.match(name):
        raise err(f"pin name {name!r} has characters not allowed in a directory name", "name")
    ctx = f"pin {name!r}: "
    if not raw.get("vllm_version"):
        raise err(ctx + "vllm_version is required (the version the build reports)", "name")
    python = raw.get("python", "3.12")
    if not _PY.match(python):
        raise err(ctx + f"python must look like '3.12', got {python!r}", "python")
    wheel, sha = raw.get("wheel", ""), raw.get("wheel_sha256", "")
    if bool(wheel) != bool(sha):
        raise err(ctx + "wheel and wheel_sha256 go together", "wheel" if wheel else "wheel_sha256",
                  hint="a wheel is only trusted with the sha256 of the exact file")
    if sha and not _SHA256.match(sha):
        raise err(ctx + f"wheel_sha256 is not 64 lower-case hex digits: {sha!r}", "wheel_sha256")
    if wheel and not wheel.endswith(".whl"):
        raise err(ctx + f"wheel must be a .whl file name, got {wheel!r}", "wheel")
    image = raw.get("image", "")
    if image and not _IMAGE.match(image):
        hint = "pin the image by digest: repo@sha256:<64 hex>; tags move, digests do not"
        if "@" not in image:
            raise err(ctx + f"image {image!r} is a tag without a digest", "image", hint=hint)
        raise err(ctx + f"image {image!r} is not repo@sha256:<64 hex>", "image", hint=hint)
    digests = raw.get("platform_digests", {}) or {}
    for plat, dig in digests.items():
        if plat not in _PLATFORMS:
            raise err(ctx + f"unknown platform {plat!r} in platform_digests", "platform_digests",
                      hint="use " + " or ".join(_PLATFORMS))
        if not _DIGEST.match(dig):
            raise err(ctx + f"platform digest for {plat} is not sha256:<64 hex>", "platform_digests")
    config_digest, tarball = raw.get("image_config_digest", ""), raw.get("image_tarball", "")
    if config_digest and not _DIGEST.match(config_digest):
        raise err(ctx + f"image_config_digest is not sha256:<64 hex>: {config_digest!r}", "image_config_digest",
                  hint="`docker image inspect --format '{{.Id}}' IMAGE` prints it")
    if tarball and not config_digest:
        raise err(ctx + "image_tarball needs image_config_digest", "image_tarball",
                  hint="a tarball is only trusted with the config digest recorded when it was saved")
    if digests and not image:
        raise err(ctx + "platform_digests need the image they belong to", "platform_digests")
    tag = raw.get("image_tag", "")
    if tag and ("@" in tag or not re.match(r"^[a-z0-9][a-z0-9._/:-]*:[A-Za-z0-9_][A-Za-z0-9._-]*$", tag)):
        raise err(ctx + f"image_tag must look like repo:tag, got {tag!r}", "image_tag",
                  hint="a digest belongs in image; image_tag is what `serving-truth lock resolve` resolves")
    if not wheel and not image and not config_digest and not tag:
        raise err(ctx + "neither a wheel nor an image: nothing can be audited", "name")
    return Pin(
        name=name, vllm_version=raw["vllm_version"], python=python, wheel=wheel, wheel_sha256=sha,
        image=image, platform_digests=dict(digests), vllm_commit=raw.get("vllm_commit", ""),
        note=raw.get("note", ""), image_config_digest=config_digest, image_tarball=tarball, image_tag=tag,
        line=line or 0,
    )
