"""How an audit spreads over cores: the agent's grouping of cells into processes that import vLLM, and the
default number of processes."""
import os

from audit.core import PROCESS_GIB, default_parallel
from audit.systems import LAYOUTS, SYSTEMS, cells_of
from probes.resolve.agent import split_groups

CELLS = [{"system": s.as_job(), "layout": l.as_job()} for s, l in cells_of(list(SYSTEMS.values()),
                                                                           list(LAYOUTS.values()))]


def _sms(group):
    return {tuple(c["system"]["capability"]) for c in group}


def test_one_process_per_capability_until_there_are_more_cores():
    groups = split_groups(CELLS, 2)
    assert len(groups) == len({s.capability for s in SYSTEMS.values()}) == 5
    assert all(len(_sms(g)) == 1 for g in groups)
    assert sorted(len(g) for g in groups) == [5, 5, 10, 12, 12]


def test_more_cores_split_the_largest_groups_never_mixing_capabilities():
    for slots in (8, 16, 32, 100):
        groups = split_groups(CELLS, slots)
        assert len(groups) == min(slots, len(CELLS))
        assert all(len(_sms(g)) == 1 for g in groups)
        assert sorted(c["system"]["name"] + c["layout"]["name"] for g in groups for c in g) == \
            sorted(c["system"]["name"] + c["layout"]["name"] for c in CELLS)
    # at 8 slots, the three largest groups are halved first
    assert sorted(len(g) for g in split_groups(CELLS, 8)) == [5, 5, 5, 5, 6, 6, 6, 6]


def test_default_parallelism_follows_cores_and_memory(monkeypatch, tmp_path):
    cores = len(os.sched_getaffinity(0))
    assert 1 <= default_parallel() <= cores
    # as many processes as the available memory holds, never fewer than one
    real_open = open
    meminfo = tmp_path / "meminfo"

    def fake_open(path, *a, **k):
        return real_open(meminfo if path == "/proc/meminfo" else path, *a, **k)

    monkeypatch.setattr("builtins.open", fake_open)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    for avail_gib, expected in ((0.5, 1), (PROCESS_GIB * 3 + 0.1, 3), (1000, 32)):
        meminfo.write_text(f"MemTotal: 1 kB\nMemAvailable: {int(avail_gib * 2**20)} kB\n")
        assert default_parallel() == expected
