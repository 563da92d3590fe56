"""Wheels that are not on PyPI: vLLM's per-commit wheel index, wheel URLs, and ``serving-truth lock add``.

vLLM publishes a wheel for every commit on ``main`` (docs: contributing/ci/nightly_builds; generator:
``.buildkite/scripts/generate-nightly-index.py``). Under the index root (``https://wheels.vllm.ai``)::

    <commit>/                       the wheels of that commit, and its indexes
        vllm-<version>-cp38-abi3-manylinux_2_31_x86_64.whl      default variant (no variant in the name)
        vllm-<version>.cu130-cp38-abi3-manylinux_2_31_aarch64.whl  a variant (".cuXXX", ".cpu" after a dev
                                                                   version, "+cuXXX" after a release)
        index.html                  project list (PEP 503): "vllm/" and one entry per variant directory
        vllm/index.html             package index of the default variant: <a href="../<file>">
        vllm/metadata.json          [{package_name, version, build_tag, python_tag, abi_tag, platform_tag,
                                      variant, filename, path}], path relative to vllm/ and URL-quoted
        <variant>/vllm/index.html, <variant>/vllm/metadata.json   the same per variant (href "../../<file>")
    nightly/                        the same indexes for the newest commit on main (moves)
    <release>/                      the same for a release

Wheel versions are setuptools-scm dev versions (``0.34.0rc1.dev123+gabcdef012``). The indexes carry no
hash, so ``lock add`` hashes the bytes it receives (and checks a ``#sha256=`` link fragment or ``--sha256``
when there is one), reads the name, version and commit the wheel itself records, and only then writes the
pin. Nothing is written when anything fails. Base URLs: ``--index-url`` or ``$SERVING_TRUTH_WHEEL_INDEX``,
``--github-api`` or ``$SERVING_TRUTH_GITHUB_API`` (the commit lookup for "main as of a date" and short
shas). Standard library only.
"""
from __future__ import annotations

import dataclasses

import email.parser
import html.parser
import json
import os
import platform as platmod
import re
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from datetime import date as date_cls, datetime, timezone
from pathlib import Path
from typing import Callable

from audit.errors import LockError, NoWheelForPlatform, UsageError, WheelSourceError
from audit.pins.fetch import INDEX_ENV, _get, download
from audit.fsutil import cache_root as default_cache_root
from audit.pins.wheelcache import WheelCache

DEFAULT_INDEX = "https://wheels.vllm.ai"
DEFAULT_GITHUB_API = "https://api.github.com"
GITHUB_ENV = "SERVING_TRUTH_GITHUB_API"
VLLM_REPO = "vllm-project/vllm"
#: how many commits before the date "main as of" tries when the newest ones have no wheel yet
AS_OF_TRIES = 10
_ARCHES = {"amd64": "x86_64", "x86_64": "x86_64", "arm64": "aarch64", "aarch64": "aarch64"}

Progress = Callable[[str], None]


@dataclass(frozen=True)
class WheelEntry:
    filename: str
    url: str
    version: str
    platform_tag: str
    python_tag: str
    abi_tag: str
    variant: str = ""
    #: from a ``#sha256=`` fragment of the package index, when it has one
    sha256: str = ""
    #: the file's size in bytes where the index states it (its metadata.json): the download may take no more
    size: int = 0


def index_base(explicit: str | None = None) -> str:
    base = (explicit or os.environ.get(INDEX_ENV) or DEFAULT_INDEX).rstrip("/")
    if urllib.parse.urlsplit(base).scheme not in ("https", "http", "file"):
        raise UsageError(f"wheel index {base!r} is not an http(s):// or file:// URL")
    return base


def github_api(explicit: str | None = None) -> str:
    return (explicit or os.environ.get(GITHUB_ENV) or DEFAULT_GITHUB_API).rstrip("/")


# -- the per-commit index -------------------------------------------------------------------------------
class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.links.append(href)


