"""images.lock: the pinned audit targets.

Format (TOML, read with :mod:`tomllib`)::

    schema = 1

    [[pin]]
    name = "v0.33.0"                # what users type: make audit PIN=v0.33.0
    vllm_version = "0.33.0"
    python = "3.12"                  # interpreter the local runtime builds the env with
    wheel = "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel_sha256 = "..."             # sha256 of that exact file (on PyPI, or at wheel_url)
    wheel_url = ""                   # where a wheel that is not on PyPI comes from (https://, http://, file:///)
    image = ""                       # repo@sha256:<digest> (a manifest list or one manifest)
    platform_digests = {}            # {"linux/amd64" = "sha256:...", "linux/arm64" = "sha256:..."}
    image_config_digest = ""         # sha256 of the image config = Docker's image ID
    image_tarball = ""               # `docker save` output, relative to this file; needs the config digest
    image_tag = ""                   # repo:tag that `serving-truth lock resolve` turns into `image`; never run
    vllm_commit = ""                 # git sha: the short one the build reports (g1234abcd) or the full commit
    note = ""

    [pin.host]                       # what the pin's official image gives vLLM's availability checks
    source = "..."                   # where these were read (the image's recipe, file:line; its inventory)
    nvcc = true                      # a CUDA toolkit where vLLM looks
    ninja = true
    flashinfer_cubin = true
    flashinfer_jit_cache = true
    cuda = "13.0.2"                  # information

``[pin.host]`` declares the host facts vLLM reads (``audit/pins/hosts.py`` names them and says what reads each);
``--host image`` audits under them, ``--host pip`` under a plain pip install with no toolkit. A pin without the
table is audited under the harness's own arrangement, and its ledger says the facts were not declared.

``wheel_url`` pins a build that is not on PyPI (a vLLM nightly from its per-commit index, a pre-release, a
local file): the local runtime downloads it from there, checks the sha256 of the bytes and installs it
like a PyPI wheel. ``serving-truth lock add NAME --commit SHA`` writes such a pin (audit/pins/wheelindex.py).
Without ``wheel_url`` the wheel comes from PyPI (``pip download vllm==<vllm_version>``).

Every field that becomes part of a path is validated here (file:line errors): ``name`` and the PEP 440
``vllm_version`` (which name directories under the cache), ``wheel`` (a plain wheel file name for vLLM at
exactly ``vllm_version``; the last component of ``wheel_url`` must be that name), ``image_tarball`` (relative
to this file, never leaving its directory tree).

Versions order as PEP 440 orders them (``0.34.0rc1.dev123+gabc`` < ``0.34.0rc1`` < ``0.34.0``); see
:func:`version_key`, :func:`sorted_pins` and :func:`previous_pin`. A setuptools-scm fallback version from a
branch without a release tag (``0.1.devN+g...``) says nothing about where the build sits and is unplaced.

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

from audit import engines
from audit.errors import LockError, UnknownPinError, UnsafeLockPath
from audit.tomlpos import header_lines, key_line, read_toml

SCHEMA = 1
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}\Z")
_IMAGE = re.compile(r"^(?P<repo>[a-z0-9][a-z0-9._/:-]*?)@(?P<digest>sha256:[0-9a-f]{64})\Z")
_SHA256 = re.compile(r"^[0-9a-f]{64}\Z")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*\Z")
_PY = re.compile(r"^3\.\d{1,2}\Z")
_PLATFORMS = ("linux/amd64", "linux/arm64")
#: keys every pin may carry; an engine's own version and commit keys (audit/engines) are known on its pins only
_KNOWN_KEYS = {
    "name", "python", "wheel", "wheel_sha256", "image", "platform_digests", "engine", "overrides", "overrides_why",
    "note", "image_config_digest", "image_tarball", "image_tag", "wheel_url", "host",
}
#: PEP 440 (public version plus optional local label); nothing else, so a version is always one safe path part
_VERSION = re.compile(
    r"^(?P<release>\d+(?:\.\d+)*)"
    r"(?:(?P<pre_l>a|b|rc)(?P<pre_n>\d+))?"
    r"(?:\.post(?P<post>\d+))?"
    r"(?:\.dev(?P<dev>\d+))?"
    r"(?:\+(?P<local>[a-z0-9]+(?:\.[a-z0-9]+)*))?\Z")
#: {distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl, each part free of path characters
_WHEEL = re.compile(r"^(?P<dist>[A-Za-z0-9_.]+?)-(?P<version>[A-Za-z0-9_.+!]+)(?:-(?P<build>\d[A-Za-z0-9_]*))?"
                    r"-(?P<py>[A-Za-z0-9_.]+)-(?P<abi>[A-Za-z0-9_.]+)-(?P<plat>[A-Za-z0-9_.]+)\.whl\Z")
_COMMIT = re.compile(r"^g?[0-9a-f]{7,40}\Z")
_REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9._+!]+\Z")
_URL_SCHEMES = ("https", "http", "file")


def parse_wheel_name(filename: str) -> dict | None:
    """The parts of a wheel file name (dist, version, build, py, abi, plat), or None if it is not one."""
    m = _WHEEL.match(filename)
    return m.groupdict() if m and not filename.startswith(".") and ".." not in filename else None


def version_key(version: str) -> tuple:
    """A sort key that orders versions as PEP 440 does: ``1.0.dev1 < 1.0a1 < 1.0rc1.dev2 < 1.0rc1 < 1.0 <
    1.0.post1``, a local label (``+g1234abc``, ``+cu130``) after the same public version without one.
    Raises ValueError for a string that is not such a version."""
    m = _VERSION.match(version.lower())
    if not m:
        raise ValueError(f"not a PEP 440 version: {version!r}")
    release = [int(x) for x in m["release"].split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    pre, post, dev = m["pre_l"], m["post"], m["dev"]
    if pre:
        pre_key = (1, ("a", "b", "rc").index(pre), int(m["pre_n"]))
    elif dev is not None and post is None:
        pre_key = (0,)  # X.devN comes before X's pre-releases
    else:
        pre_key = (2,)
    post_key = (0,) if post is None else (1, int(post))
    dev_key = (1,) if dev is None else (0, int(dev))
    local_key = (0,) if not m["local"] else (1, tuple((1, int(p), "") if p.isdigit() else (0, 0, p)
                                                      for p in m["local"].split(".")))
    return (tuple(release), pre_key, post_key, dev_key, local_key)


def is_placed(version: str) -> bool:
    """False for setuptools-scm's fallback version (``0.1.devN+g...``) of a build from a branch that no
    release tag reaches: its number says nothing about which releases it comes between."""
    m = _VERSION.match(version.lower())
    return bool(m) and not (m["release"] == "0.1" and m["dev"] is not None)


@dataclass(frozen=True)
class Pin:
    name: str
    #: the engine's release version (images.lock's ``<engine>_version``: ``vllm_version`` for a vLLM pin)
    version: str
    python: str = "3.12"
    wheel: str = ""
    wheel_sha256: str = ""
    image: str = ""
    platform_digests: dict[str, str] = field(default_factory=dict)
    #: the build's git sha (images.lock's ``<engine>_commit``)
    commit: str = ""
    note: str = ""
    image_config_digest: str = ""
    image_tarball: str = ""
    image_tag: str = ""
    wheel_url: str = ""
    line: int = 0
    #: the official image's host facts (``[pin.host]``: audit/pins/hosts.py), {} where none are declared
    host: dict = field(default_factory=dict, compare=False, hash=False)
    #: the serving engine the pin is a release of (``audit/engines``); images.lock's ``engine``, vLLM where absent
    engine: str = engines.DEFAULT
    #: requirements that replace one the wheel declares, where the declared one cannot be installed from PyPI
    #: (images.lock's ``overrides``, each ``name==version``, with ``overrides_why`` saying why); () for most pins
    overrides: tuple[str, ...] = ()
    overrides_why: str = ""

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

    @property
    def wheel_source(self) -> str:
        """Where the local runtime gets the wheel: ``pypi`` or ``url`` (wheel_url); "" without a wheel."""
        return ("url" if self.wheel_url else "pypi") if self.has_wheel else ""

    @property
    def placed(self) -> bool:
        """Whether the pin's version says where it sits among releases (see :func:`is_placed`)."""
        return is_placed(self.version)

    @property
    def engine_contract(self) -> engines.Engine:
        """The pin's engine (:mod:`audit.engines`)."""
        return engines.get(self.engine)

    def as_provenance(self) -> dict:
        e = self.engine_contract
        out = {
            "name": self.name,
            e.version_key: self.version,
            "python": self.python,
            "wheel": self.wheel,
            "wheel_sha256": self.wheel_sha256,
            "image": self.image,
            "platform_digests": dict(sorted(self.platform_digests.items())),
            e.commit_key: self.commit,
            "image_config_digest": self.image_config_digest,
            "image_tarball": self.image_tarball,
        }
        if self.wheel_url:  # only when set, so the routing of PyPI pins stays byte-identical
            out["wheel_url"] = self.wheel_url
        if self.engine != engines.DEFAULT or self.overrides:  # likewise: the first engine's pins name none
            out["engine"] = self.engine
            out["overrides"] = list(self.overrides)
            out["overrides_why"] = self.overrides_why
        return out


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
        raise LockError("no [[pin]] tables", path=spath, hint="see the format at the top of audit/pins/lock.py")
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

    engine_name = raw.get("engine", engines.DEFAULT)
    if not isinstance(engine_name, str) or engine_name not in engines.ENGINES:
        raise err(f"unknown engine {engine_name!r}", "engine", hint="known engines: " + ", ".join(engines.ENGINES))
    engine = engines.get(engine_name)
    known = _KNOWN_KEYS | {engine.version_key, engine.commit_key}
    unknown = sorted(set(raw) - known)
    if unknown:
        other = unknown[0] in engines.version_keys()
        raise err(f"unknown key {unknown[0]!r} in [[pin]]" + (f" of the engine {engine.name!r}" if other else ""),
                  unknown[0], hint=(f"a {engine.title} pin states {engine.version_key} and {engine.commit_key} "
                                    "(engine = \"...\" names another engine)") if other else
                  "known keys: " + ", ".join(sorted(known)))
    for key, value in raw.items():
        if key == "host":
            continue  # checked below, as a table
        if key == "platform_digests":
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise err("platform_digests must be a table of strings", key)
        elif key == "overrides":
            if not isinstance(value, list) or not all(isinstance(v, str) and _REQUIREMENT.match(v) for v in value):
                raise err("overrides must be a list of exact requirements (\"name==version\")", key,
                          hint='e.g. overrides = ["cuda-tile==1.6.0rc7"], with overrides_why saying why')
        elif not isinstance(value, str):
            raise err(f"{key} must be a string, got {type(value).__name__}", key)
    name = raw.get("name", "")
    if not name:
        raise err("pin without a name", hint='add name = "..."')
    if not _NAME.match(name):
        raise err(f"pin name {name!r} has characters not allowed in a directory name", "name")
    reserved = reserved_names()
    if name.lower() in reserved:
        raise err(f"pin name {name!r} is reserved: {reserved[name.lower()]}, so a report of this pin would be "
                  "written into it", "name", hint="rename the pin (e.g. add a version or date to it)")
    ctx = f"pin {name!r}: "
    vkey, ckey = engine.version_key, engine.commit_key
    version = raw.get(vkey, "")
    if not version:
        raise err(ctx + f"{vkey} is required (the version the build reports)", "name")
    if not _VERSION.match(version.lower()):
        raise err(ctx + f"{vkey} {version!r} is not a PEP 440 version", vkey,
                  hint="the version the build reports, e.g. 0.33.0, 0.34.0rc1 or 0.34.0rc1.dev123+gabcdef012; "
                       "it names directories under the cache, so nothing else is accepted")
    python = raw.get("python", engine.python)
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
    if wheel:
        parts = parse_wheel_name(wheel)
        if parts is None:
            raise err(ctx + f"wheel {wheel!r} is not a plain wheel file name", "wheel",
                      hint="{distribution}-{version}-{python}-{abi}-{platform}.whl, no directories; it names a "
                           "file in the cache")
        if parts["dist"].lower() != engine.package or parts["version"] != version:
            raise err(ctx + f"wheel {wheel!r} is not {engine.title} {version}", "wheel",
                      hint=f"the file name's distribution must be {engine.package} and its version the pin's {vkey}")
    url = raw.get("wheel_url", "")
    if url:
        if not wheel:
            raise err(ctx + "wheel_url needs wheel and wheel_sha256", "wheel_url",
                      hint="the file name and the sha256 of the exact bytes at the URL (serving-truth lock add "
                           "writes all three)")
        problem = wheel_url_problem(url, wheel)
        if problem:
            raise err(ctx + f"wheel_url {url!r} {problem}", "wheel_url")
    commit = raw.get(ckey, "")
    if commit and not _COMMIT.match(commit):
        raise err(ctx + f"{ckey} {commit!r} is not a git sha", ckey,
                  hint="7 to 40 lower-case hex digits, optionally prefixed with g as vLLM's builds report it")
    overrides = tuple(raw.get("overrides", ()))
    if overrides and not raw.get("overrides_why"):
        raise err(ctx + "overrides need overrides_why", "overrides",
                  hint="say why each declared requirement of the wheel cannot be installed as declared")
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
    if tarball and (tarball.startswith(("/", "~")) or "\\" in tarball or ".." in tarball.split("/")):
        raise err(ctx + f"image_tarball {tarball!r} leaves the directory of this lock file", "image_tarball",
                  hint="give a path relative to images.lock, without '..'")
    if tarball and not config_digest:
        raise err(ctx + "image_tarball needs image_config_digest", "image_tarball",
                  hint="a tarball is only trusted with the config digest recorded when it was saved")
    if digests and not image:
        raise err(ctx + "platform_digests need the image they belong to", "platform_digests")
    tag = raw.get("image_tag", "")
    if tag and ("@" in tag or not re.match(r"^[a-z0-9][a-z0-9._/:-]*:[A-Za-z0-9_][A-Za-z0-9._-]*\Z", tag)):
        raise err(ctx + f"image_tag must look like repo:tag, got {tag!r}", "image_tag",
                  hint="a digest belongs in image; image_tag is what `serving-truth lock resolve` resolves")
    if not wheel and not image and not config_digest and not tag:
        raise err(ctx + "neither a wheel nor an image: nothing can be audited", "name")
    host = raw.get("host", {})
    if host:
        from audit.pins.hosts import check_facts

        problem = check_facts(host) if isinstance(host, dict) else "host must be a table ([pin.host])"
        if problem:
            at = next((i for i, l in enumerate(text.splitlines(), 1) if i > (line or 0) and l.strip() == "[pin.host]"),
                      line)
            raise LockError(ctx + problem, path=path, line=at,
                            hint="declare every fact of audit/pins/hosts.py (FACTS) with its type, and the source")
    return Pin(
        name=name, version=version, python=python, wheel=wheel, wheel_sha256=sha, wheel_url=url,
        image=image, platform_digests=dict(digests), commit=commit,
        note=raw.get("note", ""), image_config_digest=config_digest, image_tarball=tarball, image_tag=tag,
        line=line or 0, host=dict(sorted(host.items())) if host else {}, engine=engine.name, overrides=overrides,
        overrides_why=raw.get("overrides_why", ""),
    )


