"""CPU check: vLLM's own MambaHybridModelState.prepare_attn -> build_attn_metadata ->
KimiK3KDAMetadataBuilder.build for batch shapes under MTP (k=3). Stubs only for runner state."""
import sys, types, numpy as np, torch
from types import SimpleNamespace as NS
import vllm
from vllm.models.kimi_k3.nvidia import kda_metadata as km
from vllm.v1.worker.gpu.model_states import mamba_hybrid as mh
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.worker.utils import AttentionGroup

import vllm.utils.torch_utils as _tu, vllm.v1.attention.backends.utils as _bu
_tu.PIN_MEMORY = False
if hasattr(_bu, "PIN_MEMORY"): _bu.PIN_MEMORY = False
if hasattr(_tu, "is_pin_memory_available"): _tu.is_pin_memory_available = lambda: False
K = int(sys.argv[1]) if len(sys.argv) > 1 else 3
DEV = sys.argv[2] if len(sys.argv) > 2 else "cpu"
MAXR = 64
def make_builder(k, full_cg=False):
    b = object.__new__(km.KimiK3KDAMetadataBuilder)
    spec = MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.bfloat16,), num_speculative_blocks=k)
    b.kv_cache_spec = spec; b.layer_names = ["l0"]; b.device = torch.device("cpu")
    b.vllm_config = NS(cache_config=NS(mamba_cache_mode="none"), use_v2_model_runner=True, num_speculative_tokens=k,
                       scheduler_config=NS(max_num_seqs=MAXR))
    b.num_spec = k; b.use_spec_decode = k > 0; b.use_full_cuda_graph = full_cg
    b.decode_cudagraph_max_bs = MAXR * (k + 1)
    b.spec_state_indices_tensor = torch.empty((b.decode_cudagraph_max_bs, k + 1), dtype=torch.int32)
    b.non_spec_state_indices_tensor = torch.empty((b.decode_cudagraph_max_bs,), dtype=torch.int32)
    b.spec_query_start_loc = torch.empty((b.decode_cudagraph_max_bs + 1,), dtype=torch.int32)
    b.num_accepted_tokens = torch.empty((b.decode_cudagraph_max_bs,), dtype=torch.int32)
    b.use_flashinfer_prefill = False; b.use_recoverssm = False; b.spec_state_slots = k + 1
    b.recoverssm_num_accepted_tokens = None; b.recoverssm_context = None
    b.mamba_aligned_state_indices = None; b.supports_update_block_table = False
    b.checkpoint_builder = NS(build=lambda m, rows: None)
    return b, spec

def run(desc, qlens, prefilling, drafts, k=K):
    b, spec = make_builder(k)
    R = len(qlens); qlens = np.array(qlens, np.int32)
    qsl = np.zeros(R + 1, np.int32); np.cumsum(qlens, out=qsl[1:])
    seq = torch.tensor([100 + q for q in qlens], dtype=torch.int32)
    ib = NS(num_reqs=R, num_tokens=int(qsl[-1]), num_reqs_after_padding=R, num_tokens_after_padding=int(qsl[-1]),
            query_start_loc_np=qsl, query_start_loc=torch.from_numpy(qsl.copy()).to(DEV), max_query_len=int(qlens.max()),
            num_scheduled_tokens=qlens, seq_lens_cpu_upper_bound=seq.clone(), seq_lens=seq.to(DEV),
            is_prefilling_np=np.array(prefilling, bool), prefill_runs_as_decode_np=None,
            idx_mapping=torch.arange(R, device=DEV), num_draft_tokens_per_req=None if drafts is None else np.array(drafts, np.int32),
            dcp_local_seq_lens=None, positions=None, prompt_lens=None)
    st = NS(vllm_config=NS(num_speculative_tokens=k), num_accepted_tokens_gpu=torch.ones(MAXR, dtype=torch.int32, device=DEV),
            max_model_len=4096, _align_mode=False, recoverssm=None)
    grp = AttentionGroup(backend=km.KimiK3KDAAttentionBackend, layer_names=["l0"], kv_cache_spec=spec,
                         kv_cache_group_id=0, metadata_builders=[b])
    md = mh.MambaHybridModelState.prepare_attn(st, ib, mh.CUDAGraphMode.NONE, [torch.arange(R * 8, dtype=torch.int32).view(R, 8).to(DEV)],
                                               [torch.zeros(int(qsl[-1]), dtype=torch.int64, device=DEV)], [[grp]], NS(kv_cache_groups=[0]))["l0"]
    print(f"{desc:55s} prefills={md.num_prefills}/{md.num_prefill_tokens} decodes={md.num_decodes}/{md.num_decode_tokens} "
          f"spec={md.num_spec_decodes}/{md.num_spec_decode_tokens} tok_start(spec,ns)=({getattr(md,'spec_token_start',None)},{getattr(md,'non_spec_token_start',None)})")

print("vllm", vllm.__version__, "k =", K, "device tensors on", DEV)
run("decode, 4 reqs, 0 drafts (drafts=None)", [1]*4, [False]*4, None)
run("decode, 4 reqs, 0 drafts (drafts=[0]*4)", [1]*4, [False]*4, [0]*4)
run("verify, 4 reqs x (1+k)", [K+1]*4, [False]*4, [K]*4)
run("verify mixed drafts [3,0,3,0]", [K+1, 1, K+1, 1], [False]*4, [K, 0, K, 0])
run("prefill 64 alone", [64], [True], None)
run("8 decodes (k drafts) + prefill 64 (decodes first)", [K+1]*8 + [64], [False]*8 + [True], [K]*8 + [0])
run("8 decodes (0 drafts) + prefill 64", [1]*8 + [64], [False]*8 + [True], None)
run("1-token chunk, is_prefilling, seq_len>qlen (resumed)", [1], [True], None)
