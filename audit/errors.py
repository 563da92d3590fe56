"""One error root for the host side, typed subclasses that carry fields, named exit codes.

The CLI catches :class:`AuditError` once and maps it to ``exc.exit_code``; nothing below the CLI
prints or exits.
"""
from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    #: the audit ran and found a false claim, a refusal or required probe drift (or UNVERIFIED under --strict)
    FINDINGS = 1
    #: bad input: lock file, expectations, CLI arguments
    USAGE = 2
    #: the environment could not be prepared (venv build, wheel hash, stub build)
    ENVIRONMENT = 3
    #: a probe run failed, produced no usable evidence, or did not finish every cell (INCOMPLETE)
    RUN_FAILED = 4
    #: the audit finished but its report could not be written (read-only or full disk, a locked report);
    #: the evidence is kept and the message says how to render it later
    REPORT_WRITE = 5
    #: the pin-bump gate (an explicit --baseline): how the model is served changed against the baseline (a
    #: routed path, a per-call tier, a refusal, an activation check, a candidate's rejection, probe drift)
    SERVING_CHANGED = 6
    #: the audit judged nothing: a gate against a baseline that shares no cell with the candidate (a pass would
    #: say nothing was compared)
    NOTHING_JUDGED = 7
    #: an unexpected error in the harness itself (a bug); the traceback is in a log file whose path is printed
    INTERNAL = 70
    #: the audit was interrupted (SIGINT/SIGTERM)
    INTERRUPTED = 130


class AuditError(Exception):
    """Root of every error the harness raises on purpose."""

    exit_code: ExitCode = ExitCode.RUN_FAILED

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:  # message plus an actionable hint when there is one
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class UsageError(AuditError):
    exit_code = ExitCode.USAGE


class InputFileError(UsageError):
    """A problem in one of the harness's input files, with the file and (when known) the line."""

    def __init__(self, message: str, *, path: str, line: int | None = None, hint: str | None = None):
        self.path = path
        self.line = line
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {message}", hint=hint)


class LockError(InputFileError):
    """A problem in images.lock."""


class UnknownPinError(UsageError):
    def __init__(self, pin: str, *, known: list[str], path: str):
        self.pin = pin
        self.known = known
        self.path = path
        super().__init__(f"pin {pin!r} is not in {path}", hint=self._hint(pin, known, path))

    @staticmethod
    def _hint(pin: str, known: list[str], path: str) -> str:
        """The lines that would make *pin* auditable: a name that looks like a vLLM release is on PyPI, a
        nightly-MMDD name is main as of that day, anything else a commit, the moving nightly or a wheel URL."""
        import re
        from datetime import date

        lock = "" if path == "images.lock" else f" LOCK={path}"
        lines = []
        m = re.fullmatch(r"nightly-(\d{2})(\d{2})", pin)
        if m:
            try:
                day = date(date.today().year, int(m.group(1)), int(m.group(2)))
                if day > date.today():
                    day = day.replace(year=day.year - 1)
                lines.append(f"make lock-add PIN={pin} DATE={day.isoformat()}{lock}   (vLLM main as of that day)")
            except ValueError:
                pass
        lines += [f"make lock-add PIN={pin} COMMIT=<sha>{lock}   (a vLLM commit's wheel)",
                  f"make lock-add PIN={pin} NIGHTLY=1{lock}   (the commit vLLM's nightly index points at now)",
                  f"make lock-add PIN={pin} WHEEL_URL=<url>{lock}   (any wheel)"]
        return ("known pins: " + (", ".join(known) if known else "(none)") + "; to pin it, one of:\n  "
                + "\n  ".join(lines) + f"\nthen: make audit PIN={pin}{lock}")


class RuntimeUnsupportedError(UsageError):
    """The pin exists but the chosen runtime cannot audit it (e.g. a docker-only image locally)."""

    def __init__(self, pin: str, *, runtime: str, supported: list[str], reason: str):
        self.pin = pin
        self.runtime = runtime
        self.supported = supported
        super().__init__(
            f"pin {pin!r} cannot be audited by the {runtime} runtime: {reason}",
            hint="use RUNTIME=" + " or RUNTIME=".join(supported) if supported else None,
        )


class SelectionError(UsageError):
    """An unknown system or layout name on the command line."""

    def __init__(self, kind: str, value: str, *, known: list[str]):
        self.kind = kind
        self.value = value
        self.known = known
        super().__init__(f"unknown {kind} {value!r}", hint=f"known {kind}s: {', '.join(known)}")


class EnvironmentBuildError(AuditError):
    exit_code = ExitCode.ENVIRONMENT

    def __init__(self, message: str, *, step: str, log_tail: str = "", hint: str | None = None):
        self.step = step
        self.log_tail = log_tail
        text = f"{step}: {message}"
        if log_tail:
            text += "\n--- last output ---\n" + log_tail
        super().__init__(text, hint=hint)