def wheel_url_problem(url: str, wheel: str) -> str:
    """Why *url* cannot be where *wheel* comes from ("" when it can)."""
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(url)
    if parts.scheme not in _URL_SCHEMES:
        return "must be an https://, http:// or file:/// URL"
    if parts.username or parts.password:
        return "carries credentials; images.lock is committed, so it never holds any"
    if parts.scheme == "file" and (parts.netloc not in ("", "localhost") or not parts.path.startswith("/")):
        return "must be file:///absolute/path"
    if parts.scheme != "file" and not parts.hostname:
        return "names no host"
    last = unquote(parts.path).rsplit("/", 1)[-1]
    if last != wheel:
        return f"does not end in the pinned wheel file name ({wheel})"
    return ""


#: folders under reports/ that are not a pin's report
RESERVED_REPORT_FOLDERS = {"diffs": "reports/diffs/ holds the diffs between pins",
                           "hosts": "reports/hosts/ holds the reports of audits on another host than the image's",
                           "compare": "reports/compare/ holds the side-by-side tables of two engines"}


def reserved_names() -> dict[str, str]:
    """Names no pin may take (lower case -> why): the folders under reports/ that are not a pin's report, and
    every model's name (another model's reports live in reports/<model>/)."""
    from audit.models import PROFILES  # the model registry (base layer); imported here, when a lock is read

    out = dict(RESERVED_REPORT_FOLDERS)
    out.update({m.lower(): f"it is the name of the model {m!r} (a model other than the default keeps its reports in "
                           f"reports/<model>/)" for m in PROFILES})
    out.update({e.reports_folder.lower(): f"it is the folder of the engine {e.title}'s reports (reports/"
                                          f"{e.reports_folder}/)" for e in engines.ENGINES.values() if e.reports_folder})
    return out


