"""Observe mode without a GPU, against the real pinned vLLM wheel.

The workload's engine arguments for every lane go through vLLM's own server parser and config (the
resolve agent builds the sliced model from them), and observe mode's counting wrappers, layer scopes
and graph hooks are installed into processes that built the model: every target must exist in the
wheel (no drift), and the kernels of the backends each cell chose must be wrapped."""
import pytest


pytestmark = pytest.mark.vllm
CELLS = (("b200_sxm", "tp8"), ("b200_sxm", "dep8"), ("b200_sxm", "tp8-mtp"), ("h100_sxm", "tp8"),
         ("rtx_pro_6000_server", "tp8"))  # SM120 picks DeepGEMM FP4 experts
TRACE_DIR = "/tmp/serving-truth-observe-traces"  # only parsed here: the check writes its trace in the cell's dir


@pytest.fixture(scope="module")
def dry_request(vllm_env, tmp_path_factory):
    """Resolve the sliced model for each lane with observe mode's arguments, then install its targets."""
    from audit.models.kimi_k3 import KIMI_K3
    from audit.runtimes import RunRequest
    from audit.systems import SYSTEMS
    from audit.models.kimi_k3 import LAYOUTS
    from probes.observe.workload import serve_argv

    rt, pin, _ = vllm_env
    req = RunRequest(pin=pin, profile=KIMI_K3, cells=[(SYSTEMS[s], LAYOUTS[l]) for s, l in CELLS],
                     run_dir=tmp_path_factory.mktemp("observe-dry"), parallel=2,
                     serve_args=tuple(serve_argv("MODEL", [], trace_dir=TRACE_DIR)[1:]), slice="slice4",
                     observe_install=True)
    rt.run(req, lambda *a, **k: None)
    return req


@pytest.fixture(scope="module")
def dry_run(dry_request):
    from audit.evidence import files as evidence

    out = {}
    for f in evidence.read_dir(dry_request.evidence_dir):
        cell = f.header.get("cell") or {}
        key = (cell.get("system"), cell.get("layout"))
        for r in f.records:
            out.setdefault(key, {}).setdefault(r["kind"], []).append(r)
    return out


@pytest.fixture(scope="module")
def dry_run_routing(dry_request):
    from audit.evidence import files as evidence
    from audit.report import routing
    from audit.models.kimi_k3 import KIMI_K3

    built = routing.build_routing(evidence.read_dir(dry_request.evidence_dir), KIMI_K3, pin={},
                                  expected=list(CELLS))
    return {(c["system"], c["layout"]): c for c in built["cells"]}


def test_workload_arguments_parse_through_vllm_for_every_lane(dry_run):
    for key in CELLS:
        (config,) = dry_run[key]["config"]
        assert config["cudagraph_capture_sizes"] == [1, 2, 4, 8, 16], key
        assert config["chunked_prefill"] is True and config["max_num_batched_tokens"] == 2048
        assert config["load_format"] == "dummy" and config["num_hidden_layers"] == 4
    assert dry_run[("b200_sxm", "tp8")]["config"][0]["tensor_parallel_size"] == 8
    dep = dry_run[("b200_sxm", "dep8")]["config"][0]
    assert dep["data_parallel_size"] == 8 and dep["enable_expert_parallel"] is True
    assert "deep_gemm_mega_moe" in dep["moe_backend"].lower()
    assert dry_run[("b200_sxm", "tp8-mtp")]["config"][0]["speculative"] == "mtp"


def test_the_slice_keeps_every_layer_kind(dry_run_routing):
    for key in CELLS:
        kinds = dry_run_routing[key]["layer_kinds"]
        assert kinds == {"dense": [0], "kda": [0, 1, 2], "mla": [3], "moe": [1, 2, 3]}, (key, kinds)
        # the MTP draft layer (index 4 = num_hidden_layers) is an MLA + MoE layer of its own model: the draft's
        draft = (dry_run_routing[key].get("draft") or {}).get("layer_kinds") or {}
        assert draft == ({"mla": [4], "moe": [4], "mtp": [4]} if key[1] == "tp8-mtp" else {}), (key, draft)