class WheelHashMismatch(EnvironmentBuildError):
    def __init__(self, *, wheel: str, expected: str, found: str):
        self.wheel = wheel
        self.expected = expected
        self.found = found
        super().__init__(
            f"{wheel} has sha256 {found}, images.lock pins {expected}",
            step="verify wheel",
            hint="the download was altered or the lock is wrong; do not edit the hash to match",
        )


class StubBuildError(EnvironmentBuildError):
    pass


class EnvironmentModified(EnvironmentBuildError):
    """The pinned environment is not what its wheel installed: a file the wheel's RECORD lists was changed or
    removed, or a startup hook no installed distribution records was added. The audit refuses to run in it
    (its ledger would carry the pinned wheel's hash for code that is not that wheel's)."""

    def __init__(self, *, env: str, wheel: str, modified: list[str], missing: list[str], unexpected: list[str],
                 uv_cache: str = "", package: str = "vllm"):
        self.env = env
        self.wheel = wheel
        self.modified = list(modified)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        parts = []
        for what, items in (("modified", self.modified), ("missing", self.missing),
                            ("not installed by any wheel", self.unexpected)):
            if items:
                parts.append(f"{what}: " + ", ".join(items[:5]) + (f" (+{len(items) - 5} more)" if len(items) > 5 else ""))
        super().__init__(f"the environment {env} differs from what {wheel} installs; " + "; ".join(parts),
                         step="verify environment",
                         hint=f"do not audit an edited environment. Its files are hard links into uv's package "
                              f"cache, so the edit is in the cached copy too and a rebuild would link it again: "
                              f"drop both, `rm -rf {env}` and `.venv/bin/uv cache clean {package} --cache-dir "
                              f"{uv_cache or '<cache>/uv-cache'}`; the next audit rebuilds it from the pinned wheel "
                              "(its sha256 checked)")


class EnvironmentInUse(EnvironmentBuildError):
    """An environment a running audit is using (its agent runs in it) cannot be removed."""

    def __init__(self, *, name: str, path: str):
        self.name, self.path = name, path
        super().__init__(f"environment {name} is in use by a running audit: not removed ({path})", step="prune",
                         hint="prune again once that audit has ended (serving-truth envs --prune ...)")


class UnsafeLockPath(EnvironmentBuildError):
    """A pin's fields would put a cache path outside the cache (e.g. a version with '/' or '..' in it). Lock
    files are validated on load; this guards pins built any other way. Nothing is deleted or run."""

    def __init__(self, *, pin: str, field: str, value: str, root: str):
        self.pin = pin
        self.field = field
        self.value = value
        self.root = root
        super().__init__(f"pin {pin!r}: {field} {value!r} would name a path outside {root}", step="cache path",
                         hint="fix the pin; versions are PEP 440 and wheel names plain file names")


class WheelSourceError(EnvironmentBuildError):
    """A wheel that is not on PyPI could not be found or fetched (vLLM's per-commit index, a wheel URL)."""

    def __init__(self, message: str, *, url: str, step: str = "wheel index", hint: str | None = None,
                 status: int | None = None):
        self.url = url
        #: the HTTP status the server answered, when it answered one (404: not there)
        self.status = status
        super().__init__(message, step=step, hint=hint)


class NoWheelForPlatform(WheelSourceError):
    """The index has wheels for the commit, none of them for this platform (architecture, Python, variant)."""

    def __init__(self, *, url: str, commit: str, platform: str, available: list[str]):
        self.commit = commit
        self.platform = platform
        self.available = list(available)
        listed = ", ".join(self.available) if self.available else "none"
        super().__init__(f"no vLLM wheel for {platform} at commit {commit} in {url} (it lists: {listed})", url=url,
                         hint="pick another variant or architecture (--variant, --arch), or pin a wheel by --wheel-url")


class DownloadError(WheelSourceError):
    def __init__(self, message: str, *, url: str, hint: str | None = None):
        super().__init__(message, url=url, step="download wheel", hint=hint)


class TruncatedDownload(DownloadError):
    def __init__(self, *, url: str, expected_bytes: int | None, received_bytes: int):
        self.expected_bytes = expected_bytes
        self.received_bytes = received_bytes
        of = f" of {expected_bytes}" if expected_bytes is not None else ""
        super().__init__(f"the connection ended after {received_bytes}{of} bytes of {url}", url=url,
                         hint="nothing was kept or written; try again")