def unsafe_path_field(pin: Pin) -> tuple[str, str] | None:
    """(field, value) of the first field of *pin* that must not become part of a cache path, or None.

    :func:`load` refuses such pins with file:line; this is the same check for a Pin built any other way,
    which the local runtime repeats before it names, deletes or runs anything under the cache."""
    if not _NAME.match(pin.name):
        return "name", pin.name
    if not _VERSION.match(pin.version.lower()):
        return pin.engine_contract.version_key, pin.version
    if not _PY.match(pin.python):
        return "python", pin.python
    if pin.wheel and parse_wheel_name(pin.wheel) is None:
        return "wheel", pin.wheel
    if pin.wheel_sha256 and not _SHA256.match(pin.wheel_sha256):
        return "wheel_sha256", pin.wheel_sha256
    return None


def contained(path: Path, parent: Path, pin: Pin, field: str, value: str) -> Path:
    """*path* itself when it is a direct child of *parent* (after resolving *parent*) and not a symbolic link;
    else refuse: a pin's fields name files under the cache, never elsewhere."""
    if path.parent.resolve() != parent.resolve() or path.name in ("", ".", "..") or "/" in path.name:
        raise UnsafeLockPath(pin=pin.name, field=field, value=value, root=str(parent))
    if path.is_symlink():
        raise UnsafeLockPath(pin=pin.name, field=field, value=f"{value} (a symbolic link)", root=str(parent))
    return path


