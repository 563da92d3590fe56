"""Command line: the only place that prints, uses rich, and turns errors into exit codes."""
from __future__ import annotations

import argparse
import signal
import sys

from audit import __version__
from audit.errors import AuditError, ExitCode, Interrupted


def _engine_help() -> str:
    from audit import engines

    return (f"whose reports: {' or '.join(engines.ENGINES)} (default: the engine of the pins named in images.lock, "
            f"else {engines.DEFAULT})")


def _parser() -> argparse.ArgumentParser:
    ENGINE_HELP = _engine_help()
    p = argparse.ArgumentParser(prog="serving-truth", description="Audit which kernel path every layer of a model "
                                "takes when vLLM serves it from a pinned environment.")
    p.add_argument("--version", action="version", version=f"serving-truth {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    from audit.models import DEFAULT as default_model

    a = sub.add_parser("audit", help="audit one pin and write reports/<pin>/ledger.md")
    a.add_argument("pin", help="a pin name from images.lock, e.g. v0.33.0")
    a.add_argument("--model", default=default_model, help=f"the model to audit (see `serving-truth models`; default: "
                                                 f"{default_model}); reports of a model other than the default go "
                                                 "under reports/<model>/")
    a.add_argument("--runtime", default="auto", help="where to run the probes: local, docker or slurm (default: auto, "
                   "the pin's wheel in a local venv when it pins one, else its image under docker)")
    a.add_argument("--pass-env", default="", metavar="NAME[,NAME]",
                   help="docker: host variables to pass into the container by name (values are redacted "
                        "from evidence); nothing else from the host environment enters it")
    a.add_argument("--cluster", default=None, metavar="PROFILE",
                   help="slurm: cluster profile (default: $SERVING_TRUTH_CLUSTER or clusters/example.toml)")
    a.add_argument("--no-wait", dest="wait", action="store_false",
                   help="slurm: submit the jobs and return; render later with `serving-truth render RUN_DIR`")
    a.add_argument("--mode", default="resolve", choices=("resolve", "observe"),
                   help="resolve: vLLM's selection code under a simulated platform (no GPU); observe: serve on "
                        "this host's GPUs and count the kernel entries that ran")
    a.add_argument("--slice", dest="slice_name", default="",
                   help="observe: serve a model slice (e.g. slice4, slice8) instead of every layer")
    a.add_argument("--no-profiler", dest="profiler", action="store_false",
                   help="observe: do not corroborate the probes with vLLM's torch profiler traces")
    a.add_argument("--systems", default="all", help="comma list of systems, or 'all'")
    a.add_argument("--layouts", default="default",
                   help="comma list of the model's layouts (e.g. tp8, tp16); 'default': every layout but the "
                        "deployment options (`serving-truth models` marks them); 'all': every layout")
    a.add_argument("--lock", default="images.lock", help="path to images.lock")
    a.add_argument("--reports", default="reports", help="reports directory")
    a.add_argument("--parallel", type=int, default=None,
                   help="processes resolving at once (default: one per core, as many as the available memory "
                        "holds)")
    a.add_argument("--postload-every-layer", action="store_true",
                   help="run vLLM's MoE weight conversion on every layer instead of carrying the first layer's "
                        "result to identical layers (the same routing; slower)")
    a.add_argument("--timeout", type=_seconds, default=None, help="give up after this many seconds")
    a.add_argument("--no-cache", dest="cache", action="store_false",
                   help="run every cell even when its evidence is cached for the same inputs (resolve mode, "
                        "local runtime)")
    # a test of the fence itself (probes/core/fence.py): raise inside one fenced piece of the harness
    a.add_argument("--plant-fault", action="append", default=[], metavar="PIECE", help=argparse.SUPPRESS)
    a.add_argument("--replace", action="store_true",
                   help="let a subset audit (some systems or layouts) replace a fuller reports/<pin>/, or one that "
                        "judged claims this audit leaves UNVERIFIED (by default it is written beside its run; the "
                        "latter exits 4 naming the claims)")
    a.add_argument("--baseline", default="auto",
                   help="the pin-bump gate: an audited pin this build is gated against (exit 6 when serving "
                        "changed against it, 1 on findings not accepted); default 'auto': the pin before this one "
                        "in release order, shown as 'changes since' in the ledger without gating; 'none': no "
                        "such section")
    a.add_argument("--accepted", default="auto", metavar="FILE",
                   help="the gate's accepted findings (default: expectations/<model>.accepted.toml if present; "
                        "'none'); written by `serving-truth accept PIN`")
    a.add_argument("--expectations", default="auto",
                   help="claims to judge (default: expectations/<model>.toml if present; 'none' for no verdicts)")
    a.add_argument("--strict", action="store_true", help="also fail (exit 1) on UNVERIFIED lanes")
    a.add_argument("--host", default="image", choices=["image", "pip"],
                   help="the host vLLM runs on, as its availability checks read it (audit/pins/hosts.py): 'image' "
                        "(default: the pin's official image, facts declared in images.lock) or 'pip' (a pip install "
                        "with no CUDA toolkit and no FlashInfer cubin package); reports of 'pip' go to "
                        "reports/hosts/pip/ with the diff against the image's host")
    a.add_argument("--no-cuda-toolkit", dest="cuda_toolkit", action="store_false",
                   help="the same as --host pip")

    r = sub.add_parser("render", help="re-render a ledger from a run directory's evidence")
    r.add_argument("run_dir")
    r.add_argument("--lock", default="images.lock")
    r.add_argument("--reports", default="reports")
    r.add_argument("--baseline", default="auto",
                   help="a pin to gate against (as for audit); default: the previous pin, shown without gating")
    r.add_argument("--accepted", default="auto", metavar="FILE", help="the gate's accepted findings (as for audit)")
    r.add_argument("--expectations", default="auto", help="claims to judge ('none' for no verdicts)")
    r.add_argument("--strict", action="store_true", help="also fail (exit 1) on UNVERIFIED lanes")
    r.add_argument("--replace", action="store_true",
                   help="let a subset run replace a fuller reports/<pin>/, or one that judged claims this run leaves "
                        "UNVERIFIED (by default it is written beside the run; the latter exits 4 naming the claims)")

    ac = sub.add_parser("accept", help="record every finding of an audited pin as accepted for the pin-bump gate")
    ac.add_argument("pin")
    ac.add_argument("--model", default=default_model, help=f"whose report (default: {default_model})")
    ac.add_argument("--reports", default="reports")
    ac.add_argument("--lock", default="images.lock")
    ac.add_argument("--accepted", default="auto", metavar="FILE",
                    help="the file to write (default: expectations/<model>.accepted.toml)")

    d = sub.add_parser("diff", help="render reports/diffs/<from>..<to>.md from two audited pins")
    d.add_argument("from_pin")
    d.add_argument("to_pin")
    d.add_argument("--model", default=default_model, help=f"whose reports (default: {default_model})")
    d.add_argument("--reports", default="reports")
    d.add_argument("--engine", default=None, help=ENGINE_HELP)

    sm = sub.add_parser("summary", help="print the pull-request summary of a pin bump (markdown, about 250 words, "
                                        "from two audited pins' routing.json; the top of their diff)")
    sm.add_argument("from_pin")
    sm.add_argument("to_pin")
    sm.add_argument("--model", default=default_model, help=f"whose reports (default: {default_model})")
    sm.add_argument("--reports", default="reports")
    sm.add_argument("--engine", default=None, help=ENGINE_HELP)

    cp = sub.add_parser("compare", help="one model on two engines side by side: reports/compare/<pin>..<pin>.md from "
                                        "two pins' committed reports, of two engines (see `serving-truth pins`)")
    cp.add_argument("pin")
    cp.add_argument("with_pin", metavar="with")
    cp.add_argument("--model", default=default_model, help=f"whose reports (default: {default_model})")
    cp.add_argument("--lock", default="images.lock")
    cp.add_argument("--reports", default="reports")

    pp = sub.add_parser("pins", help="list the pins in images.lock")
    pp.add_argument("--lock", default="images.lock")
    pp.add_argument("--names", action="store_true", help="only the names, one per line, in release order (scripts)")
    sub.add_parser("models", help="list the models the harness audits (their profiles: audit/models/)")

    c = sub.add_parser("clean-containers", help="remove containers left by serving-truth runs whose harness died")
    c.add_argument("--all", action="store_true", help="also those of runs still in progress")

    st = sub.add_parser("selftest-gpu", help="on one NVIDIA GPU: serve the smallest slice, check every lane's "
                                              "probes fired")
    st.add_argument("--pin", default="v0.33.0")
    st.add_argument("--lock", default="images.lock")
    st.add_argument("--model", default=default_model, help=f"whose selftest slice to serve (default: {default_model})")

    lk = sub.add_parser("lock", help="maintain images.lock")
    lsub = lk.add_subparsers(dest="lock_command", required=True)
    lr = lsub.add_parser("resolve", help="fill in a pin's image digests from its registry")
    lr.add_argument("pin")
    lr.add_argument("--lock", default="images.lock")
    la = lsub.add_parser("add", help="pin a vLLM build that is not on PyPI: a commit's nightly wheel, main as of a "
                                     "date, a wheel URL, an image tag")
    la.add_argument("pin", help="the new pin's name, e.g. nightly-0731")
    src = la.add_mutually_exclusive_group()
    src.add_argument("--commit", help="a vLLM commit on main: its wheel from vLLM's per-commit index")
    src.add_argument("--nightly", action="store_true",
                     help="the commit vLLM's moving nightly index points at now (the commit is recorded)")
    src.add_argument("--date", dest="as_of", metavar="YYYY-MM-DD",
                     help="main as of the end of that day (UTC): the newest commit with a wheel; the commit is recorded")
    la.add_argument("--wheel-url", help="a wheel by URL (https://, http://, file:///) instead of the index's")
    la.add_argument("--sha256", help="the sha256 the wheel must have (checked against the bytes received)")
    la.add_argument("--image-tag", help="repo:tag of an image of that build, resolved to its digest in the registry")
    la.add_argument("--vllm-version", help="image-only pins: the version the image's vLLM reports")
    la.add_argument("--variant", help="a variant directory of the index (e.g. cu130, cpu); default: the default variant")
    la.add_argument("--arch", help="x86_64 or aarch64 (default: this machine's)")
    la.add_argument("--python", default="3.12", help="Python the local runtime builds the environment with (3.12)")
    la.add_argument("--index-url", help="root of vLLM's per-commit wheel index (default: $SERVING_TRUTH_WHEEL_INDEX "
                                        "or https://wheels.vllm.ai)")
    la.add_argument("--github-api", help="GitHub API root for --date and short shas (default: $SERVING_TRUTH_GITHUB_API "
                                         "or https://api.github.com)")
    la.add_argument("--note", default="", help="a note to keep with the pin")
    la.add_argument("--lock", default="images.lock")

    rg = sub.add_parser("regenerate", help="re-audit every pin with a wheel (release order) and rewrite reports/ "
                                           "and reports/diffs/ (the committed reports)")
    rg.add_argument("--pins", default="", help="comma list (default: every pin with a wheel)")
    rg.add_argument("--lock", default="images.lock")
    rg.add_argument("--reports", default="reports")
    rg.add_argument("--engine", default=None, help=ENGINE_HELP)
    rg.add_argument("--model", default=default_model, help=f"whose reports (default: {default_model})")
    rg.add_argument("--drop-envs", action="store_true",
                    help="remove each pin's environment after its audit (~9 GB each), except --keep-envs")
    rg.add_argument("--keep-envs", default="v0.33.0,v0.30.0",
                    help="environments --drop-envs keeps, a comma list (default: the two the tests use)")
    rg.add_argument("--no-cache", dest="cache", action="store_false", help="run every cell")
    rg.add_argument("--from-runs", action="store_true",
                    help="audit nothing: render each pin again from its newest run of every cell (after editing "
                         "expectations, templates or verdicts; needs no vLLM environment); a pin whose runs are gone "
                         "is rendered from its committed routing.json")
    rg.add_argument("--from-reports", action="store_true",
                    help="audit nothing, read no run: render every committed ledger, labels file and diff again from "
                         "its routing.json with today's code")

    vp = sub.add_parser("verify-pins", help="check the harness against every pinned release: one cell per SM family "
                                            "with the fences on, each stand-in's fit, vLLM's availability answers "
                                            "against a plain import (reports/ is not touched)")
    vp.add_argument("--pins", default="", help="comma list (default: every pin with a wheel)")
    vp.add_argument("--lock", default="images.lock")
    vp.add_argument("--model", default=default_model, help=f"whose probes to check (default: {default_model})")
    vp.add_argument("--engine", default=None, help=ENGINE_HELP)

    e = sub.add_parser("env", help="build (once, cached) the local environment holding a pin's vLLM wheel")
    e.add_argument("pin")
    e.add_argument("--lock", default="images.lock")
    es = sub.add_parser("envs", help="list the pins' environments in the cache (size, shared bytes, last use, pins), "
                                     "or prune them")
    es.add_argument("--lock", default="images.lock")
    es.add_argument("--prune", choices=("unpinned", "unfinished", "all"), default=None,
                    help="remove environments no pin in the lock uses (unpinned), builds that died (unfinished), "
                         "or every one")
    es.add_argument("--unused-days", type=int, default=None,
                    help="with --prune: only those no audit used for this many days")
    return p


def _verify_pins(args, out, err) -> int:
    from audit import models
    from audit.pincheck import verify_pins

    from audit import engines

    pins = [p.strip() for p in args.pins.split(",") if p.strip()]
    if args.engine or pins:
        profiles = [_profile(args, *pins)]  # an unknown model is bad input before any work
    else:  # every engine the model is audited on
        profiles = [models.get(args.model, e) for e in engines.ENGINES if args.model in models.BY_ENGINE.get(e, {})]
    checks = []
    with err.status("verifying pins") as status:
        for profile in profiles:
            checks += verify_pins(profile, lock_path=args.lock, pins=pins or None,
                                  progress=lambda event, **f: status.update(f.get("text", event)))
    for c in checks:
        out.print(f"{c.pin}: {'ok' if c.ok else 'FAILED'} ({len(c.cells)} cell(s): {', '.join(c.cells)})")
        for title, rows in (("harness fault", c.faults), ("cell did not finish", c.unfinished),
                            ("stand-in does not fit", c.misfits), ("stand-in skipped", c.skipped),
                            ("availability differs from a plain import", c.disagreements),
                            ("host facts (images.lock [pin.host])", c.host)):
            for row in rows:
                out.print(f"  {title}: {row}", markup=False)
        for k, v in c.fit.items():
            out.print(f"  fit: {k}: {v}", markup=False)
        if c.error:
            out.print(f"  error: {c.error}", markup=False)
    failed = [c.pin for c in checks if not c.ok]
    if failed:
        err.print(f"verify-pins: {len(failed)} pin(s) failed: {', '.join(failed)}; no report should be regenerated "
                  "from a harness that does not fit its release", markup=False)
        return ExitCode.RUN_FAILED
    err.print(f"verify-pins: all {len(checks)} pin(s) passed")
    return ExitCode.OK


def _profile(args, *pins: str):
    """The model's profile on the engine asked for (``--engine``), else on the engine of the first pin named that
    images.lock holds, else on the first engine."""
    from audit import engines, models

    engine = getattr(args, "engine", None)
    if not engine and pins:
        from audit.pins.lock import load

        try:
            lock = load(getattr(args, "lock", "images.lock"))
        except Exception:  # no readable lock: the reports themselves are read; the first engine's are meant
            lock = None
        held = [lock.pins[p] for p in pins if lock is not None and p in lock.pins]
        engine = held[0].engine if held else None
    return models.get(args.model, engine or engines.DEFAULT)


def _seconds(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds, got {text!r}")
    return value


def _positive(value: int, name: str) -> int:
    from audit.errors import UsageError

    if value < 1:
        raise UsageError(f"--{name} must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    err = Console(stderr=True, soft_wrap=True)
    out = Console(soft_wrap=True)
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse already printed the problem
        return ExitCode.USAGE if exc.code not in (0, None) else ExitCode.OK

    def on_signal(signum, frame):
        raise Interrupted(f"interrupted by signal {signum}; no report was written or changed")

    signal.signal(signal.SIGTERM, on_signal)
    # a harness started with Ctrl-C ignored (a background job of a non-interactive shell inherits SIG_IGN) must
    # still stop on Ctrl-C and clean up, as the README promises
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if args.command == "pins":
            return _pins(args, out)
        if args.command == "models":
            return _models(out)
        if args.command == "diff":
            from audit import models
            from audit.report.diff import write_diff

            profile = _profile(args, args.to_pin, args.from_pin)
            md, _, d = write_diff(models.reports_root(args.reports, profile), args.from_pin, args.to_pin, profile)
            err.print("no change" if d["empty"] else f"{len(d['changes'])} change row(s)")
            out.print(str(md))
            return ExitCode.OK
        if args.command == "summary":
            from audit import models
            from audit.report.diff import diff_routings, load_routing

            profile = _profile(args, args.to_pin, args.from_pin)
            root = models.reports_root(args.reports, profile)
            d = diff_routings(load_routing(root, args.from_pin), load_routing(root, args.to_pin), profile)
            out.print(d["summary"], markup=False, highlight=False, soft_wrap=True)
            return ExitCode.OK
        if args.command == "compare":
            from audit import models
            from audit.pins.lock import load
            from audit.report.compare import write_compare

            lock = load(args.lock)
            left, right = lock.get(args.pin), lock.get(args.with_pin)  # unknown pins are bad input
            md, data = write_compare(args.reports, left.name, models.for_pin(args.model, left), right.name,
                                     models.for_pin(args.model, right))
            err.print(f"{len(data['tables'])} table(s) of {len(data['lanes'])} lane(s) both engines declare")
            out.print(str(md))
            return ExitCode.OK
        if args.command == "accept":
            from audit.core import accept_findings

            from audit import models

            path, n = accept_findings(args.pin, reports_dir=args.reports, lock_path=args.lock, accepted=args.accepted,
                                      profile=_profile(args, args.pin))
            err.print(f"{n} finding(s) of {args.pin} accepted in {path}; the gate against a baseline now fails "
                      "only on findings not listed there")
            out.print(str(path))
            return ExitCode.OK
        if args.command == "env":
            return _env(args, out, err)
        if args.command == "envs":
            return _envs(args, out, err)
        if args.command == "verify-pins":
            return _verify_pins(args, out, err)
        if args.command == "regenerate":
            from audit.core import regenerate_reports

            from audit import models

            pins = [p.strip() for p in args.pins.split(",") if p.strip()]
            profile = _profile(args, *pins)
            with err.status("regenerating reports") as status:
                done = regenerate_reports(lock_path=args.lock, reports_dir=args.reports, pins=pins or None,
                                          drop_envs=args.drop_envs, cache=args.cache, from_runs=args.from_runs,
                                          from_reports=args.from_reports,
                                          profile=profile,
                                          keep_envs=tuple(p.strip() for p in args.keep_envs.split(",") if p.strip()),
                                          progress=lambda event, **f: status.update(f.get("text", event)))
            from pathlib import Path

            for o in done:
                if isinstance(o, Path):  # rendered from its committed routing.json
                    out.print(f"{o.name}: {o / 'ledger.md'} (rendered from its routing.json)")
                    continue
                v = ", ".join(f"{k} {n}" for k, n in (o.verdicts or {}).items() if n)
                out.print(f"{o.pin}: {o.ledger} ({v})")
            return ExitCode.OK
        if args.command == "clean-containers":
            from audit.runtimes.docker import sweep

            removed = sweep(everything=args.all)
            err.print(f"removed {len(removed)} container(s)" + (": " + ", ".join(removed) if removed else ""))
            return ExitCode.OK
        if args.command == "lock":
            if args.lock_command == "add":
                return _lock_add(args, out, err)
            return _lock_resolve(args, out, err)
        if args.command == "selftest-gpu":
            from audit.selftest import run_selftest

            from audit import models

            res = run_selftest(args.pin, lock_path=args.lock, profile=models.get(args.model))
            for lane, paths in res["fired"].items():
                out.print(f"{lane}: {', '.join(paths)}")
            for lane, status in res["profiler"].items():
                out.print(f"torch.profiler, {lane}: {status}")
            err.print(f"torch.profiler traces read: {res['profiler_traces']}")
            err.print(f"selftest-gpu passed on {res['system']}; evidence: {res['run_dir']}")
            return ExitCode.OK
        if args.command == "render":
            from audit.core import render_run

            o = render_run(args.run_dir, lock_path=args.lock, reports_dir=args.reports, baseline=args.baseline,
                           expectations=args.expectations, replace=args.replace, accepted=args.accepted)
            _say_where(o, err)
            out.print(str(o.ledger))
            return _findings_exit(o, args.strict, err)
        return _audit(args, out, err)
    except KeyboardInterrupt:
        err.print("[red]interrupted[/red]: no report was written or changed")
        return ExitCode.INTERRUPTED
    except AuditError as exc:
        err.print("[red]error:[/red] " + _escape(str(exc)))
        ledger = getattr(exc, "incomplete_ledger", None)
        if ledger:
            err.print(f"an INCOMPLETE ledger of what was observed: {ledger}")
        if getattr(exc, "kind", None) in ("timeout", "exited"):
            err.print("reports/ was not changed")
        return int(exc.exit_code)
    except OSError as exc:  # the disk, not the harness: full, read-only, gone
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        err.print(f"[red]error:[/red] {_escape(exc.strerror or str(exc))}{_escape(where)}; no report was changed")
        return ExitCode.REPORT_WRITE
    except Exception as exc:  # a bug in the harness: never exit 1, which a gate reads as findings
        log = _crash_log()
        err.print(f"[red]internal error:[/red] {_escape(type(exc).__name__)}: {_escape(str(exc)[:300])}")
        err.print(f"the traceback is in {log}; please report it" if log else "(the traceback could not be saved)")
        return ExitCode.INTERNAL


def _crash_log() -> str | None:
    """Write the current exception's traceback to a file of its own; its path, or None."""
    import os
    import tempfile
    import time
    import traceback

    text = traceback.format_exc()
    for root in (os.environ.get("SERVING_TRUTH_CACHE"), os.path.expanduser("~/.cache/serving-truth"),
                 tempfile.gettempdir()):
        if not root:
            continue
        try:
            d = os.path.join(root, "crash-logs")
            os.makedirs(d, exist_ok=True)
            path = os.path.join(d, time.strftime("crash-%Y%m%dT%H%M%SZ-", time.gmtime()) + f"{os.getpid()}.log")
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
            return path
        except OSError:
            continue
    return None


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _models(out) -> int:
    """One line per model and engine the registry holds: name, architecture, layouts, judged lanes, where its reports
    go."""
    from audit import engines, models

    for engine, profiles in models.BY_ENGINE.items():
        for name, p in profiles.items():
            default = " (default)" if name == models.DEFAULT and engine == engines.DEFAULT else ""
            out.print(f"{name}{default} on {engines.get(engine).title}  {p.architecture}  layouts: "
                      f"{', '.join(n + (' (option)' if l.opt_in else '') for n, l in p.layouts.items())}  judged: "
                      f"{', '.join(j.lane for j in p.judged)}  reports: {models.reports_root('reports', p)}/<pin>/",
                      soft_wrap=True, markup=False, highlight=False)
    return ExitCode.OK


def _pins(args, out) -> int:
    from rich.table import Table

    from audit.pins.lock import load

    from audit.pins.lock import sorted_pins

    lock = load(args.lock)
    if getattr(args, "names", False):
        for pin in sorted_pins(lock):
            out.print(pin.name, markup=False, highlight=False)
        return ExitCode.OK
    t = Table("pin", "engine", "version", "runtimes", "wheel sha256 / image", "from")
    for pin in sorted_pins(lock):  # release order per engine; builds from branches without a release tag last
        t.add_row(pin.name, pin.engine_contract.title, pin.version, ", ".join(pin.runtimes),
                  (pin.wheel_sha256[:16] + "…") if pin.wheel_sha256 else pin.image,
                  _pin_source(pin))
    out.print(t)
    return ExitCode.OK


def _pin_source(pin) -> str:
    if pin.wheel_source == "url":
        from urllib.parse import urlsplit

        return "wheel URL (" + (urlsplit(pin.wheel_url).netloc or "local file") + ")"
    return "PyPI" if pin.wheel_source == "pypi" else ("registry" if pin.image else "image file")


def _envs(args, out, err) -> int:
    import time

    from audit.pins.lock import load
    from audit.runtimes.local import LocalRuntime

    pins = list(load(args.lock).pins.values())
    rt = LocalRuntime()
    listing = rt.list_envs(list(pins))
    rows = listing["envs"]
    now = time.time()

    def gb(n: int) -> str:
        return f"{n / 1e9:.1f} GB"

    prune = []
    if args.prune:
        for r in rows:
            old_enough = args.unused_days is None or r["last_used"] is None or \
                now - r["last_used"] >= args.unused_days * 86400
            wanted = {"unpinned": not r["pins"], "unfinished": not r["finished"], "all": True}[args.prune]
            if wanted and old_enough:
                prune.append(r)
    for r in rows:
        used = "never" if r["last_used"] is None else time.strftime("%Y-%m-%d %H:%M", time.gmtime(r["last_used"]))
        state = "" if r["finished"] else " (unfinished build)"
        out.print(f"{r['name']}{state}  pins: {', '.join(r['pins']) or '(none in the lock)'}  own {gb(r['own_bytes'])}, "
                  f"shared {gb(r['shared_bytes'])}  last used {used}", markup=False, highlight=False)
    err.print(f"{len(rows)} environment(s) in {rt.root / 'envs'} take {gb(listing['unique_bytes'])} on disk together "
              f"(a file hard-linked into several environments, or from uv's cache, {rt.root / 'uv-cache'}, counted "
              "once)")
    from audit.errors import EnvironmentInUse

    refused = []
    for r in prune:
        try:
            rt.remove_env(r["name"])
        except EnvironmentInUse as exc:
            refused.append(r["name"])
            err.print(f"[yellow]not removed:[/yellow] {_escape(exc.message)}")
            continue
        err.print(f"removed {r['name']} ({gb(r['own_bytes'])} of its own)")
    if refused:
        err.print(f"{len(refused)} environment(s) in use were left: prune again once their audits have ended "
                  f"(exit {int(ExitCode.ENVIRONMENT)})")
        return ExitCode.ENVIRONMENT
    return ExitCode.OK


def _env(args, out, err) -> int:
    from audit.pins.lock import load
    from audit.runtimes.local import LocalRuntime

    pin = load(args.lock).get(args.pin)
    rt = LocalRuntime()
    rt.check(pin)
    with err.status(f"preparing the vLLM {pin.version} environment") as status:
        env = rt.ensure_env(pin, lambda event, **f: status.update(f.get("text", "")))
        stub = rt.ensure_stub(env)
    out.print(str(env))
    err.print(f"stub libcuda: {stub}")
    err.print("environment: " + _escape(rt.verified[str(env)]["text"]))
    return ExitCode.OK


def _audit(args, out, err) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from audit import models
    from audit.core import AuditOptions, run_audit
    from audit.systems import SYSTEMS, cells_of, select

    from audit.pins.lock import load
    from audit.runtimes import RuntimeOptions, get_runtime

    if args.parallel is not None:
        _positive(args.parallel, "parallel")
    from audit.errors import UsageError

    # an unknown pin or model is bad input before any work; the pin's engine picks the model's profile
    profile = models.for_pin(args.model, load(args.lock).get(args.pin))

    if args.runtime == "auto":  # the runtime follows the pin: its wheel locally, else its image under docker
        from audit.pins.lock import default_runtime

        args.runtime = default_runtime(load(args.lock).get(args.pin))
    pass_env = [n.strip() for n in args.pass_env.split(",") if n.strip()]
    if pass_env and args.runtime != "docker":
        raise UsageError("--pass-env only applies to --runtime docker")
    if (args.cluster or not args.wait) and args.runtime != "slurm":
        raise UsageError("--cluster and --no-wait only apply to --runtime slurm")
    from pathlib import Path

    options = RuntimeOptions(pass_env=tuple(pass_env), cluster=args.cluster, lock_dir=Path(args.lock).resolve().parent)
    get_runtime(args.runtime, options).check(load(args.lock).get(args.pin))  # bad input fails before any work
    n = len(cells_of(select("system", args.systems, SYSTEMS), select("layout", args.layouts, profile.layouts)))
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=False) as bar:
        task = bar.add_task(f"audit {args.pin}", total=n)

        def progress(event, **fields):
            if event == "stage":
                bar.update(task, description=f"audit {args.pin}: {fields['text']}")
            elif event == "cell-done":
                bar.advance(task)
                bar.update(task, description=f"audit {args.pin}: {fields['system']} / {fields['layout']} done")

        options = AuditOptions(lock_path=args.lock, runtime=args.runtime, systems=args.systems, layouts=args.layouts,
                               reports_dir=args.reports, profile=profile, parallel=args.parallel, timeout_s=args.timeout,
                               cuda_toolkit=args.cuda_toolkit, host=args.host, baseline=args.baseline,
                               expectations=args.expectations,
                               pass_env=tuple(pass_env), cluster=args.cluster, wait=args.wait, mode=args.mode,
                               slice_name=args.slice_name, profiler=args.profiler, replace=args.replace,
                               cache=args.cache, postload_every_layer=args.postload_every_layer,
                               accepted=args.accepted, plant_fault="\n".join(args.plant_fault))
        outcome = run_audit(args.pin, options, progress=progress)
    if outcome.pending:
        err.print(f"submitted {outcome.cells} Slurm job(s); their evidence goes to {outcome.run_dir}")
        err.print(f"render when they have ended (idempotent): serving-truth render {outcome.run_dir}")
        out.print(str(outcome.run_dir))
        return ExitCode.OK
    if outcome.incomplete or outcome.partial:
        err.print(f"[yellow]warning:[/yellow] {outcome.incomplete} cell(s) INCOMPLETE, "
                  f"{outcome.partial} stopped early; the ledger says where")
    if outcome.drift:
        err.print(f"[yellow]warning:[/yellow] {outcome.drift} probe target(s) drifted; see the ledger's Probe drift")
    err.print(f"evidence: {outcome.run_dir}")
    _say_where(outcome, err)
    out.print(str(outcome.ledger))
    return _findings_exit(outcome, args.strict, err)


def _say_where(outcome, err) -> None:
    if outcome.subset_of:
        err.print(f"[yellow]note:[/yellow] reports/{outcome.pin}/ holds a fuller audit ({outcome.subset_of} cells) "
                  f"than this subset; it was left as it is and this ledger written beside the run "
                  "(--replace to overwrite it)")
    if not outcome.judged:
        err.print("[yellow]note:[/yellow] no claims were judged (--expectations none)")


def _lock_resolve(args, out, err) -> int:
    from audit.pins.registry import resolve_pin

    changes = resolve_pin(args.lock, args.pin)
    if not changes:
        err.print(f"{args.pin}: images.lock already records what the registry serves")
    for key, value in changes.items():
        out.print(f"{args.pin}: {key} = {value}")
    return ExitCode.OK


def _lock_add(args, out, err) -> int:
    from audit.pins.wheelindex import add_pin

    with err.status(f"pinning {args.pin}") as status:
        fields = add_pin(args.lock, args.pin, commit=args.commit, as_of=args.as_of, nightly=args.nightly,
                         wheel_url=args.wheel_url,
                         image_tag=args.image_tag, vllm_version=args.vllm_version, variant=args.variant,
                         arch=args.arch, python=args.python, sha256=args.sha256, index_url=args.index_url,
                         github=args.github_api, note=args.note, progress=status.update)
    for key, value in fields.items():
        if key not in ("name", "warnings") and value:
            out.print(f"{args.pin}: {key} = {_escape(str(value))}")
    for warning in fields.get("warnings", []):
        err.print(f"[yellow]warning:[/yellow] {_escape(warning)}")
    err.print(f"added pin {args.pin} to {args.lock}; audit it with: make audit PIN={args.pin}")
    return ExitCode.OK


def _gate_exit(gate: dict, strict: bool, outcome, err) -> int:
    """The pin-bump gate: SERVING_CHANGED (6) when serving changed against the baseline, else FINDINGS (1) when
    a finding is new (not in the accepted-findings file), else OK; --strict adds UNVERIFIED lanes as before."""
    base = gate["baseline"]["pin"]
    from audit.report.changes import KINDS

    changes, new = gate["serving_changes"], gate["new_findings"]
    fresh = gate.get("newly_failing", 0)
    err.print(f"gate against {base}: {gate['cells_compared']} cell(s) compared; {_escape(gate['headline'])}; "
              f"{len(new)} new finding(s) ({fresh} failing only now, {len(new) - fresh} failing in {base} too but not "
              f"accepted), {gate['accepted_findings']} accepted"
              + (f" ({gate['accepted_file']})" if gate["accepted_file"] else " (no accepted-findings file)"))
    only = gate["only_in_baseline"]
    if not gate["cells_compared"]:
        err.print(f"[red]gate failed[/red]: nothing was judged: {base} and this audit share no (system, layout) cell "
                  f"({len(only)} cell(s) only in {base}, {len(gate['only_in_candidate'])} only here); audit the "
                  f"cells {base} has (e.g. without --systems/--layouts) to gate against it "
                  f"(exit {int(ExitCode.NOTHING_JUDGED)})")
        return ExitCode.NOTHING_JUDGED
    if only:
        err.print(f"[yellow]note:[/yellow] {len(only)} cell(s) of {base} were not audited here and are not gated: "
                  + ", ".join(f"{s}/{l}" for s, l in only[:8]) + (" ..." if len(only) > 8 else ""))
    # every serving change, grouped by kind in the table's order with a count per kind (never the first N rows)
    for klass in sorted(dict.fromkeys(c["class"] for c in changes), key=lambda k: KINDS[k].rank):
        rows = [c for c in changes if c["class"] == klass]
        err.print(f"  {KINDS[klass].word} ({len(rows)}):")
        for c in rows:
            err.print(f"    {_escape(c['title'])}: {_escape(str(c['before'])[:100])} -> {_escape(str(c['after'])[:100])} "
                      f"[{_escape(c.get('where') or '')}]")
    for f in new:
        err.print(f"  new finding{'' if f.get('in_baseline') else ' (failing only now)'}: {f['verdict']} {f['claim'] or '(no claim)'} {f['system']}/{f['layout']} "
                  f"{f['lane']}{' at ' + f['at'] if f['at'] else ''}: {_escape(str(f['why'])[:160])}")
    if changes:
        err.print(f"[red]gate failed[/red]: serving changed against {base} (exit {int(ExitCode.SERVING_CHANGED)})")
        return ExitCode.SERVING_CHANGED
    unverified = (outcome.verdicts or {}).get("UNVERIFIED", 0) if strict else 0
    if new or unverified:
        err.print(f"[red]gate failed[/red]: new findings against {base}"
                  + (f" (and {unverified} UNVERIFIED under --strict)" if unverified else ""))
        return ExitCode.FINDINGS
    err.print(f"gate passed against {base}")
    return ExitCode.OK


def _findings_exit(outcome, strict: bool, err) -> int:
    """FINDINGS (1) when a claim is contradicted (MISMATCH, SILENT_FALLBACK, RANK_DISAGREE), its layers
    were refused by vLLM's own code at construction or load (REFUSED: the ledger says where), or a
    required probe target drifted; with --strict also when a lane is UNVERIFIED
    (which includes claims the audit could not judge). The ledger is written either way."""
    from audit.report.verdicts import FAILING

    unbuilt = outcome.unbuilt or []
    if outcome.cells and len(unbuilt) == outcome.cells:  # no cell resolved a lane: never a pass
        names = ", ".join(n for n, _ in unbuilt[:6]) + (" ..." if len(unbuilt) > 6 else "")
        if all(why == "refused" for _, why in unbuilt):  # vLLM's own answer for every cell: a finding
            err.print(f"[red]vLLM refused every cell[/red] ({names}) before the model was built; the ledger says "
                      f"where and why (exit {int(ExitCode.FINDINGS)})")
            return ExitCode.FINDINGS
        err.print(f"[red]nothing was built[/red]: every cell ({names}) stopped before vLLM constructed the model, "
                  "so no lane could be resolved or judged; the ledger's Stages table says where each stopped "
                  f"(exit {int(ExitCode.NOTHING_JUDGED)})")
        return ExitCode.NOTHING_JUDGED
    if outcome.gate is not None:
        return _gate_exit(outcome.gate, strict, outcome, err)
    drifted = outcome.required_drift or []
    if drifted:
        err.print(f"[red]required probe target(s) drifted[/red] ({', '.join(drifted)}): the audit could not look "
                  "where it must; see the ledger's Probe drift")
    v = outcome.verdicts
    if not v:
        return ExitCode.FINDINGS if drifted else ExitCode.OK
    err.print("verdicts: " + ", ".join(f"{k} {n}" for k, n in v.items() if n))
    failing = sum(v.get(k, 0) for k in FAILING) + (v.get("UNVERIFIED", 0) if strict else 0)
    return ExitCode.FINDINGS if failing or drifted else ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