class DownloadHashMismatch(DownloadError):
    """The bytes received do not have the sha256 the source announced or the user gave."""

    def __init__(self, *, url: str, expected: str, found: str, source: str):
        self.expected = expected
        self.found = found
        self.source = source
        super().__init__(f"{url} has sha256 {found}, {source} says {expected}", url=url,
                         hint="the file was altered or replaced; nothing was kept or written")


class EvidenceError(AuditError):
    """Evidence files that cannot be read: wrong schema version, malformed records, none at all."""

    exit_code = ExitCode.RUN_FAILED

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None, hint: str | None = None):
        self.path = path
        self.line = line
        where = f"{path}:{line}: " if path and line else (f"{path}: " if path else "")
        super().__init__(where + message, hint=hint)


class ProbeRunError(AuditError):
    """A probe agent process failed."""

    exit_code = ExitCode.RUN_FAILED

    def __init__(self, message: str, *, cell: str, returncode: int | None, log_tail: str):
        self.cell = cell
        self.returncode = returncode
        self.log_tail = log_tail
        super().__init__(f"{cell}: {message} (exit {returncode})\n--- last output ---\n{log_tail}")


class ProfileError(AuditError):
    """A model profile that breaks a rule the shared code relies on (a lane name, a reference to a lane it does
    not have): the harness's own data is wrong, so it is an internal error naming the profile and the rule."""

    exit_code = ExitCode.INTERNAL

    def __init__(self, profile: str, rule: str):
        self.profile = profile
        self.rule = rule
        super().__init__(f"model profile {profile!r}: {rule}",
                         hint="fix the profile in audit/models/ (README: how to add a model)")


class RenderError(AuditError):
    exit_code = ExitCode.RUN_FAILED


class Interrupted(AuditError):
    exit_code = ExitCode.INTERRUPTED


class RunAborted(ProbeRunError):
    """The run stopped before every cell finished: a timeout or the run's process/container exiting.

    Carries what is needed to render an INCOMPLETE ledger of what was observed (beside the run,
    never over the previous report): ``kind`` ("timeout" | "exited"), the log tail, and the partial
    result (``partial``) the runtime had collected."""

    kind = "aborted"

    def __init__(self, message: str, *, cell: str = "all", returncode: int | None, log_tail: str):
        self.summary = message  # without the log tail, for the ledger
        super().__init__(message, cell=cell, returncode=returncode, log_tail=log_tail)
        self.partial = None          # a RunResult, set by the runtime
        self.incomplete_ledger = None  # a path, set by the pipeline once rendered


class RunTimedOut(RunAborted):
    kind = "timeout"

    def __init__(self, *, seconds: float, where: str, log_tail: str):
        self.seconds = seconds
        super().__init__(f"{where} timed out after {seconds:.0f}s and was stopped", returncode=None,
                         log_tail=log_tail)


class RunExited(RunAborted):
    kind = "exited"

    def __init__(self, *, where: str, returncode: int | None, reason: str, log_tail: str):
        self.reason = reason
        super().__init__(f"{where} exited early: {reason}", returncode=returncode, log_tail=log_tail)


class DockerUnavailable(EnvironmentBuildError):
    def __init__(self, detail: str):
        self.detail = detail
        super().__init__(f"cannot reach the Docker engine: {detail}", step="connect to docker",
                         hint="start dockerd (or set DOCKER_HOST) and check that this user may use its socket")


class ImageError(EnvironmentBuildError):
    """The pinned image cannot be made present: not pullable, tarball missing, wrong architecture."""

    def __init__(self, message: str, *, ref: str, hint: str | None = None, log_tail: str = ""):
        self.ref = ref
        super().__init__(message, step=f"image {ref}", hint=hint, log_tail=log_tail)


class ImageDigestMismatch(EnvironmentBuildError):
    """What the engine holds is not what images.lock pins; the audit refuses to run it."""

    def __init__(self, *, ref: str, what: str, expected: str, found: str):
        self.ref = ref
        self.what = what
        self.expected = expected
        self.found = found
        super().__init__(f"{what} of {ref} is {found}, images.lock pins {expected}", step="verify image",
                         hint="the image is not the pinned one; do not edit the lock to match, find out why")


class RegistryError(EnvironmentBuildError):
    def __init__(self, message: str, *, registry: str, hint: str | None = None):
        self.registry = registry
        super().__init__(message, step=f"registry {registry}", hint=hint)


class RunIncomplete(AuditError):
    """The run ended but some cells left no evidence (their process died, a job failed): the audit is not
    complete, whatever the other cells say. Their ledger is written beside the run, never over reports/."""

    exit_code = ExitCode.RUN_FAILED

    def __init__(self, *, cells: list[tuple[str, str]], run_dir: str, incomplete_ledger=None):
        self.cells = list(cells)
        self.run_dir = run_dir
        self.incomplete_ledger = incomplete_ledger
        names = ", ".join(f"{s}/{l}" for s, l in self.cells[:6]) + (" ..." if len(self.cells) > 6 else "")
        super().__init__(f"{len(self.cells)} cell(s) did not finish ({names}): the audit is INCOMPLETE and "
                         "reports/ was not changed",
                         hint=f"see each cell's log under {run_dir}/evidence/; re-run the audit")


