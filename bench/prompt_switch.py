"""What a prompt switch costs: the KV re-cache (a clean pass per earlier chunk the cache reaches,
through a fresh cache) and the chunks after it (eager until the CUDA graph is captured again), on the library path
at Wan 2.1 1.3B shapes (832x480, 3-frame chunks, 4 steps + clean pass), random weights made
sensitive (bench/common/testbed.py), the real clip's prompt and a second random prompt.

One rollout per cache setting with switches after 10, 40 and 120 chunks; the switch's cost is its
chunk's latency minus the median steady chunk's, the re-cache alone is timed inside it (a bounded
cache re-encodes only the chunks it reaches: ``Rollout.recache_chunks``). With
``--comfyui`` the same rollouts also run as a user runs them: UNETLoader -> FAST-AR Patch Model ->
Autoregressive Long Sampler with a FAST-AR Prompt Schedule, in ``torch.inference_mode``, the chunk
latencies from the pack's own ``fastar.cache`` events (``bench/common/comfyui.py``).

    python bench/prompt_switch.py --out bench/results
    PYTHONPATH=.comfyui/gpu/site python bench/prompt_switch.py --comfyui .comfyui/gpu/tree --out bench/results
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fastar, header, parser, write_json  # noqa: E402
from common.testbed import CHUNK, HEIGHT, WIDTH, testbed  # noqa: E402

SWITCHES = (10, 40, 120)
SETTINGS = {
    "fastar_defaults": lambda: dict(cache=fastar.TempCacheConfig()),  # TempCache alone, as the pack defaults
    "window_3_12": lambda: dict(cache=fastar.CacheConfig("window", sink_frames=3, window_frames=12)),
}


class TimedRollout(fastar.Rollout):
    """A rollout that times each re-cache on the device."""

    def switch_prompt(self, *args):
        torch.cuda.synchronize()
        tic = time.perf_counter()
        super().switch_prompt(*args)
        torch.cuda.synchronize()
        self.recache_ms.append(1e3 * (time.perf_counter() - tic))


def through_the_nodes(args, model, context, other) -> dict:
    """The switches' cost through UNETLoader and the pack's nodes, as ComfyUI's executor runs them."""
    import tempfile

    from common import comfyui

    comfy = comfyui.harness.import_comfy(args.comfyui, cpu=False)
    import comfy.cmd.folder_paths as folder_paths

    from comfyui_fastar.nodes.prompt_nodes import PromptSchedule
    from comfyui_fastar.nodes.sampler_nodes import AutoregressiveLongSampler
    from comfyui_fastar.nodes.settings_nodes import PatchModel

    folder = tempfile.mkdtemp(prefix="fastar_prompt_switch_")
    comfyui.harness.write_wan(model, folder, "testbed", torch.bfloat16)
    folder_paths.add_model_folder_path("diffusion_models", folder)
    switches = SWITCHES
    starts = {f"start_{i}": fastar.frames.chunk_first_frame(c, CHUNK) for i, c in enumerate(switches, 2)}
    prompts = {f"prompt_{i}": [[(other if i % 2 == 0 else context).float().cpu(), {}]] for i in range(2, 2 + len(switches))}
    out = {}
    for setting in comfyui.SETTINGS:
        try:
            with comfyui.ChunkEvents() as events, torch.inference_mode():
                unet = comfyui.load_unet(comfy, "testbed.safetensors", None)
                patched = PatchModel.execute(unet, *comfyui.fastar_nodes(setting)).result[0]
                schedule = PromptSchedule.execute([[context.float().cpu(), {}]], **prompts, **starts).result[0]
                AutoregressiveLongSampler.execute(patched, [[context.float().cpu(), {}]], WIDTH, HEIGHT,
                                                  (args.chunks * CHUNK - 1) * 4 + 1, 1, 0, "1000,750,500,250", 5.0,
                                                  "3", 0.0, 1.0, prompts=schedule)
                del unet, patched
        finally:
            comfy.model_management.unload_all_models()
            comfy.model_management.soft_empty_cache()
        ms = {chunk: 1e3 * seconds for chunk, seconds, _ in events.chunks}
        near = set(switches) | {c + 1 for c in switches} | {c + 2 for c in switches}
        steady = statistics.median(m for c, m in ms.items() if c >= 8 and c not in near)
        out[setting] = {"steady_ms_per_chunk": round(steady, 1),
                        "switches": [{"after_chunks": c, "switch_chunk_extra_ms": round(ms[c] - steady, 1),
                                      "next_two_chunks_extra_ms": round(ms[c + 1] + ms[c + 2] - 2 * steady, 1)}
                                     for c in switches]}
        print(f"nodes, {setting}: steady {steady:.1f} ms/chunk; " + ", ".join(
            f"switch after {r['after_chunks']} chunks +{r['switch_chunk_extra_ms']:.0f} ms"
            for r in out[setting]["switches"]))
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--chunks", type=int, default=SWITCHES[-1] + 4)
    p.add_argument("--comfyui", help="also through the nodes, on this ComfyUI tree (core-ar-2026 or a packed one)")
    args = p.parse_args()
    model, context = testbed(prompt="wan")
    other = torch.randn(context.shape, device=context.device, dtype=context.dtype,
                        generator=torch.Generator(device=context.device).manual_seed(11))
    result = {**header("cuda"), "shape": f"{WIDTH}x{HEIGHT}",
              "chunk_frames": CHUNK, "chunks": args.chunks, "switch_after_chunks": list(SWITCHES), "settings": {}}
    for name, make in SETTINGS.items():
        prompts = [(c, other if i % 2 == 0 else context) for i, c in enumerate(SWITCHES)]
        run = TimedRollout(model, context, frames=args.chunks * CHUNK, height=HEIGHT, width=WIDTH, chunk_frames=CHUNK,
                           prompts=prompts, seed=0, **make())
        run.recache_ms = []
        ms = []
        run.run(lambda r: ms.append(1e3 * r.latency_s))
        switched = set(SWITCHES)
        after = {c + 1 for c in SWITCHES} | {c + 2 for c in SWITCHES}
        steady = statistics.median(m for c, m in enumerate(ms) if c >= 8 and c not in switched | after)
        passes = {c: sum(map(len, run.recache_chunks(c * CHUNK))) for c in SWITCHES}
        rows = [{"after_chunks": c, "recache_ms": round(r, 1), "clean_passes": passes[c],
                 "ms_per_clean_pass": round(r / passes[c], 1), "steady_chunks": round(r / steady, 2),
                 "switch_chunk_extra_ms": round(ms[c] - steady, 1),
                 "next_two_chunks_extra_ms": round(ms[c + 1] + ms[c + 2] - 2 * steady, 1)}
                for c, r in zip(SWITCHES, run.recache_ms)]
        result["settings"][name] = {"steady_ms_per_chunk": round(steady, 1), "switches": rows,
                                    "ms_per_chunk": [round(m, 1) for m in ms]}
        print(f"{name}: steady {steady:.1f} ms/chunk")
        for r in rows:
            print(f"  switch after {r['after_chunks']:3d} chunks: re-cache {r['recache_ms']:8.1f} ms "
                  f"({r['ms_per_clean_pass']:.1f} ms per clean pass), switch chunk +{r['switch_chunk_extra_ms']:.1f} ms, "
                  f"next two +{r['next_two_chunks_extra_ms']:.1f} ms")
        del run
        torch.cuda.empty_cache()
    # a switch drops the captured CUDA graph and replays the re-cache from its own: graphed vs eager,
    # beside eager vs eager (TempCache's merge adds a group's values with atomics, in no fixed order:
    # once several tokens merge into one slot, two runs round differently) and the same without a switch
    for label, prompts in (("with_switch", [(5, other)]), ("without_switch", [])):
        kw = dict(frames=12 * CHUNK, height=HEIGHT, width=WIDTH, chunk_frames=CHUNK, prompts=prompts, seed=0,
                  **SETTINGS["fastar_defaults"]())
        graphed = fastar.Rollout(model, context, **kw)
        out = graphed.run()
        eager = [fastar.Rollout(model, context, cuda_graphs=False, **kw).run() for _ in range(2)]
        rel = {name: ((a - b).float().norm() / b.float().norm()).item()
               for name, a, b in (("graphs_vs_eager", out, eager[0]), ("eager_vs_eager", eager[1], eager[0]))}
        result[label] = rel
        print(f"{label.replace('_', ' ')}: graphed vs eager rel {rel['graphs_vs_eager']:.2e}, eager vs eager "
              f"{rel['eager_vs_eager']:.2e} ({graphed.graph_replays} replays)")
    if args.comfyui:
        result["comfyui"] = through_the_nodes(args, model, context, other)
    write_json(args.out, "prompt_switch.json", result)


if __name__ == "__main__":
    main()
