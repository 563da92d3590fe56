"""Layer-number helpers shared by the routing model and the observed-execution merge."""
from __future__ import annotations


def format_ranges(layers) -> str:
    """[1, 2, 3, 5, 7, 8] -> '1-3,5,7-8'."""
    nums = sorted(set(layers))
    out, start, prev = [], None, None
    for n in nums:
        if start is None:
            start = prev = n
        elif n == prev + 1:
            prev = n
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = n
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(out)
