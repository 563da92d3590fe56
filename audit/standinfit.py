"""How a resolve-mode stand-in fitted the release it ran in, in one place: the words the probes record (``fits ...``
or ``does not fit ...``), and the misfits the harness declares change nothing in a release (:data:`NOT_NEEDED`).
``verify-pins`` (audit/pincheck.py) and the routing diff (audit/report/diff.py) both read it. Standard library
only."""
from __future__ import annotations

_HUMMING_DEVICE = "humming device info (csrc/device_info.cpp extension)"
_NO_EXTENSION = ("humming-kernels before 0.1.16 has no device-info extension (it asks pynvml and torch directly); "
                 "vLLM {} asks Humming nothing about the device to select it (HummingExperts._supports_current_device "
                 "is has_humming() and the capability), and no audited cell builds Humming experts, so nothing reads "
                 "it; a query that did would raise without the stand-in, a simulation limit the ledger shows")
#: misfits that change nothing in a release: (stand-in, the package and version its fit names) -> why
NOT_NEEDED: dict[tuple[str, str], str] = {
    (_HUMMING_DEVICE, "humming-kernels 0.1.10"): _NO_EXTENSION.format("0.27"),
    (_HUMMING_DEVICE, "humming-kernels 0.1.12"): _NO_EXTENSION.format("0.28-0.30"),
}


def not_needed(piece: str, fit: str) -> str:
    """Why the misfit *fit* of *piece* changes nothing in this release, or ""."""
    return next((why for (p, version), why in NOT_NEEDED.items()
                 if p == piece and fit.startswith(f"does not fit {version}:")), "")


def misfit(fit: str) -> bool:
    """Whether a recorded fit says the stand-in does not fit its release."""
    return str(fit).startswith("does not fit")


def status(piece: str, fit: str | None) -> str:
    """A stand-in's fit in one word: absent (not recorded), fits, not-needed (a misfit :data:`NOT_NEEDED` covers),
    misfit."""
    if fit is None:
        return "absent"
    if not misfit(fit):
        return "fits"
    return "not-needed" if not_needed(piece, fit) else "misfit"


def stopping(fits: dict) -> dict[str, str]:
    """The misfits among *fits* ({stand-in: fit}) that stop an audit: every one :data:`NOT_NEEDED` does not cover,
    in name order. The audit asks this before any cell runs and again of the cells' own account."""
    return {k: v for k, v in sorted((fits or {}).items()) if status(k, v) == "misfit"}