def test_observe_targets_exist_in_the_wheel_and_wrap_the_chosen_kernels(dry_run):
    from probes import models as models_probes
    from probes.observe.session import GRAPH_HOOKS, entries

    KERNELS, SCOPES = entries(models_probes.load("kimi_k3", schemes=("mxfp4",)))

    for key in CELLS:
        (status,) = dry_run[key]["observe-status"]
        targets = status["targets"]
        drift = {s: v for s, v in targets.items() if v.startswith("missing")}
        assert drift == {}, (key, drift)
        for spec in list(GRAPH_HOOKS) + [s.spec for s in SCOPES]:
            assert targets[spec] == "patched", (key, spec, targets[spec])
        assert targets["vllm._custom_ops:fused_kda_decode"] == "patched"
        patched = [k for k in KERNELS if targets[k.spec] == "patched"]
        assert {k.lane for k in patched} >= {"kda.prefill", "kda.decode", "kda.spec_verify", "mla.decode",
                                           "mla.prefill", "moe"}, key
        # every experts class vLLM accepted for this cell's MoE layers has its entry point wrapped
        accepted = {r["cls"].rsplit(":", 1)[1] for r in dry_run[key].get("candidate", []) if r.get("supported")}
        by_class = {k.spec.rsplit(":", 1)[1].split(".")[0]: k for k in KERNELS if k.lane == "moe"}
        assert accepted or key == ("b200_sxm", "dep8"), key  # dep8 builds MegaMoE experts directly
        assert accepted <= set(by_class), (key, accepted - set(by_class))
        assert all(targets[by_class[c].spec] == "patched" for c in accepted), key
    assert targets[next(k.spec for k in KERNELS if k.path == "DeepGEMM MegaMoE")] == "patched"


def test_phase_attribution_reads_vllms_real_kda_metadata(dry_run):
    """The KDA scope's phase, from vLLM's own KimiK3KDAMetadata set through its forward context."""
    for key in (("b200_sxm", "tp8"), ("h100_sxm", "tp8")):
        (check,) = dry_run[key]["observe-phase-check"]
        assert "error" not in check, check
        assert {k: check[k] for k in ("prefill", "decode", "spec-verify", "mixed")} == {
            "prefill": "prefill", "decode": "decode", "spec-verify": "spec-verify", "mixed": "mixed"}