def _entry(filename: str, url: str, *, variant: str = "", sha256: str = "") -> WheelEntry | None:
    from audit.pins.lock import parse_wheel_name

    parts = parse_wheel_name(filename)
    if parts is None or parts["dist"].lower() != "vllm":
        return None
    return WheelEntry(filename=filename, url=url, version=parts["version"], platform_tag=parts["plat"],
                      python_tag=parts["py"], abi_tag=parts["abi"], variant=variant or "", sha256=sha256)


def package_url(base: str, commit: str, variant: str | None = None) -> str:
    return f"{base}/{commit}/" + (f"{variant}/" if variant else "") + "vllm/"


def read_commit_index(base: str, commit: str, variant: str | None = None) -> tuple[str, list[WheelEntry]]:
    """(package index URL, the vLLM wheels it lists) for one commit: ``metadata.json`` when the index has
    one, ``index.html`` (PEP 503) otherwise; ``#sha256=`` fragments of index.html are kept."""
    pkg = package_url(base, commit, variant)
    hashes: dict[str, str] = {}
    html_links: list[str] | None = None
    try:
        parser = _Links()
        parser.feed(_get(pkg + "index.html", what="package index").decode("utf-8", "replace"))
        html_links = parser.links
    except WheelSourceError as exc:
        if exc.status != 404:
            raise
    for href in html_links or []:
        frag = urllib.parse.urlsplit(href).fragment
        m = re.fullmatch(r"sha256=([0-9a-f]{64})", frag)
        if m:
            name = urllib.parse.unquote(urllib.parse.urlsplit(href).path).rsplit("/", 1)[-1]
            hashes[name] = m.group(1)
    try:
        raw = _get(pkg + "metadata.json", what="wheel metadata")
    except WheelSourceError as exc:
        if exc.status != 404:
            raise
        raw = None
    entries: list[WheelEntry] = []
    if raw is not None:
        try:
            items = json.loads(raw)
            if not isinstance(items, list):
                raise ValueError("not a list")
        except ValueError as exc:
            raise WheelSourceError(f"{pkg}metadata.json is not the list of wheels vLLM's index writes: {exc}",
                                   url=pkg + "metadata.json") from None
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("filename"), str) \
                    or not isinstance(item.get("path"), str):
                continue
            split = urllib.parse.urlsplit(item["path"])
            if split.scheme or split.netloc:  # relative paths only, as the generator writes them (no //host/...)
                continue
            e = _entry(item["filename"], urllib.parse.urljoin(pkg, item["path"]), variant=item.get("variant") or "",
                       sha256=hashes.get(item["filename"], ""))
            if e:
                stated = item.get("size")
                entries.append(dataclasses.replace(e, size=stated) if isinstance(stated, int) and stated > 0 else e)
    elif html_links is not None:
        for href in html_links:
            split = urllib.parse.urlsplit(href)
            if split.scheme or split.netloc:  # a link to another host (absolute or //host/...) is not this index's
                continue
            name = urllib.parse.unquote(split.path).rsplit("/", 1)[-1]
            e = _entry(name, urllib.parse.urljoin(pkg, urllib.parse.urlunsplit(split._replace(fragment=""))),
                       variant=variant or "", sha256=hashes.get(name, ""))
            if e:
                entries.append(e)
    else:
        raise WheelSourceError(
            f"no wheel index for commit {commit} at {pkg} (neither metadata.json nor index.html; HTTP 404)", url=pkg,
            status=404,
            hint="vLLM publishes wheels for commits on main once their release build has finished; a PR commit has "
                 "none. Check the full commit sha, the variant, and --index-url")
    return pkg, entries


def host_arch() -> str:
    machine = platmod.machine().lower()
    return _ARCHES.get(machine, machine)


def _python_ok(entry: WheelEntry, python: str) -> bool:
    want = int(python.split(".")[1])
    for tag in entry.python_tag.split("."):
        m = re.fullmatch(r"cp3(\d+)", tag)
        if tag in ("py3", "py2.py3"):
            return True
        if m and (int(m.group(1)) == want or (entry.abi_tag == "abi3" and int(m.group(1)) <= want)):
            return True
    return False


