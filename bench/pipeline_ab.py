"""AnnSA inside the rollout, side by side: TempCache alone, + AnnSA lsh 8/2, + AnnSA quant's fixed share at keeps
0.25 / 0.35 / 0.5 (``--only`` picks among these, the defaults (fastar), top-p over a 0.1 floor (topp),
quant.35/kb64, quant over blocks of 64 keys, NAME/eager, a setting with its repeating chunks launched op by op
instead of replayed from a CUDA graph, NAME/fullbias, AnnSA's kernel
reading the log m bias on every range, the sink's and the open chunk's too, NAME/inline, the clean pass's history
writes in line instead of on a side stream, NAME/bf16match, TempCache's match on bf16 instead of fp8 tensor
cores, NAME/cudnnbias, the first step's biased dense attention on cuDNN with a mask instead of the
block-sparse kernel on the all-keys plan, NAME/torchmeans, AnnSA's block means in eager torch instead of
their kernel, NAME/torchgather, the history's per-head row moves (AnnSA's re-sort, TempCache's head
alignment) by torch.gather instead of their kernel, NAME/nolastwave, the block-sparse kernel's last wave run
whole instead of split, NAME/remaketext, the text's cross-attention K/V made in every forward instead of once a
rollout, NAME/noprior, the sink and the open chunk read by the block-sparse kernel with the history instead of
by cuDNN beside it, NAME/serialprior, that cuDNN call in line instead of on a side stream beside AnnSA's plan, and
NAME/copiedkv, the model's K/V made in fresh tensors and copied into the cache instead of computed in its rows;
and bounds, not exact: NAME/freesparse, AnnSA's calls reading the sink and the open chunk on cuDNN and no
history (no plan; the writes run as always), NAME/freefirst, the first step's dense calls likewise, and
NAME/cudnnfirst, the first step's dense calls on cuDNN without TempCache's log m bias; variants join with +,
e.g. fastar/freesparse+freefirst, the history read at no cost);
14 chunks each at the TempCache
budget (reached after 8), median latency of the last 5 chunks and AnnSA's density in the last. Writes
pipeline_ab.json.

    python bench/pipeline_ab.py --out bench/results     # about 1.5 minutes on an H200
    python bench/pipeline_ab.py --only quant.35,quant.35/kb128
    python bench/pipeline_ab.py --smoke --out /tmp      # tiny model on the CPU: checks the script only
"""
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_bench as E  # noqa: E402
from testbed import testbed  # noqa: E402
from comfyui_fastar.kernels import block_sparse_attention as bsa  # noqa: E402  (importable once E is)
from comfyui_fastar.kernels.block_means import block_means_torch  # noqa: E402
from comfyui_fastar.kernels.gather_rows import gather_rows_torch  # noqa: E402

smoke = "--smoke" in sys.argv
out_dir = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "bench/results"
dev, size, hw = ("cpu", "tiny", (64, 96)) if smoke else ("cuda", "1.3B", (480, 832))
model, ctx = testbed(size=size, device=dev)
A, T = E.AnnConfig, E.TempCacheConfig
E.SETTINGS.update({
    "lsh8/2": (T(), A(method="lsh")),
    "quant.25": (T(), A(method="quant", keep_fraction=0.25, keep_mass=0.0)),
    "quant.35": (T(), A(method="quant", keep_fraction=0.35, keep_mass=0.0)),
    "quant.5": (T(), A(method="quant", keep_fraction=0.5, keep_mass=0.0)),
    "topp": (T(), A(method="quant", keep_fraction=0.1, keep_mass=0.95)),
})
RUNS = {"tempcache": ("tempcache", 0), "lsh8/2": ("lsh8/2", 0), "quant.25": ("quant.25", 0),
        "quant.35": ("quant.35", 0), "quant.5": ("quant.5", 0), "quant.35/kb64": ("quant.35", 64),
        "topp": ("topp", 0), "fastar": ("fastar", 0)}
names = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else \
    ["tempcache", "lsh8/2", "quant.25", "quant.35", "quant.5", "tempcache"]
