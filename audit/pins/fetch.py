"""Fetching over HTTP for pins: an index page or metadata file (bounded), and a wheel (hashed as it arrives,
written atomically). A redirect is followed only to the host the request named. Standard library only."""
from __future__ import annotations

import hashlib
import http.client
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable

from audit.errors import DownloadError, DownloadHashMismatch, TruncatedDownload, WheelSourceError

INDEX_ENV = "SERVING_TRUTH_WHEEL_INDEX"
TIMEOUT_S = 60

Progress = Callable[[str], None]


# -- HTTP --------------------------------------------------------------------------------------------
class _SameHostRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to the host (and scheme) the request went to: an index, a metadata file or a
    wheel is never taken from a host other than the one named."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        old, new = urllib.parse.urlsplit(req.full_url), urllib.parse.urlsplit(newurl)
        if (new.scheme, new.netloc) != (old.scheme, old.netloc):
            raise WheelSourceError(f"{req.full_url} redirects to another host ({new.scheme}://{new.netloc}); "
                                   "refused", url=req.full_url, step="wheel index",
                                   hint="point --index-url / the wheel URL at the host that serves the files")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _opener(url: str) -> urllib.request.OpenerDirector:
    host = urllib.parse.urlsplit(url).hostname or ""
    handlers = [_SameHostRedirects()]
    if host in ("127.0.0.1", "localhost", "::1"):  # never through a proxy
        handlers.append(urllib.request.ProxyHandler({}))
    return urllib.request.build_opener(*handlers)


def _open(url: str, *, what: str, step: str, accept: str = ""):
    req = urllib.request.Request(url, headers={"User-Agent": "serving-truth", **({"Accept": accept} if accept else {})})
    try:
        return _opener(url).open(req, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 404:
            raise WheelSourceError(f"{what}: {url} not found (HTTP 404)", url=url, step=step, status=404) from None
        raise WheelSourceError(f"{what}: {url} answered HTTP {exc.code}", url=url, step=step,
                               status=exc.code) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        raise WheelSourceError(f"{what}: cannot reach {url}: {reason}", url=url, step=step,
                               hint=f"check the network, or point --index-url / ${INDEX_ENV} at a reachable index"
                               ) from None


def _get(url: str, *, what: str, step: str = "wheel index", accept: str = "", limit: int = 32 << 20) -> bytes:
    with _open(url, what=what, step=step, accept=accept) as resp:
        try:
            body = resp.read(limit + 1)
        except (http.client.HTTPException, OSError) as exc:
            raise WheelSourceError(f"{what}: reading {url} failed: {exc}", url=url, step=step) from None
    if len(body) > limit:
        raise WheelSourceError(f"{what}: {url} is larger than {limit} bytes", url=url, step=step)
    return body


# -- downloads ------------------------------------------------------------------------------------------
#: the most a download may take, whatever its server announces (``SERVING_TRUTH_MAX_DOWNLOAD_BYTES`` sets another)
MAX_DOWNLOAD_ENV = "SERVING_TRUTH_MAX_DOWNLOAD_BYTES"
MAX_DOWNLOAD_BYTES = 4 << 30


def max_download_bytes() -> int:
    raw = os.environ.get(MAX_DOWNLOAD_ENV, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else MAX_DOWNLOAD_BYTES


def sweep_partials(directory: Path) -> list[Path]:
    """Remove the partial files of downloads whose process is gone (killed mid-download): ``.partial-<pid>-<name>``
    with no such process alive. Returns what was removed."""
    removed = []
    for path in directory.glob(".partial-*-*"):
        pid = path.name.split("-", 2)[1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # that download is still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed


def download(url: str, dest: Path, *, expected_sha256: str = "", expected_source: str = "", expected_size: int = 0,
             progress: Progress = lambda text: None) -> tuple[Path, str, int]:
    """Fetch *url* into *dest* (atomically: a partial file never has the final name); hash the bytes as they
    arrive. A short body (fewer bytes than Content-Length, or a connection that ends early), a body larger than the
    size the index states (*expected_size*) or than the ceiling (:func:`max_download_bytes`), announced or
    received, and a sha256 other than *expected_sha256* are errors, and leave nothing behind; partial files a
    killed download left are swept first. Returns (dest, sha256, size)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    sweep_partials(dest.parent)
    tmp = dest.parent / f".partial-{os.getpid()}-{dest.name}"
    h = hashlib.sha256()
    size = 0
    limit = min(x for x in (expected_size, max_download_bytes()) if x)
    bound = (f"the {limit} bytes the index states" if expected_size and expected_size == limit else
             f"the {limit} bytes a download may take (${MAX_DOWNLOAD_ENV})")
    try:
        with _open(url, what="wheel", step="download wheel") as resp, open(tmp, "wb") as out:
            length = resp.headers.get("Content-Length")
            expected_len = int(length) if length and length.isdigit() else None
            if expected_len is not None and expected_len > limit:
                raise DownloadError(f"{url} announces {expected_len} bytes, more than {bound}: refused before "
                                    "reading", url=url)
            progress(f"downloading {url}" + (f" ({expected_len / 1e6:.0f} MB)" if expected_len else ""))
            while True:
                try:
                    chunk = resp.read(1 << 20)
                except http.client.IncompleteRead as exc:
                    size += len(exc.partial)
                    raise TruncatedDownload(url=url, expected_bytes=expected_len, received_bytes=size) from None
                except (OSError, http.client.HTTPException) as exc:
                    raise DownloadError(f"reading {url} failed after {size} bytes: {exc}", url=url) from None
                if not chunk:
                    break
                size += len(chunk)
                if size > limit:
                    raise DownloadError(f"{url} sent more than {bound}: stopped", url=url)
                h.update(chunk)
                out.write(chunk)
            if expected_len is not None and size != expected_len:
                raise TruncatedDownload(url=url, expected_bytes=expected_len, received_bytes=size)
            out.flush()
            os.fsync(out.fileno())
        found = h.hexdigest()
        if expected_sha256 and found != expected_sha256:
            raise DownloadHashMismatch(url=url, expected=expected_sha256, found=found,
                                       source=expected_source or "the pin")
        os.replace(tmp, dest)
        return dest, found, size
    finally:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
