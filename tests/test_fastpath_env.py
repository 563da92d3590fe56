"""The fast path's mechanics (probes/resolve/carry.py, probes/resolve/memo.py) on throwaway torch modules, in the
pinned environment's Python (it holds torch). The real wheel's cells are in tests/test_standins_vllm.py; here
each failure mode is planted on purpose: a layer that differs, a step whose result depends on the layer, a
value the memo cannot keep."""
import json
import os
import subprocess
import textwrap

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.vllm

TOY = '''
import json, torch
from torch import nn
from probes.resolve import carry

SHARED = {"config": "every layer holds this one"}


class Kernel:  # what a quant method builds: holds the converted weight and its layer
    def __init__(self, weight, layer):
        self.weight, self.layer, self.tiles = weight, layer, [weight.shape[0] // 2]


class QuantMethod:
    def __init__(self, odd_last=False):
        self.odd_last, self.cache = odd_last, {}

    def process(self, layer):
        w = layer.weight
        rows = w.shape[0] * 2 + (1 if self.odd_last and layer.prefix.endswith("layers.4.experts") else 0)
        layer.weight = nn.Parameter(torch.empty(rows, w.shape[1], dtype=torch.uint8, device="meta"),
                                    requires_grad=False)
        layer.weight.loader = layer.load  # a bound method of the layer, as vLLM's weight loaders are
        self.cache[tuple(w.shape)] = torch.empty(3, device="meta")
        self.kernel = Kernel(layer.weight, layer)


class Experts(nn.Module):
    def __init__(self, i, cols, qm):
        super().__init__()
        self.prefix = f"model.layers.{i}.experts"
        self.weight = nn.Parameter(torch.empty(4, cols, device="meta"), requires_grad=False)
        self.quant_method, self.cfg = qm, SHARED

    def load(self):
        return self.prefix


class Layer(nn.Module):
    def __init__(self, i, cols, qm):
        super().__init__()
        self.experts = Experts(i, cols, qm)


def build(cols=(8, 8, 8, 8, 8), odd_last=False):
    top = nn.Module()
    top.model = nn.Module()
    top.model.layers = nn.ModuleList([Layer(i, c, QuantMethod(odd_last)) for i, c in enumerate(cols)])
    return top


def run(model, every_layer=False):
    steps = [("quant_method", f"model.layers.{i}.experts", l.experts,
              (lambda e=l.experts: e.quant_method.process(e)), "toy:QuantMethod.process")
             for i, l in enumerate(model.model.layers)]
    carrier = carry.Carrier(model, steps, lambda kind, module: True, every_layer=every_layer)

    def execute(call):
        call()
        return {"outcome": "ok"}

    how = [carrier.run(i, lambda call=s[3]: execute(call))["carry"] for i, s in enumerate(steps)]
    for i in carrier.redo():
        steps[i][3]()
        how[i] = "ran again"
    return how, carrier.summary()


def state(model):
    out = []
    for l in model.model.layers:
        e = l.experts
        k = e.quant_method.kernel
        out.append({"shape": list(e.weight.shape), "dtype": str(e.weight.dtype), "kernel_weight_is_own": k.weight is e.weight,
                    "kernel_layer_is_own": k.layer is e, "tiles": k.tiles, "cfg_shared": e.cfg is SHARED,
                    "loader_bound_to_own": e.weight.loader.__self__ is e, "loader": e.weight.loader(),
                    "cache": sorted(map(str, e.quant_method.cache))})
    return out
'''