chunks = 4 if smoke else 14
E.real_rollout(model, ctx, 2, hw, "lsh8/2")  # warm-up: Triton compiles, cuDNN plans
E.real_rollout(model, ctx, 2, hw, "quant.35")


@contextlib.contextmanager
def no_prior():
    """The keys every query reads in the block-sparse kernel with the rest, not on cuDNN as its prior."""
    with E.patched(E.fastar.ann, "attend_lse", lambda q, k, v: None), \
            E.patched(E.fastar.attention, "attend_lse", lambda q, k, v: None):
        yield


@contextlib.contextmanager
def torch_gather():
    """Both callers of the row-gather kernel (AnnSA's re-sort, TempCache's head alignment) on torch.gather."""
    with E.patched(E.fastar.kvcache, "gather_rows_auto", gather_rows_torch), \
            E.patched(E.fastar.tempcache, "gather_rows_auto", gather_rows_torch):
        yield


def fixed_only(self, layer, q, keys, values, bias, plan=None):
    """AnnSA's call reading the cache's fixed span (the sink, the open chunk) alone, on cuDNN: no plan, no history."""
    fixed = self.cache.fixed_rows() or slice(None)  # before the sink is committed: every key
    return E.fastar.attend(q, keys[:, fixed], values[:, fixed])


def unbiased_only(q, k, v, bias, window):
    """The first step's dense call reading the keys before the biased history alone."""
    lo = window[0] or k.shape[1]
    return E.fastar.attend(q, k[:, :lo], v[:, :lo])


# NAME/variant -> the context it runs in; fullbias: the bias window spanning every key, so AnnSA's kernel reads the
# bias on every range
VARIANTS = {"eager": contextlib.nullcontext,
            "fullbias": lambda: E.patched(E.fastar.KVCache, "bias_window", lambda self: (0, 1 << 62)),
            "inline": lambda: E.patched(E.fastar.FastARAttention, "overlap_writes", False),
            "bf16match": lambda: E.patched(E.fastar.tempcache, "_fp8_gemm", lambda device: False),
            "cudnnbias": lambda: E.patched(E.fastar.attention, "attend_biased",
                                           lambda q, k, v, bias, window: E.fastar.attend(q, k, v, key_bias=bias)),
            "torchmeans": lambda: E.patched(E.fastar.ann, "block_means_auto", block_means_torch),
            "torchgather": torch_gather,
            "nolastwave": lambda: E.patched(bsa, "tail_split", lambda n_items, wave: (n_items, 1)),
            "remaketext": lambda: E.patched(E.fastar.FastARAttention, "cross_kv", lambda self, context, make: make(context)),
            "noprior": no_prior,
            "serialprior": lambda: E.patched(E.fastar.ann.AnnSA, "overlap_prior", False),
            "copiedkv": lambda: E.patched(E.fastar.FastARAttention, "kv_rows", lambda self, layer: None),
            "freesparse": lambda: E.patched(E.fastar.ann.AnnSA, "attention", fixed_only),
            "freefirst": lambda: E.patched(E.fastar.attention, "attend_biased", unbiased_only),
            "cudnnfirst": lambda: E.patched(E.fastar.attention, "attend_biased",
                                            lambda q, k, v, bias, window: E.fastar.attend(q, k, v))}


out = {}
for name in names:
    base, _, variant = name.partition("/")
    parts = variant.split("+") if variant else []
    known = bool(parts) and all(p in VARIANTS for p in parts)  # else the whole name is a RUNS entry
    setting, kb = RUNS[base if known else name]
    with contextlib.ExitStack() as stack:
        if kb:
            stack.enter_context(E.key_block(kb))
        for part in parts if known else []:
            stack.enter_context(VARIANTS[part]())
        rows = E.real_rollout(model, ctx, chunks, hw, setting, log_every=100, cuda_graphs=not name.endswith("/eager"))
    key = name if name not in out else f"{name}#{sum(k.split('#')[0] == name for k in out) + 1}"  # A B A B: keep both
    out[key] = E.steady_state(rows)
    print(key, json.dumps(out[key]), flush=True)
os.makedirs(out_dir, exist_ok=True)
with open(os.path.join(out_dir, "pipeline_ab.json"), "w") as f:
    json.dump(out, f, indent=1)
