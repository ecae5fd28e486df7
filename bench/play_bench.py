"""A live FAST-AR World Play session against the same rollout offline: frames a second and key-to-frame latency.

Matrix-Game 2.0's universal model at its shapes (Wan 2.1 1.3B with the action module in blocks 0-14, random
weights written at the released key layout, bf16, 640x352), loaded by FAST-AR Matrix-Game 2.0 Loader; its start
image encoded by ComfyUI's CLIP vision model (ViT-H/14, random weights, as CLIP Vision Encode with crop none
does) and a Wan 2.1 VAE at its real widths (random weights); the frames are decoded by that VAE, or with
``--decoder taehv`` by a TAEHV-family fast decoder at taew2_1's real layout (random weights, float16 as
released, loaded by FAST-AR Load Fast Decoder; it needs a ComfyUI with TAEHV). The node runs in a worker thread inside
``torch.inference_mode``, as ComfyUI's executor runs it; its session is served by the pack's own routes on a
local aiohttp server (the routes ComfyUI's PromptServer mounts), and a player on the session's socket holds each
of a round of actions for ``--hold`` chunks (each posted at a moment drawn within a chunk period), then stops
after ``--chunks``. The session's log is then played
offline by the same node (no page). Rounds alternate live and offline (``--repeats``), after one untimed
offline warm-up.

Per run, over the chunks after the first two: the chunk period (a chunk's frames every so many ms: frames a
second), the rollout's own ms a chunk, the decode's ms a chunk (``MatrixGame.decode``, synchronized on a
GPU), and (live) the time from posting an action to the arrival of the first
frame of the first chunk that took it. The medians over rounds are written to ``play_bench.json``.

    python bench/play_bench.py --comfyui PATH --out bench/results   # a GPU; PATH: a ComfyUI tree
    python bench/play_bench.py --comfyui PATH --decoder taehv --out bench/results   # the fast decoder
    python bench/play_bench.py --comfyui PATH --smoke --out /tmp     # tiny shapes on the CPU: the script only
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import fastar, header, parser, window_cache, write_json  # noqa: E402,F401  (fastar: the checkout, imported)
from common.comfyui import ChunkEvents, harness  # noqa: E402

ACTIONS = ("W", "W+look(0,0.05)", "A", "S+look(0.03,0)", "D", "idle")
SKIP = 2  # chunks left out of the statistics: the first captures CUDA graphs


def parse_args(argv=None):
    p = parser(__doc__, smoke=True)
    p.add_argument("--comfyui", required=True, help="a ComfyUI tree (its comfy package is imported)")
    p.add_argument("--chunks", type=int, default=40, help="chunks a session plays (12 video frames each)")
    p.add_argument("--hold", type=int, default=2, help="chunks each action is held")
    p.add_argument("--repeats", type=int, default=3, help="rounds of live and offline")
    p.add_argument("--cache", choices=("tempcache", "window"), default="tempcache",
                   help="TempCache at its defaults, or the model's own window (6 latent frames)")
    p.add_argument("--decoder", choices=("wan", "taehv"), default="wan",
                   help="what decodes the frames: the Wan 2.1 VAE, or a TAEHV-family fast decoder (taew2_1's layout)")
    p.add_argument("--serial", action="store_true",
                   help="decode, encode and send each chunk before the next samples (the loop before pipelining)")
    p.add_argument("--matrix", action="store_true",
                   help="in one process (one world built): both decoders x serial and pipelined, a file each")
    p.add_argument("--offline-rounds", type=int, default=None,
                   help="rounds that also replay the log offline (default: every round)")
    args = p.parse_args(argv)
    args.decoders = ("wan", "taehv") if args.matrix else (args.decoder,)
    args.loops = (True, False) if args.matrix else (args.serial,)
    return args


def build(args, folder: str):
    """The loaded world, the CLIP vision tokens, the start image and the frames' decoders by ``--decoder``
    name (None: the start image's VAE), as the graph's nodes make them."""
    import comfy.clip_vision
    import comfy.sd
    import comfy.utils

    from comfyui_fastar.nodes.matrix_game_nodes import MatrixGameLoader, folder_paths
    from comfyui_fastar.nodes.sampler_nodes import StartImage
    from comfyui_fastar.testing.checkpoints import matrix_game_weights
    from safetensors.torch import save_file

    size = dict(dim=256, heads=2, layers=2, ffn=256, clip=1280) if args.smoke else \
        dict(dim=1536, heads=12, layers=30, ffn=8960, clip=1280, hidden=1024, key_hidden=128, freq=256)
    save_file(matrix_game_weights("universal", dtype=torch.bfloat16, **size),
              os.path.join(folder, "mg_universal.safetensors"))
    folder_paths.add_model_folder_path("diffusion_models", folder)
    world = MatrixGameLoader.execute("mg_universal.safetensors").result[0]
    vae_path = harness.wan_vae_file(os.path.join(folder, "vae.safetensors"))
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(vae_path)))
    image = torch.rand(1, 352, 640, 3, generator=torch.Generator().manual_seed(0))
    clip = comfy.clip_vision.load(str(harness.clip_vision_h_file(os.path.join(folder, "clip_vision_h.safetensors"))))
    tokens = clip.encode_image(image, crop=False)  # CLIP Vision Encode, crop "none"
    decoders = {"wan": None}
    if "taehv" in args.decoders:
        from comfyui_fastar.nodes.fast_decoder_nodes import load_fast_decoder

        decoders["taehv"] = load_fast_decoder(str(harness.taehv_file(os.path.join(folder, "taew2_1.safetensors"),
                                                                     dtype=torch.float16)), "play_bench")
    return world, tokens, StartImage(image, vae), decoders


class DecodeTimes:
    """Times each chunk's decode (``play_worlds.MatrixGame.decode``, which yields frames as they are decoded:
    the time inside it, its stream waited for on a GPU (the pipelined loop's own, so the sampling beside it is
    not), the encoding and sending between its frames left out) while installed."""

    def __init__(self, cuda: bool):
        from comfyui_fastar.nodes import play_worlds

        self.players, self.real, self.cuda, self.ms = play_worlds, play_worlds.MatrixGame.decode, cuda, []
        real, times = self.real, self

        def decode(player, x0):
            frames, spent = real(player, x0), 0.0
            while True:
                if times.cuda:
                    torch.cuda.current_stream().synchronize()
                t = time.perf_counter()
                frame = next(frames, None)
                if times.cuda:
                    torch.cuda.current_stream().synchronize()
                spent += time.perf_counter() - t
                if frame is None:
                    break
                yield frame
            times.ms.append(1e3 * spent)

        play_worlds.MatrixGame.decode = decode

    def take(self) -> float:
        """The median decode ms of the chunks since the last call, after the first ``SKIP``."""
        ms, self.ms = self.ms, []
        return statistics.median(ms[SKIP:] or ms)

    def close(self):
        self.players.MatrixGame.decode = self.real


def run_node(play, kwargs, events: ChunkEvents):
    """WorldPlay.execute in a worker thread under inference mode; returns its result (or raises its error)."""
    out = {}

    def work():
        try:
            with torch.inference_mode():
                out["result"] = play.execute(**kwargs).result
        except BaseException as exc:  # noqa: BLE001  (handed to the caller)
            out["error"] = exc

    events.chunks.clear()
    thread = threading.Thread(target=work)
    thread.start()
    return thread, out


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, -(-len(ordered) * q // 100) - 1))]


def steady(times: list[float], per: int) -> dict:
    """Chunk period from the times each chunk completed (after ``SKIP``): ms a chunk and frames a second."""
    t = times[SKIP:]
    periods = [b - a for a, b in zip(t, t[1:])]
    ms = 1e3 * statistics.median(periods)
    return {"period_ms": ms, "fps": per * 1e3 / ms}


async def player(url: str, args) -> dict:
    """The page: posts each action for ``--hold`` chunks, stops after ``--chunks``; times every frame (the frames
    shown first, which come before any chunk, are not a chunk's). A post falls at a moment drawn uniformly
    within a chunk period after the chunk that prompts it arrives, as a person's keys fall at any moment and
    not on a chunk's arrival (which favours the loop that takes the action soonest after sending a chunk)."""
    import aiohttp

    sent, frames, chunks, acks, end, later = {}, {}, [], {}, None, []
    rng = random.Random(0)
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(url, max_msg_size=1 << 24) as ws:
            posts = 0

            async def post(delay: float = 0.0):
                nonlocal posts
                await asyncio.sleep(delay)
                posts += 1
                sent[posts] = time.perf_counter()
                await ws.send_str(json.dumps({"action": ACTIONS[(posts - 1) % len(ACTIONS)], "id": posts}))
            async for msg in ws:
                now = time.perf_counter()
                if msg.type == aiohttp.WSMsgType.BINARY:
                    frames[int.from_bytes(msg.data[:4], "big")] = now
                    continue
                m = json.loads(msg.data)
                if m["type"] == "hello":
                    await post()
                elif m["type"] == "ack":
                    acks[m["seq"]] = sent[m["id"]]
                elif m["type"] == "chunk":
                    chunks.append({**m, "arrived": now})
                    if m["chunk"] + 1 >= args.chunks:
                        await ws.send_str(json.dumps({"stop": True}))
                    elif m["chunk"] % args.hold == args.hold - 1:
                        period = now - chunks[-2]["arrived"] if len(chunks) > 1 else 0.0
                        later.append(asyncio.ensure_future(post(rng.uniform(0.0, period))))
                elif m["type"] == "end":
                    end = m
                    break
            for task in later:
                task.cancel()
    # key to frame: a post's sending to the arrival of the first frame of the first chunk that took it
    # (the posts the first SKIP chunks took are left out, as those chunks are from the period: they compile
    # and capture CUDA graphs, and a session pays that once)
    latency, seen = [], set()
    for c in chunks:
        if c["chunk"] >= SKIP and c["seq"] and c["seq"] not in seen and c["seq"] in acks and c["frames"][0] in frames:
            seen.add(c["seq"])
            latency.append(1e3 * (frames[c["frames"][0]] - acks[c["seq"]]))
    last_frame = [max(frames[n] for n in range(c["frames"][0], sum(c["frames"])) if n in frames) for c in chunks]
    return {"log": end["log"], "latency_ms": latency, "chunk_done": last_frame, "frames": len(frames),
            "per": chunks[-1]["frames"][1]}


def main(argv=None):
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    harness.import_comfy(args.comfyui, cpu=not cuda)
    from aiohttp import web

    from comfyui_fastar.fastar import handoff
    from comfyui_fastar.nodes import play_nodes, play_routes

    loop = asyncio.new_event_loop()
    announced = []
    # ComfyUI's PromptServer, as far as the node uses it: its route table and loop, the client that queued
    # the session and the events it sends that client
    server = types.SimpleNamespace(routes=web.RouteTableDef(), loop=loop, client_id="bench",
                                   send_sync=lambda event, data, sid: announced.append(data))
    saved = play_nodes.prompt_server, handoff.PIPELINED
    play_nodes.prompt_server = lambda: server
    play_routes.register_routes(server)
    decode_ms = DecodeTimes(cuda)
    try:
        with ChunkEvents() as events:
            return _measure(args, argv, loop, server, announced, events, decode_ms, cuda)
    finally:
        play_nodes.prompt_server, handoff.PIPELINED = saved
        decode_ms.close()
        loop.close()


def _measure(args, argv, loop, server, announced, events, decode_ms, cuda):
    from aiohttp import web

    from comfyui_fastar.fastar import handoff

    asyncio.set_event_loop(loop)
    app = web.Application()
    app.add_routes(server.routes)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    port = harness.free_port()
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())

    results = []
    with tempfile.TemporaryDirectory() as folder:
        world, tokens, start, decoders = build(args, folder)
        for args.decoder in args.decoders:
            for args.serial in args.loops:
                handoff.PIPELINED = not args.serial
                results.append(_rounds(args, argv, loop, port, announced, events, decode_ms, cuda, world, tokens,
                                       start, decoders[args.decoder]))
    loop.run_until_complete(runner.cleanup())
    return results[0] if len(results) == 1 else results