class HarnessFaultError(RunIncomplete):
    """Cells whose evidence records a harness fault: the harness's own code raised inside vLLM's process
    (probes/core/fence.py), so what vLLM did after it is not vLLM's decision alone. The run is INCOMPLETE (exit 4):
    no routing of those cells is shown, none is cached, reports/ is not changed."""

    def __init__(self, *, cells: list[tuple[str, str]], run_dir: str, faults: list[dict], incomplete_ledger=None):
        super().__init__(cells=cells, run_dir=run_dir, incomplete_ledger=incomplete_ledger)
        self.faults = list(faults)
        pieces = sorted({f["piece"] for f in self.faults})
        first = self.faults[0]
        self.message = (f"harness fault in {', '.join(pieces[:3])}{' ...' if len(pieces) > 3 else ''} "
                     f"({first['type'].split(':')[-1]}: {first['message'][:200]}) in {len(self.cells)} cell(s): the "
                        "audit is INCOMPLETE and reports/ was not changed")
        self.args = (self.message,)
        self.hint = ("the harness's own code raised inside the engine's process; the INCOMPLETE ledger's 'Harness faults' "
                     "section has the traceback: fix that piece of the harness and audit again")


class StandinMisfitError(RunIncomplete):
    """A resolve-mode stand-in whose target does not have the shape it expects in this release (its module moved a
    function, a signature changed), and nothing declares the misfit harmless there (audit/standinfit.py
    ``NOT_NEEDED``): what the simulation ran past it may not be vLLM's code as released, so the audit stops with
    exit 4, names the stand-in, and reports/ is not changed."""

    def __init__(self, *, misfits: dict[str, str], run_dir: str, incomplete_ledger=None, before_cells: bool = False):
        super().__init__(cells=[], run_dir=run_dir, incomplete_ledger=incomplete_ledger)
        self.misfits = dict(misfits)
        #: found by the check before any cell ran (no cell ran, no ledger was written), or in the cells' account
        self.before_cells = before_cells
        first, fit = next(iter(self.misfits.items()))
        self.message = (f"stand-in {first!r} does not fit this release ({fit})"
                        + (f", and {len(self.misfits) - 1} more" if len(self.misfits) > 1 else "")
                        + (": the audit stops before any cell ran" if before_cells else ": the audit stops here")
                        + " and reports/ was not changed")
        self.args = (self.message,)
        self.hint = ("update the stand-in to the release (probes/resolve/standins.py or the model's probes package), "
                     "or, if nothing in this release reads it, declare why in audit/standinfit.py NOT_NEEDED; "
                     "`make verify-pins` checks every pin")


class JudgmentShrank(AuditError):
    """The audit would replace a report in which claims were judged by one in which they are UNVERIFIED (or not
    judged at all): a judgment may not shrink silently. The new ledger is written beside the run; the committed
    report stays until ``--replace`` says to replace it anyway."""

    exit_code = ExitCode.RUN_FAILED

    def __init__(self, *, claims: list[dict], run_dir: str, report: str, ledger=None):
        self.claims, self.run_dir, self.report, self.ledger = list(claims), run_dir, report, ledger
        named = "; ".join(f"{c['claim']} on {c['system']}/{c['layout']}" + (f" at {c['at']}" if c["at"] else "")
                          + f" (was {c['verdict']})" for c in self.claims[:5])
        more = f" and {len(self.claims) - 5} more" if len(self.claims) > 5 else ""
        super().__init__(f"{len(self.claims)} claim verdict(s) judged in {report} would become UNVERIFIED: {named}{more}; "
                         f"the report was not replaced (the new ledger is {ledger})",
                         hint="find why the audit could not judge them (the new ledger says); if that is right, "
                              "audit again with --replace (REPLACE=1)")


class ReportWriteError(AuditError):
    """The report could not be written (read-only directory, full disk, an immutable file, a name that is no
    safe directory name). The previous report is left as it was."""

    exit_code = ExitCode.REPORT_WRITE

    def __init__(self, message: str, *, path: str, run_dir: str | None = None, hint: str | None = None):
        self.path = path
        self.run_dir = run_dir
        if run_dir and not hint:
            hint = f"the evidence is kept in {run_dir}; fix the cause, then `serving-truth render {run_dir}`"
        super().__init__(f"cannot write the report {path}: {message}", hint=hint)
