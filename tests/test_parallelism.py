"""How an audit spreads over cores: the agent's grouping of cells into processes that import vLLM, and the
default number of processes."""
import os

from audit.core import PROCESS_GIB, default_parallel
from audit.systems import SYSTEMS, cells_of, select
from audit.models.kimi_k3 import LAYOUTS
from probes.resolve.agent import split_groups

#: the default audit's cells (the deployment options are opt-in)
CELLS = [{"system": s.as_job(), "layout": l.as_job()} for s, l in cells_of(list(SYSTEMS.values()),
                                                                           select("layout", None, LAYOUTS))]


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


def test_slots_run_the_sm_processes_so_the_last_slot_ends_earliest():
    from probes.resolve.agent import IMPORT_COST_CELLS, plan_slots

    def load(queue):
        return sum(IMPORT_COST_CELLS + len(g) for g in queue)

    groups = split_groups(CELLS, 2)
    queues = plan_slots(groups, 2)
    # every group placed exactly once
    assert sorted(len(g) for q in queues for g in q) == sorted(len(g) for g in groups)
    # K3's 12, 12, 10, 5, 5 cells: the two SM 10.x groups on one slot, the rest on the other (36 vs 38 units),
    # where starting the largest first on whichever slot frees first would end one slot at 40
    assert sorted(sorted(len(g) for g in q) for q in queues) == [[5, 5, 10], [12, 12]]
    assert max(load(q) for q in queues) == 38
    # no other assignment of these groups to two slots does better
    import itertools
    best = min(max(sum(IMPORT_COST_CELLS + len(g) for g, s in zip(groups, pick) if s == k) for k in (0, 1))
               for pick in itertools.product((0, 1), repeat=len(groups)))
    assert max(load(q) for q in queues) == best
    # more slots than groups: one group each; one slot: everything in it
    assert len(plan_slots(groups, 9)) == len(groups)
    assert [len(q) for q in plan_slots(groups, 1)] == [len(groups)]
    # too many assignments to try them all: the greedy placement still places each group once
    many = [[{"n": i}] * (i % 7 + 1) for i in range(40)]
    queues = plan_slots(many, 8)
    assert sum(len(q) for q in queues) == 40 and len(queues) == 8
