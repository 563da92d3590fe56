"""GPU code a wheel ships, read from its libraries' fatbins (probes/core/elfscan.py), and a library with no code for
the GPU's SM ending a cell as a load failure on the device (never a simulation limit)."""
import pytest

from probes.core.stages import NO_DEVICE_CODE, stop_rule

pytestmark = pytest.mark.vllm


def test_the_pinned_wheels_gpu_code_per_library(vllm_env):
    from audit.runtimes.local import LocalRuntime
    from probes.core.elfscan import device_code

    rt, pin, env = vllm_env
    code = LocalRuntime.device_code(env)
    # cross-checked with cuobjdump --list-elf / --list-ptx on this wheel
    assert code["vllm/_flashmla_C.abi3.so"] == {"sass": ["sm_90a", "sm_100f"], "ptx": []}
    assert code["vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"] == {"sass": ["sm_90a"], "ptx": []}
    assert code["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"] == {"sass": ["sm_80"], "ptx": ["compute_80"]}  # ~300 MB
    assert "sm_120f" in code["vllm/_C_stable_libtorch.abi3.so"]["sass"]
    assert code["vllm/third_party/deep_gemm/_C*.so"] == {"sass": [], "ptx": [], "jit": True, "sm_majors": [9, 10, 12]}
    site = next(env.glob("lib/python*/site-packages"))
    assert device_code(site / "vllm" / "cumem_allocator.abi3.so") is None  # no GPU code shipped
    assert device_code(site / "vllm" / "__init__.py") is None  # not an ELF file


def test_no_code_for_the_sm_is_a_load_failure_not_a_limit():
    kw = dict(in_vllm=False, assertion=False, raise_line=True, cause=None, message="no code for SM 12.x")
    assert stop_rule(**kw, type_name=NO_DEVICE_CODE)[0] == "refused"
    assert "no code for this GPU's SM" in stop_rule(**kw, type_name=NO_DEVICE_CODE)[1]
    assert stop_rule(**kw, type_name="somelib:NoDeviceCode")[0] == "limit"  # only the harness's own declaration
    assert stop_rule(**kw)[0] == "limit"