def _rounds(args, argv, loop, port, announced, events, decode_ms, cuda, world, tokens, start, decoder):
    """One configuration's warm-up and rounds; its JSON written."""
    from comfyui_fastar.nodes.play_nodes import WorldPlay
    from comfyui_fastar.nodes.world_nodes import Actions

    size = dict(width=64, height=48) if args.smoke else dict(width=640, height=352)
    seconds = args.chunks * 12 / 16
    cache = window_cache(world.variant) if args.cache == "window" else None
    base = dict(world=world, seed=0, max_seconds=seconds, clip_vision_output=tokens, start=start, cache=cache,
                vae=decoder, **size)

    def offline(log):
        thread, out = run_node(WorldPlay, {**base, "actions": Actions(log)}, events)
        thread.join()
        if "error" in out:
            raise out["error"]
        return steady([t for _, _, t in events.chunks], 12), events.seconds, out["result"][0]

    warm = ", ".join(f"{a}*{args.hold}" for a in ACTIONS)
    offline(warm)  # compiles and captures, untimed
    decode_ms.take()
    rounds = []
    for r in range(args.repeats):
        announced.clear()
        thread, out = run_node(WorldPlay, base, events)
        while not announced:
            loop.run_until_complete(asyncio.sleep(0.01))
        url = f"ws://127.0.0.1:{port}{announced[0]['url'].replace('?token=', '/ws?token=')}"
        live = loop.run_until_complete(player(url, args))
        thread.join()
        if "error" in out:
            raise out["error"]
        live_rollout = events.seconds
        period = steady(live["chunk_done"], 12)
        live_decode = decode_ms.take()
        rounds.append({"live": {**period, "rollout_ms": 1e3 * statistics.median(live_rollout[SKIP:]),
                                "key_to_frame_ms": statistics.median(live["latency_ms"]),
                                "key_to_frame_p95_ms": percentile(live["latency_ms"], 95),
                                "key_to_frame_max_ms": max(live["latency_ms"]),
                                "posts_timed": len(live["latency_ms"]), "decode_ms": live_decode,
                                "frames": live["frames"]}})
        if r < (args.repeats if args.offline_rounds is None else args.offline_rounds):
            off, off_rollout, replayed = offline(live["log"])
            played = out["result"][0]
            rounds[-1]["offline"] = {**off, "rollout_ms": 1e3 * statistics.median(off_rollout[SKIP:]),
                                     "decode_ms": decode_ms.take()}
            # the replay against the session: equal on the CPU; TempCache's merge adds atomically on a GPU
            rounds[-1]["replay_max_abs"] = ((played - replayed).abs().max().item()
                                            if played.shape == replayed.shape else None)
        print(f"round {r}: live {rounds[-1]['live']['fps']:.1f} fps, key to frame "
              f"{rounds[-1]['live']['key_to_frame_ms']:.0f} ms", flush=True)

    def med(side, key):
        return statistics.median(r[side][key] for r in rounds if side in r)

    summary = {side: {k: med(side, k) for k in rounds[0][side]} for side in ("live", "offline")}
    summary["replay_max_abs"] = [r["replay_max_abs"] for r in rounds if "replay_max_abs" in r]
    summary["live_over_offline_period"] = statistics.median(r["live"]["period_ms"] / r["offline"]["period_ms"]
                                                            for r in rounds if "offline" in r)
    device = torch.device("cuda" if cuda else "cpu")
    result = {**header(device, argv), "shape": {"height": size["height"], "width": size["width"],
                                                 "model": "tiny" if args.smoke else "Matrix-Game 2.0 universal"},
              "settings": {"chunks": args.chunks, "hold": args.hold, "repeats": args.repeats, "actions": ACTIONS,
                           "loop": "serial" if args.serial else "pipelined",
                           "decoder": "the Wan 2.1 VAE" if args.decoder == "wan" else
                           "a TAEHV-family fast decoder (taew2_1's layout, float16 file)",
                           "cache": "TempCache at its defaults" if args.cache == "tempcache" else
                           "the model's own window of 6 latent frames"},
              "summary": summary, "rounds": rounds}
    print(f"{'':10} {'frames/s':>9} {'chunk period ms':>16} {'rollout ms':>11} {'decode ms':>10} "
          f"{'key to frame ms':>16}")
    for side in ("live", "offline"):
        s = summary[side]
        print(f"{side:10} {s['fps']:9.2f} {s['period_ms']:16.1f} {s['rollout_ms']:11.1f} {s['decode_ms']:10.1f} "
              f"{s.get('key_to_frame_ms', float('nan')):16.1f}")
    name = "play_bench" + ("_window" if args.cache == "window" else "") + ("_taehv" if args.decoder == "taehv" else "") \
        + ("_serial" if args.serial else "") + ("_smoke" if args.smoke else "")
    print("wrote", write_json(args.out, name + ".json", result))
    return result


if __name__ == "__main__":
    main()