def pick_wheel(entries: list[WheelEntry], *, arch: str, python: str, url: str, commit: str) -> WheelEntry:
    """The one wheel for *arch* and *python* (the index's variant is chosen by which index was read)."""
    ok = [e for e in entries
          if any(t.endswith("_" + arch) for t in e.platform_tag.split(".")) and _python_ok(e, python)]
    if not ok:
        raise NoWheelForPlatform(url=url, commit=commit, platform=f"linux {arch}, Python {python}",
                                 available=sorted(e.filename for e in entries))
    if len(ok) > 1:
        raise WheelSourceError(f"several wheels at commit {commit} fit linux {arch}, Python {python}: "
                               + ", ".join(e.filename for e in ok), url=url,
                               hint="pin the one you mean with --wheel-url URL")
    return ok[0]


def inspect_wheel(path: Path) -> dict:
    """What the wheel itself records: distribution name and version (its METADATA) and the git commit its
    ``vllm/_version.py`` reports (``""`` when it reports none)."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            meta_name = next((n for n in names if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)), None)
            if meta_name is None:
                raise WheelSourceError(f"{path.name} has no .dist-info/METADATA: not a wheel", url=str(path),
                                       step="inspect wheel")
            meta = email.parser.Parser().parsestr(zf.read(meta_name).decode("utf-8", "replace"), headersonly=True)
            commit = ""
            if "vllm/_version.py" in names:
                text = zf.read("vllm/_version.py").decode("utf-8", "replace")
                m = re.search(r"commit_id\s*=\s*['\"]([0-9a-zA-Z]+)['\"]", text)
                commit = m.group(1) if m else ""
    except (zipfile.BadZipFile, OSError) as exc:
        raise WheelSourceError(f"{path.name} is not a readable wheel: {exc}", url=str(path),
                               step="inspect wheel") from None
    return {"name": meta.get("Name", ""), "version": meta.get("Version", ""), "commit": commit}


# -- commits ------------------------------------------------------------------------------------------
def _github_json(url: str):
    body = _get(url, what="GitHub commit lookup", step="commit lookup", accept="application/vnd.github+json")
    try:
        return json.loads(body)
    except ValueError:
        raise WheelSourceError(f"{url} did not answer JSON", url=url, step="commit lookup") from None


def full_commit(commit: str, *, api: str, repo: str = VLLM_REPO) -> str:
    """A 40-hex commit: as given, or looked up from a shorter sha on GitHub."""
    commit = commit.lower().removeprefix("g") if re.fullmatch(r"g[0-9a-f]{7,39}", commit.lower()) else commit.lower()
    if re.fullmatch(r"[0-9a-f]{40}", commit):
        return commit
    if not re.fullmatch(r"[0-9a-f]{7,39}", commit):
        raise UsageError(f"--commit {commit!r} is not a git sha", hint="7 to 40 hex digits")
    data = _github_json(f"{api}/repos/{repo}/commits/{commit}")
    sha = data.get("sha", "") if isinstance(data, dict) else ""
    if not re.fullmatch(r"[0-9a-f]{40}", sha) or not sha.startswith(commit):
        raise WheelSourceError(f"{api} resolved {commit} to {sha!r}", url=api, step="commit lookup")
    return sha


def commits_before(day: str, *, api: str, repo: str = VLLM_REPO, branch: str = "main",
                   count: int = AS_OF_TRIES) -> list[tuple[str, str]]:
    """[(sha, committer date)] of the newest *count* commits on *branch* at the end of *day* (UTC), newest
    first."""
    try:
        d = date_cls.fromisoformat(day)
    except ValueError:
        raise UsageError(f"--date {day!r} is not a date", hint="YYYY-MM-DD (the end of that day, UTC)") from None
    if d > datetime.now(timezone.utc).date():
        raise UsageError(f"--date {day} is in the future")
    query = urllib.parse.urlencode({"sha": branch, "until": f"{d.isoformat()}T23:59:59Z", "per_page": count})
    data = _github_json(f"{api}/repos/{repo}/commits?{query}")
    out = []
    for item in data if isinstance(data, list) else []:
        sha = item.get("sha", "") if isinstance(item, dict) else ""
        when = ((item.get("commit") or {}).get("committer") or {}).get("date", "") if isinstance(item, dict) else ""
        if re.fullmatch(r"[0-9a-f]{40}", sha):
            out.append((sha, when))
    if not out:
        raise WheelSourceError(f"{api} lists no commit on {repo} {branch} before the end of {day}", url=api,
                               step="commit lookup")
    return out


def nightly_commit(base: str) -> str:
    """The commit the moving ``nightly/`` directory points at now: its package index links every wheel as
    ``../../<commit>/<file>`` (the wheels live in the commit's directory)."""
    pkg = f"{base}/nightly/vllm/"
    commits = set()
    raw = _get(pkg + "metadata.json", what="nightly wheel metadata")
    try:
        items = json.loads(raw)
    except ValueError:
        items = None
    for item in items if isinstance(items, list) else []:
        path = item.get("path") if isinstance(item, dict) else None
        if isinstance(path, str):
            parts = urllib.parse.urlsplit(urllib.parse.urljoin(pkg, path)).path.split("/")
            commits.update(p for p in parts[-2:-1] if re.fullmatch(r"[0-9a-f]{40}", p))
    if len(commits) != 1:
        raise WheelSourceError(f"{pkg}metadata.json does not link the wheels of exactly one commit "
                               f"(found {sorted(commits) or 'none'})", url=pkg + "metadata.json",
                               hint="pin a commit with --commit SHA")
    return commits.pop()


# -- lock add -----------------------------------------------------------------------------------------
def _toml_str(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string


def pin_block(fields: dict) -> str:
    lines = ["[[pin]]"]
    for key, value in fields.items():
        if key == "platform_digests":
            if value:
                lines.append("platform_digests = { " + ", ".join(f"{_toml_str(k)} = {_toml_str(v)}"
                                                                  for k, v in sorted(value.items())) + " }")
        elif value:
            lines.append(f"{key} = {_toml_str(value)}")
    return "\n".join(lines) + "\n"


def add_pin(lock_path: str | Path, name: str, *, commit: str | None = None, as_of: str | None = None,
            nightly: bool = False,
            wheel_url: str | None = None, image_tag: str | None = None, vllm_version: str | None = None,
            variant: str | None = None, arch: str | None = None, python: str = "3.12", sha256: str | None = None,
            index_url: str | None = None, github: str | None = None, note: str = "",
            cache_root: Path | None = None, progress: Progress = lambda text: None) -> dict:
    """Write a new ``[[pin]]`` for a vLLM build that is not on PyPI, from facts checked here; returns its
    fields. Sources: ``commit`` (vLLM's per-commit index: the wheel for this architecture in the default
    variant, or ``variant``), ``nightly`` (the commit vLLM's moving ``nightly/`` index points at now),
    ``as_of`` (the newest commit on main at the end of that UTC day that has such a wheel), ``wheel_url`` (any wheel; ``commit`` then only records the commit), ``image_tag`` (resolved to a
    digest through the registry, alone or with a wheel). The wheel is downloaded into the cache (where the
    local runtime then finds it), hashed as received, and its own METADATA and ``_version.py`` must agree with
    its file name and the commit. images.lock is written once, atomically, at the end; on any error it is
    left as it was."""
    from audit.pins import lock as lockmod
    from audit.fsutil import write_atomic

    lock_path = Path(lock_path)
    lk = lockmod.load(lock_path)
    if name in lk.pins:
        raise UsageError(f"pin {name!r} is already in {lock_path} (line {lk.pins[name].line})",
                         hint="choose another name, or delete that [[pin]] first")
    if not lockmod._NAME.match(name):
        raise UsageError(f"pin name {name!r} has characters not allowed in a directory name")
    if sum(map(bool, (commit, as_of, nightly))) > 1:
        raise UsageError("give one of --commit, --date and --nightly")
    if wheel_url and (as_of or nightly):
        raise UsageError("--wheel-url pins that wheel; --date and --nightly choose one from the index",
                         hint="give --commit SHA with --wheel-url to record which commit the wheel is from")
    if not (commit or as_of or nightly or wheel_url or image_tag):
        raise UsageError("nothing to pin",
                         hint="give --commit SHA, --nightly, --date YYYY-MM-DD, --wheel-url URL or --image-tag")
    if sha256 and not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise UsageError(f"--sha256 {sha256!r} is not 64 lower-case hex digits")
    if not re.fullmatch(r"3\.\d{1,2}", python):
        raise UsageError(f"--python {python!r} must look like 3.12")
    if variant and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", variant):
        raise UsageError(f"--variant {variant!r} is not a variant directory name (e.g. cu130, cpu)")
    arch = _ARCHES.get((arch or host_arch()).lower(), (arch or "").lower())
    if arch not in ("x86_64", "aarch64"):
        raise UsageError(f"--arch {arch!r}: vLLM ships x86_64 and aarch64 wheels")
    fields: dict = {"name": name}
    notes = []
    #: what the release owner must know about this build (said by the CLI, kept in the pin's note)
    warnings: list[str] = []
    wants_wheel = bool(commit or as_of or nightly or wheel_url)
    if vllm_version and wants_wheel:
        raise UsageError("--vllm-version is for image-only pins; with a wheel, the wheel says its version")
    api = github_api(github)

    chosen: WheelEntry | None = None
    if nightly:
        commit = nightly_commit(index_base(index_url))
        notes.append(f"vLLM's nightly index pointed at commit {commit} on "
                     f"{datetime.now(timezone.utc).date().isoformat()}")
    if as_of:
        base = index_base(index_url)
        skipped = []
        for sha, when in commits_before(as_of, api=api):
            progress(f"main as of {as_of}: trying {sha[:12]} ({when})")
            try:
                pkg, entries = read_commit_index(base, sha, variant)
                chosen = pick_wheel(entries, arch=arch, python=python, url=pkg, commit=sha)
            except WheelSourceError as exc:
                if exc.status != 404 and not isinstance(exc, NoWheelForPlatform):
                    raise
                skipped.append(sha[:12])
                continue
            commit = sha
            notes.append(f"main as of {as_of} (end of day UTC): commit {sha} of {when}"
                         + (f"; newer commits without a {arch} wheel: {', '.join(skipped)}" if skipped else ""))
            break
        else:
            raise WheelSourceError(f"none of the {len(skipped)} newest commits on main before the end of {as_of} has "
                                   f"a {arch} wheel in {base}", url=base, hint="try another date or --commit SHA")
    elif commit:
        commit = full_commit(commit, api=api)
        if not wheel_url:
            pkg, entries = read_commit_index(index_base(index_url), commit, variant)
            chosen = pick_wheel(entries, arch=arch, python=python, url=pkg, commit=commit)
    if chosen is not None:
        wheel_url = chosen.url
        notes.insert(0, f"vLLM per-commit wheel ({'variant ' + variant if variant else 'default variant'}, {arch})")

    if wheel_url:
        filename = urllib.parse.unquote(urllib.parse.urlsplit(wheel_url).path).rsplit("/", 1)[-1]
        parts = lockmod.parse_wheel_name(filename)
        if parts is None or parts["dist"].lower() != "vllm":
            raise UsageError(f"{wheel_url} does not name a vLLM wheel file ({filename!r})")
        problem = lockmod.wheel_url_problem(wheel_url, filename)
        if problem:
            raise UsageError(f"--wheel-url {wheel_url!r} {problem}")
        announced, source = "", ""
        if sha256:
            announced, source = sha256, "--sha256"
        if chosen is not None and chosen.sha256:
            if announced and announced != chosen.sha256:
                raise UsageError(f"--sha256 {sha256} disagrees with the index's #sha256={chosen.sha256}")
            announced, source = chosen.sha256, "the index's #sha256= link"
        cache = WheelCache(cache_root or default_cache_root())
        incoming = cache.incoming / filename
        path, digest, size = download(wheel_url, incoming, expected_sha256=announced, expected_source=source,
                                      expected_size=chosen.size if chosen is not None else 0,
                                      progress=progress)
        try:
            facts = inspect_wheel(path)
            if facts["name"].lower() != "vllm" or facts["version"] != parts["version"]:
                raise WheelSourceError(f"{filename} contains {facts['name']} {facts['version']}, not what its name says",
                                       url=wheel_url, step="inspect wheel")
            reported = facts["commit"].lower().removeprefix("g")
            local = re.search(r"\+g([0-9a-f]{7,40})", parts["version"])
            for claimed, what in ((reported, "its _version.py"), (local.group(1) if local else "", "its version")):
                if commit and claimed and not commit.startswith(claimed):
                    raise WheelSourceError(f"{filename} was built from commit {claimed} ({what}), not {commit}",
                                           url=wheel_url, step="inspect wheel",
                                           hint="the index or URL does not hold that commit's build")
            cache.store(path, filename, digest)
        finally:
            if path.exists():
                path.unlink()
        fields.update(vllm_version=parts["version"], python=python, wheel=filename, wheel_sha256=digest,
                      wheel_url=wheel_url)
        if not commit and facts["commit"]:
            commit = facts["commit"]
            notes.append(f"vllm_commit {commit} is what the wheel's own _version.py says; not checked against "
                         "any repository (give --commit SHA to check it)")
        for other in lk.pins.values():
            if other.wheel_sha256 and other.wheel_sha256 != digest and (
                    other.wheel == filename or other.version == parts["version"]):
                same = "file name and version" if other.wheel == filename else "vLLM version"
                warning = (f"same {same} as pin {other.name} ({other.wheel_sha256[:12]}), different bytes: a "
                           "different build")
                notes.append(warning)
                warnings.append(warning)
        progress(f"{filename}: {size} bytes, sha256 {digest}")
    elif not vllm_version:
        raise UsageError("an image-only pin needs --vllm-version (the version the image's vLLM reports)",
                         hint="or add --commit SHA to pin that commit's wheel beside the image")
    else:
        fields.update(vllm_version=vllm_version)
        notes.append("vllm_version as given to lock add (an image does not say it before it runs; the docker "
                     "runtime's inventory records what it reports)")

    if image_tag:
        from audit.pins.registry import resolve_ref

        if "@" in image_tag:
            raise UsageError(f"--image-tag {image_tag!r} is a digest", hint="give repo:tag; lock add resolves it")
        image, platforms = resolve_ref(image_tag)
        fields.update(image=image, platform_digests=platforms, image_tag=image_tag)
    if commit:
        fields["vllm_commit"] = commit
    notes.append(f"added by serving-truth lock add on {datetime.now(timezone.utc).date().isoformat()}")
    if note:
        notes.insert(0, note)
    fields["note"] = "; ".join(notes)

    from audit.fsutil import DirLock

    with DirLock(lock_path):  # concurrent `lock add`s append one after the other, each to what the last wrote
        current = lockmod.load(lock_path)
        if name in current.pins:
            raise UsageError(f"pin {name!r} was added to {lock_path} meanwhile (line {current.pins[name].line})",
                             hint="choose another name, or delete that [[pin]] first")
        old = lock_path.read_text(encoding="utf-8")
        new = old.rstrip("\n") + "\n\n" + pin_block(fields)
        write_atomic(lock_path, new)
        try:
            lockmod.load(lock_path)
        except LockError:
            write_atomic(lock_path, old)  # never leave a lock that does not parse
            raise
    return {**fields, "warnings": warnings}


__all__ = ["WheelEntry", "add_pin", "commits_before", "download", "full_commit", "index_base", "inspect_wheel",
           "pick_wheel", "read_commit_index"]
