"""Gold-file comparison. Refresh gold files deliberately with: SERVING_TRUTH_UPDATE_GOLD=1 make test"""
import difflib
import os
from pathlib import Path

GOLD = Path(__file__).resolve().parent / "gold"


def compare(name: str, actual: str) -> None:
    path = GOLD / name
    if os.environ.get("SERVING_TRUTH_UPDATE_GOLD") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual, encoding="utf-8")
        return
    assert path.exists(), f"gold file {path} is missing; create it with SERVING_TRUTH_UPDATE_GOLD=1"
    expected = path.read_text(encoding="utf-8")
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True),
                                            f"gold/{name}", "actual", n=2))
        raise AssertionError(f"output differs from gold/{name}:\n{diff[:6000]}")