def test_vllm_serve_loads_the_probe_plugin(vllm_env, tmp_path):
    """The exact command observe mode runs (`vllm serve` + the workload's arguments) loads the staged
    plugin through vLLM's own CLI before it needs a GPU: the API server process writes its evidence file
    (then, here, the server fails for want of a GPU, which is expected)."""
    import json
    import subprocess

    from audit.models.kimi_k3 import KIMI_K3
    from audit.runtimes.base import stage_probes
    from probes.observe.workload import serve_argv

    rt, pin, env = vllm_env
    stub = rt.ensure_stub(env)
    stage = tmp_path / "stage"
    stage.mkdir()
    stage_probes(stage)
    out = tmp_path / "out"
    out.mkdir()
    model = KIMI_K3.write_model_dir(tmp_path / "model", KIMI_K3.slices["slice4"].patch)
    from audit.runtimes.base import observe_env

    run_env = {**rt._env(env, stub, stage, tmp_path), **observe_env(str(out), "b200_sxm--tp8", KIMI_K3)}
    argv = serve_argv(str(model), ["--tensor-parallel-size", "1"])
    r = subprocess.run([str(env / "bin" / "vllm"), "serve", *argv, "--host", "127.0.0.1", "--port", "1"],
                       env=run_env, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0  # no GPU here
    files = sorted(out.glob("evidence-*.jsonl"))
    assert files, r.stderr[-3000:]
    header = json.loads(files[0].read_text().splitlines()[0])
    assert header["mode"] == "observe" and header["cell"] == {"system": "b200_sxm", "layout": "tp8"}
    assert header["model_probes"] == "kimi_k3"  # the model's own targets and kernel entries are installed too
    events = [json.loads(line).get("event") for f in files for line in f.read_text().splitlines()[1:]]
    assert "loaded" in events


def test_profiler_settings_pass_vllms_checks_and_its_trace_is_read(dry_request, dry_run):
    """The workload's --profiler-config goes through vLLM's parser into its ProfilerConfig, passes the
    worker's validation under the simulated CUDA platform and enables the /start_profile and
    /stop_profile routes; one real session of vLLM's worker profiler (CPU activity: no GPU here),
    named as a worker names it, writes a trace that probes.observe.traces reads back with its prefix and rank."""
    from probes.observe.traces import summarize

    for key in CELLS:
        (check,) = dry_run[key]["observe-profiler-check"]
        assert check["config"] == {"profiler": "torch", "dir": TRACE_DIR, "activities": ["CUDA"],
                                   "with_stack": False, "ignore_frontend": True}, key
        assert check["worker_validation"] == "ok", (key, check)
        assert check["routes"] == ["/start_profile", "/stop_profile"], (key, check)
        assert "session_error" not in check, (key, check)
        prefix = f"check-{key[0]}"
        assert check["worker_name"] == f"{prefix}_dp0_pp0_tp0_dcp0_ep0_rank0", check
        (trace,) = summarize(str(dry_request.evidence_dir / f"{key[0]}--{key[1]}" / check["trace_dir"]),
                             categories=("cpu_op",))
        assert trace["prefix"] == prefix and trace["rank"] == 0 and trace["tp"] == 0, trace
        assert trace["file"].endswith(".pt.trace.json.gz") and "error" not in trace, trace
        assert trace["kernels"]["aten::mm"] == {"direct": 3, "in_graph": 0}, trace["kernels"].get("aten::mm")


def test_observe_agent_records_the_map_and_its_profiler_wiring_without_a_gpu(vllm_env, tmp_path):
    """The observe agent as a runtime starts it, in the pinned environment: before serving it looks the
    kernel-name map up in this build; `vllm serve` gets the profiler config pointing into the cell's
    evidence directory; serving fails here (no GPU) and the agent still records that no trace was
    written, which the ledger says plainly instead of corroborating anything."""
    import json
    import subprocess

    from audit.evidence import files as evidence
    from audit.report import routing
    from audit.models.kimi_k3 import KIMI_K3
    from audit.report.render import render_ledger
    from audit.runtimes import RunRequest
    from audit.runtimes.base import observe_env, stage_probes, write_model_dirs, write_plan
    from audit.systems import SYSTEMS, Layout
    from probes.observe.kernel_names import KERNEL_NAMES

    rt, pin, env = vllm_env
    stub = rt.ensure_stub(env)
    layout = Layout("tp1", "one process", ("--tensor-parallel-size", "1"), 1)
    req = RunRequest(pin=pin, profile=KIMI_K3, cells=[(SYSTEMS["b200_sxm"], layout)], run_dir=tmp_path,
                     mode="observe", slice="slice4")
    write_model_dirs(req)
    stage_probes(tmp_path)
    out = req.evidence_dir / "b200_sxm--tp1"
    out.mkdir(parents=True)
    plan = write_plan(req, model_dir=str(tmp_path / "model"), stub_libcuda="", out_dir=str(req.evidence_dir))
    run_env = {**rt._env(env, stub, tmp_path, tmp_path), **observe_env(str(out), "b200_sxm--tp1", req.profile)}
    r = subprocess.run([str(env / "bin" / "python"), "-m", "probes.observe.agent", str(plan), "0"], env=run_env,
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=900)
    assert r.returncode == 1, r.stderr[-3000:]  # the workload failed: no GPU
    recs = {}
    for f in evidence.read_dir(req.evidence_dir):
        for rec in f.records:
            recs.setdefault(rec["kind"], []).append(rec)
    (kmap,) = recs["kernel-map"]
    # the map the agent records: the served model's (its scheme's first, then its own) and the shared one
    from probes import models as models_probes
    from probes.observe.kernel_names import all_names

    expected = all_names(models_probes.load(req.profile.probes, schemes=req.profile.schemes))
    assert [(e["path"], e["pattern"]) for e in kmap["entries"]] == [(e.path, e.pattern) for e in expected]
    assert set(KERNEL_NAMES) <= set(expected)
    assert {e["status"] for e in kmap["entries"]} == {"in build", "not checkable"}
    (job,) = recs["job"]
    config = json.loads(job["argv"][job["argv"].index("--profiler-config") + 1])
    assert config["profiler"] == "torch" and config["torch_profiler_dir"] == str(out / "traces")
    (work,) = recs["workload"]
    assert work["ok"] is False and "before it was ready" in work["error"]["message"]
    (traces,) = recs["profiler-traces"]
    assert traces["traces"] == [] and "error" not in traces
    built = routing.build_routing(evidence.read_dir(req.evidence_dir), KIMI_K3, pin=pin.as_provenance(),
                                  expected=[("b200_sxm", "tp1")])
    pf = built["cells"][0]["observed"]["profiler"]
    assert pf["traces"] == 0 and pf["map_not_in_build"] == []
    assert "configured but wrote no trace" in render_ledger(built, profile=KIMI_K3, reproduce="make audit")