def _in_env(vllm_env, code: str, tmp_path) -> dict:
    _, _, env = vllm_env
    (tmp_path / "toy.py").write_text(TOY, encoding="utf-8")
    proc = subprocess.run([str(env / "bin" / "python"), "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=600,
                          env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": f"{ROOT}:{tmp_path}",
                               "HOME": str(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_carried_layers_end_as_if_the_step_ran_on_them(vllm_env, tmp_path):
    out = _in_env(vllm_env, '''
        import json, toy
        fast, full = toy.build(), toy.build()
        how, summary = toy.run(fast)
        toy.run(full, every_layer=True)
        print(json.dumps({"how": how, "summary": summary, "fast": toy.state(fast), "full": toy.state(full)}))
    ''', tmp_path)
    assert out["how"] == ["representative", "carried", "carried", "carried", "check"]
    assert out["fast"] == out["full"]  # new parameters, a new kernel object, its references: each layer's own
    assert all(s["kernel_layer_is_own"] and s["kernel_weight_is_own"] and s["cfg_shared"] and s["loader_bound_to_own"]
               for s in out["fast"])
    assert [s["loader"] for s in out["fast"]] == [f"model.layers.{i}.experts" for i in range(5)]
    assert out["summary"][0]["carried"] == [1, 2, 3] and out["summary"][0]["notes"] == []


def test_a_layer_that_differs_runs_the_step(vllm_env, tmp_path):
    out = _in_env(vllm_env, '''
        import json, toy
        fast, full = toy.build(cols=(8, 8, 16, 8, 8)), toy.build(cols=(8, 8, 16, 8, 8))
        how, summary = toy.run(fast)
        toy.run(full, every_layer=True)
        print(json.dumps({"how": how, "summary": summary, "same": toy.state(fast) == toy.state(full)}))
    ''', tmp_path)
    assert out["how"] == ["representative", "carried", "ran", "carried", "check"] and out["same"]
    assert "layer 2 differs before the step" in out["summary"][0]["notes"][0]


def test_a_failed_check_withdraws_every_carried_layer(vllm_env, tmp_path):
    """The step gives the last layer another shape (it reads the layer's name): the check catches it, the carried
    layers are restored and run for real, and the result is what running every layer gives."""
    out = _in_env(vllm_env, '''
        import json, toy
        fast, full = toy.build(odd_last=True), toy.build(odd_last=True)
        how, summary = toy.run(fast)
        toy.run(full, every_layer=True)
        print(json.dumps({"how": how, "summary": summary, "same": toy.state(fast) == toy.state(full),
                          "last": toy.state(fast)[-1]["shape"]}))
    ''', tmp_path)
    assert out["how"] == ["representative", "ran again", "ran again", "ran again", "check-failed"]
    assert out["same"] and out["last"] == [9, 8]
    assert out["summary"][0]["carried"] == [] and out["summary"][0]["notes"][0].startswith("check failed")


def test_the_memo_keys_on_source_arguments_and_the_facts_read(vllm_env, tmp_path):
    pkg = tmp_path / "toypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        from probes.resolve import memo
        CALLS = []

        def heuristics(shape, sku):
            CALLS.append(shape)
            memo.note_fact("sm_count", sku["sm_count"])
            return [(0, shape), {"block": (8, 16), "align": 4}]  # keys out of sorted order: kept as computed

        def opaque(x):
            return object()
    '''), encoding="utf-8")
    out = _in_env(vllm_env, '''
        import json, os, toypkg
        from probes.resolve import memo
        sku = {"sm_count": 132}
        facts = lambda fields: {f: sku[f] for f in fields}
        f = memo.memoised(toypkg.heuristics, "toy", "memo", facts)
        first = f(4, sku)
        again = f(4, sku)                       # this process: the same object
        fresh = memo.memoised(toypkg.heuristics, "toy", "memo", facts)
        from_disk = fresh(4, sku)               # another process's view: read back, types kept
        sku["sm_count"] = 148
        other_sku = fresh(4, sku)               # a fact it read differs: computed
        with open(os.path.join(os.path.dirname(toypkg.__file__), "__init__.py"), "a") as fh:
            fh.write("# edited\\n")
        edited = memo.memoised(toypkg.heuristics, "toy", "memo", facts)
        sku["sm_count"] = 132
        edited(4, sku)                          # the source changed: computed
        g = memo.memoised(toypkg.opaque, "opaque", "memo", facts)
        g(1)
        print(json.dumps({"calls": toypkg.CALLS, "same_object": first is again, "from_disk": repr(from_disk),
                          "first": repr(first), "other": repr(other_sku), "stats": memo.STATS}))
    ''', tmp_path)
    # first, the check of the first answer read from disk, another SKU, edited source; never for an answer this
    # process already has
    assert out["calls"] == [4, 4, 4, 4]
    assert out["same_object"] and out["from_disk"] == out["first"] == "[(0, 4), {'block': (8, 16), 'align': 4}]"
    assert out["stats"]["toy"] == {"computed": 3, "reused": 2, "uncacheable": 0, "rejected": 0, "checked": 1}
    assert out["stats"]["opaque"]["uncacheable"] == 1


def test_a_memo_entry_that_does_not_verify_is_recomputed_never_served(vllm_env, tmp_path):
    """The memo is evidence too: an entry whose result was edited (its seal no longer verifies), an entry moved
    into another key's file (resealed or not: its key is recomputed from its inputs), an edit resealed by the hand
    that made it (caught by computing the first answer read from disk again), and a file that is not a list of
    entries are each rejected and computed again; what the computation returns is what it computes, never the
    edited value."""
    pkg = tmp_path / "toypkg2"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        CALLS = []

        def heuristics(shape):
            CALLS.append(shape)
            return {"block_size_m": 8 * shape}
    '''), encoding="utf-8")
    out = _in_env(vllm_env, '''
        import glob, json, os, toypkg2
        from probes.resolve import memo
        facts = lambda fields: {}
        f = memo.memoised(toypkg2.heuristics, "toy", "memo", facts)
        assert f(1) == {"block_size_m": 8} and f(2) == {"block_size_m": 16}
        one, two = sorted(glob.glob("memo/*.json"), key=os.path.getmtime)
        entry = json.load(open(one))
        entry[0]["result"]["block_size_m"] = 999          # an edited result, the seal left as it was
        json.dump(entry, open(one, "w"))
        edited = memo.memoised(toypkg2.heuristics, "toy", "memo", facts)(1)
        json.dump(json.load(open(two)), open(one, "w"))   # another key's sealed entry in this key's file
        moved = memo.memoised(toypkg2.heuristics, "toy", "memo", facts)(1)
        open(one, "w").write('{"not": "a list"}')         # a malformed file
        malformed = memo.memoised(toypkg2.heuristics, "toy", "memo", facts)(1)
        good = json.load(open(one))[0]
        resealed = memo.seal(good["inputs"], good["facts"], {"block_size_m": 999})   # an edit whose hand resealed it
        json.dump([resealed], open(one, "w"))
        caught = memo.memoised(toypkg2.heuristics, "toy", "memo", facts)(1)
        other = json.load(open(two))[0]                    # another call's inputs under this key, resealed
        disguised = {**other, "key": good["key"]}
        disguised["sha256"] = memo._digest(good["key"], other["inputs"], other["facts"], other["result"])
        json.dump([disguised], open(one, "w"))
        moved_resealed = memo.memoised(toypkg2.heuristics, "toy", "memo", facts)(1)
        again = memo.memoised(toypkg2.heuristics, "toy", "memo", facts)(1)   # the rewritten entry verifies
        print(json.dumps({"edited": edited, "moved": moved, "malformed": malformed, "caught": caught,
                          "moved_resealed": moved_resealed, "again": again,
                          "calls": toypkg2.CALLS, "stats": memo.STATS["toy"]}))
    ''', tmp_path)
    assert out["edited"] == out["moved"] == out["malformed"] == out["caught"] == out["moved_resealed"] == \
        out["again"] == {"block_size_m": 8}
    # computed again after each bad entry; the resealed edit is caught by the check of the first answer a process
    # reads from disk, the disguised entry by its key recomputed from its inputs; once sound, checked and reused
    assert out["calls"] == [1, 2, 1, 1, 1, 1, 1, 1]
    assert out["stats"] == {"computed": 7, "reused": 1, "uncacheable": 0, "rejected": 5, "checked": 2}


def test_an_untrusting_memo_serves_no_stored_answer(vllm_env, tmp_path):
    """--no-cache: every call computes, even over a sound entry, and refreshes the entry."""
    pkg = tmp_path / "toypkg3"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("CALLS = []\n\ndef h(x):\n    CALLS.append(x)\n    return [x]\n", encoding="utf-8")
    out = _in_env(vllm_env, '''
        import json, toypkg3
        from probes.resolve import memo
        facts = lambda fields: {}
        memo.memoised(toypkg3.h, "toy", "memo", facts)(3)
        untrusting = memo.memoised(toypkg3.h, "toy", "memo", facts, trust=False)
        print(json.dumps({"a": untrusting(3), "calls": toypkg3.CALLS, "stats": memo.STATS["toy"]}))
    ''', tmp_path)
    assert out["a"] == [3] and out["calls"] == [3, 3]
    assert out["stats"] == {"computed": 2, "reused": 0, "uncacheable": 0, "rejected": 0, "checked": 0}


def test_the_check_of_a_stored_answer_does_not_depend_on_which_facts_the_library_reads_again(vllm_env, tmp_path):
    """A library that caches the device facts it read answers the check's recomputation without reading them again:
    the stored answer agrees, so it is served, never counted as rejected."""
    pkg = tmp_path / "toypkg4"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from probes.resolve import memo\nSEEN = {}\n\ndef h(x):\n    if 'sm' not in SEEN:\n"
        "        SEEN['sm'] = 132\n        memo.note_fact('sm_count', 132)\n    return [x * SEEN['sm']]\n",
        encoding="utf-8")
    out = _in_env(vllm_env, '''
        import json, toypkg4
        from probes.resolve import memo
        facts = lambda fields: {f: 132 for f in fields}
        memo.memoised(toypkg4.h, "toy", "memo", facts)(2)           # computed: read sm_count
        again = memo.memoised(toypkg4.h, "toy", "memo", facts)(2)   # another process's view: checked, reads nothing
        print(json.dumps({"again": again, "stats": memo.STATS["toy"]}))
    ''', tmp_path)
    assert out["again"] == [264]
    assert out["stats"] == {"computed": 1, "reused": 1, "uncacheable": 0, "rejected": 0, "checked": 1}