def default_runtime(pin: Pin) -> str:
    """The runtime an audit of *pin* uses when none is asked for: the wheel in a local venv when the pin has
    one, else its image under docker. A pin with neither (an unresolved ``image_tag``) is a UsageError that
    says what to add."""
    from audit.errors import UsageError

    if pin.runtimes:
        return pin.runtimes[0]
    raise UsageError(f"pin {pin.name!r} has neither a wheel nor a digest-pinned image to audit",
                     hint=f"resolve its image_tag (make lock-resolve PIN={pin.name}), or add its wheel "
                          f"(serving-truth lock add NAME --commit SHA)")


def _pin_order(pin: Pin) -> tuple:
    return (0, version_key(pin.version)) if pin.placed else (1,)


def sorted_pins(lock: Lock) -> list[Pin]:
    """The lock's pins in release order (PEP 440: dev < rc < release < post), each engine's apart (the first engine's
    first, then the others in the registry's order); pins of one version keep the order of the lock file, unplaced
    builds (see :func:`is_placed`) come last in the order of the file."""
    order = list(engines.ENGINES)
    return sorted(lock.pins.values(), key=lambda p: (_pin_order(p)[0], order.index(p.engine), _pin_order(p)))


def previous_pin(lock: Lock, name: str, *, releases_only: bool = False) -> Pin | None:
    """The pin that precedes *name* in release order: among the pins of its engine whose version is strictly lower
    than its own, those with the highest version, and of those the first in the lock file.

    A pin of the same version earlier in the file comes first: it is the build this one replaces (a wheel
    rebuilt with the same version and file name is a different build, told apart only by its bytes).

    This is the natural "changes since" baseline: a nightly ``0.34.0rc1.dev123+gabc`` follows ``v0.33.0``
    (and a later nightly, say ``0.34.0rc1.dev200+gdef``, follows that one); the release ``0.34.0`` follows
    the last pinned 0.34.0 pre-release or nightly. With ``releases_only`` only final releases (no dev, rc,
    alpha or beta part) are candidates, so ``v0.34.0`` follows ``v0.33.0`` whatever nightlies are pinned.

    Returns None when nothing precedes it, and for an unplaced build (a ``0.1.devN`` version from a branch
    without a release tag, whose number says nothing about its place); unplaced builds are never anyone's
    predecessor either. Raises :class:`~audit.errors.UnknownPinError` for a name not in the lock.
    """
    pin = lock.get(name)
    if not pin.placed:
        return None
    mine = version_key(pin.version)
    # only a release of the same engine precedes a pin (another engine's versions are another sequence)
    same = {n: p for n, p in lock.pins.items() if p.engine == pin.engine}
    lock = Lock(path=lock.path, pins=same)
    if not releases_only:
        # a build of the same version pinned earlier in the file is the one this build replaces (a rebuilt
        # wheel, a patched image): that is what a release owner compares it with
        order = list(lock.pins)
        earlier = [p for p in order[:order.index(name)]
                   if lock.pins[p].placed and version_key(lock.pins[p].version) == mine]
        if earlier:
            return lock.pins[earlier[-1]]
    best: Pin | None = None
    for other in lock.pins.values():  # file order: the first of equal versions wins
        if other.name == name or not other.placed:
            continue
        key = version_key(other.version)
        if releases_only and (key[1] != (2,) or key[3] != (1,)):
            continue
        if key < mine and (best is None or key > version_key(best.version)):
            best = other
    return best
