"""FAST-AR World Play through a real ComfyUI server (``COMFYUI_PATH``): a session opened by /prompt, played
over its socket (actions in, frames out), stopped, and its action log replayed offline to the same frames;
requests without the session's token refused. The pack's world on the CPU: no model file."""
import asyncio
import json
import os
import re
import uuid
from pathlib import Path

import numpy as np
import pytest

from comfyui_fastar.testing import comfy_frontend, comfy_harness, play_client

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.comfyui
COMFYUI_PATH = os.environ.get("COMFYUI_PATH")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not COMFYUI_PATH:
        pytest.skip("COMFYUI_PATH names no ComfyUI tree")
    base = tmp_path_factory.mktemp("comfy_play")
    with comfy_harness.comfy_server(base, REPO) as url_port:
        yield {**url_port, "base": base}


def _graph(prefix: str, actions: str | None = None, max_seconds: float = 60.0) -> dict:
    graph = {
        "1": {"class_type": "FastARWorldModel", "inputs": {"world": "world.safetensors (the pack's)"}},
        "2": {"class_type": "FastARWorldPlay", "inputs": {"world": ["1", 0], "seed": 3, "max_seconds": max_seconds,
                                                          "observe": 12}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": prefix}},
    }
    if actions is not None:
        graph["4"] = {"class_type": "FastARActionSchedule", "inputs": {"actions": actions}}
        graph["2"]["inputs"]["actions"] = ["4", 0]
    return graph


def saved(server, events, node: str = "3") -> np.ndarray:
    return play_client.saved(server["base"], events, node)


async def session(server, plan, graph=None):
    """The pack's world's live graph (or ``graph``) played by ``plan``: ``play_client.session``."""
    return await play_client.session(server["url"], server["port"], graph or _graph(f"play_{uuid.uuid4().hex[:8]}"),
                                     plan)


def test_a_session_plays_the_actions_as_they_come_and_its_log_replays_it(server):
    def plan(m):  # press D, then a mouse look with W, a key this world lacks, idle, then stop
        return {-1: [{"action": "D", "id": 1}], 1: [{"action": "W+look(0.05,-0.03)", "id": 2}],
                2: [{"action": "jump", "id": 3}], 3: [{"action": "idle", "id": 4}],
                5: [{"stop": True}]}.get(m["chunk"], [])

    got, events = asyncio.run(session(server, plan))
    assert got["refused"] == [403] * 5
    assert got["page"][0] == 200 and "FAST-AR World Play" in got["page"][1]
    assert got["hello"]["world"] == "the pack's world" and ["W", "W"] in got["hello"]["keys"]
    assert got["end"]["reason"] == "stopped"
    chunks = got["chunks"]
    # stopped after the chunk it arrived during (or, arriving between chunks, the one before)
    assert [c["chunk"] for c in chunks] == list(range(len(chunks))) and len(chunks) in (6, 7)
    # every chunk took the latest action that had arrived when it started (the server's clock, one per post)
    acks = got["acks"]
    assert [a["seq"] for a in acks] == [1, 2, 3] and [a["id"] for a in acks] == [1, 2, 4]
    for c in chunks:
        assert c["seq"] == max([a["seq"] for a in acks if a["received"] < c["taken"]], default=0), (c, acks)
    assert any(c["seq"] == 1 for c in chunks) and any(c["seq"] == 2 for c in chunks)
    (error,) = got["errors"]
    assert error["message"].startswith("FAST-AR World Play: unknown action 'jump'")
    # the frames in order: the 12 the world was shown first (sent with hello, before any chunk), a chunk's 12 each
    assert got["hello"]["first"] == 12 and got["frames"] == list(range(12 + 12 * len(chunks)))
    assert all(c["frames"] == [12 + 12 * i, 12] for i, c in enumerate(chunks))
    assert chunks[-1]["cache"]["tokens"] > 0 and chunks[-1]["cache"]["dense_tokens"] > 0
    live = saved(server, events)
    assert live.shape == (12 + 12 * len(chunks), 64, 64, 3)
    log = got["end"]["log"]
    (play,) = [e["data"]["output"] for e in events if e["type"] == "executed" and e["data"]["node"] == "2"]
    assert play["text"] == [log]
    assert log.startswith("idle*") and re.search(r"(^|, )D\*\d+f", log) and "W+look(" in log
    # the log, as an Action Schedule, replays the session with no page: the same frames
    _, replay_events = asyncio.run(comfy_harness.run_prompt(server["url"], server["port"],
                                                            _graph(f"replay_{uuid.uuid4().hex[:8]}", log), timeout=300))
    assert not [e for e in replay_events if e["type"] == "execution_error"]
    assert np.array_equal(saved(server, replay_events), live)


def test_a_closed_page_pauses_the_session_until_it_opens_again(server):
    """The page closes for 3 s after chunk 1: the session plays at most the chunk already under way (its
    frames unseen), waits, and goes on where it was once the page is back (its frames and log whole)."""
    def plan(m):
        if m["chunk"] == 1:
            return [{"away": 3.0}]
        return [{"stop": True}] if m["chunk"] >= 3 else []

    got, events = asyncio.run(session(server, plan))
    assert len(got["hellos"]) == 2 and got["end"]["reason"] == "stopped"
    chunks = {c["chunk"]: c for c in got["chunks"]}
    last = max(chunks)
    assert len(set(range(last + 1)) - set(chunks)) <= 1, sorted(chunks)  # played while no page was open
    taken = sorted(c["taken"] for c in chunks.values())
    assert max(b - a for a, b in zip(taken, taken[1:])) >= 2.5  # it waited for the page
    assert saved(server, events).shape[0] == 12 + 12 * (last + 1)
    assert got["end"]["log"] == f"idle*{12 + 12 * (last + 1)}f"


def test_restart_plays_the_world_from_its_start(server):
    seen = []

    def plan(m):
        seen.append(m["chunk"])
        if m["chunk"] == -1:
            return [{"action": "A"}]
        if len(seen) == 3:  # chunk 1 shown: from the start again
            return [{"restart": True}]
        return [{"stop": True}] if seen.count(0) == 2 and m["chunk"] == 1 else []

    got, events = asyncio.run(session(server, plan))
    chunks = [c["chunk"] for c in got["chunks"]]
    restart = chunks.index(0, 1)
    assert len(got["restarts"]) == 1
    assert restart in (2, 3) and chunks == list(range(restart)) + list(range(len(chunks) - restart)), chunks
    assert got["end"]["reason"] == "stopped"
    played = len(chunks) - restart
    assert saved(server, events).shape == (12 + played * 12, 64, 64, 3)  # the restarted run's frames
    # its log: A, held across the restart, from the restarted run's first chunk
    assert got["end"]["log"] == f"idle*12f, A*{12 * played}f"


PLAY_WORKFLOW = REPO / "example_workflows" / "FAST-AR - play the world live (no download).json"


def test_the_play_template_is_the_live_graph_at_its_defaults(server):
    """The template as ComfyUI reads it: the pack's world, TempCache at its defaults, a live session (nothing
    on actions) of at most a minute, its frames saved."""
    from comfyui_fastar.fastar import TempCacheConfig

    info = comfy_harness.get_json(server["url"] + "/object_info")
    prompt = comfy_harness.api_prompt(json.loads(PLAY_WORKFLOW.read_text()), info)
    by_type = {n["class_type"]: n["inputs"] for n in prompt.values()}
    play = by_type["FastARWorldPlay"]
    assert {k: v for k, v in play.items() if not isinstance(v, list)} == {
        "seed": 0, "max_seconds": 60.0, "observe": 12, "width": 640, "height": 352, "page_wait": 300.0}
    assert set(k for k, v in play.items() if isinstance(v, list)) == {"world", "cache"}
    t = TempCacheConfig()
    assert by_type["FastARTempCacheSettings"] == {"enabled": t.enabled, "merge_threshold": t.merge_threshold,
                                                  "max_cache_frames": t.max_cache_frames, "sink_frames": t.sink_frames}
    assert "SaveAnimatedWEBP" in by_type


def _webp_frames(path, fps: float = 16.0) -> list[np.ndarray]:
    """An animated WEBP's frames at ``fps`` (its encoder keeps one frame, held longer, for a run of equal ones)."""
    from PIL import Image, ImageSequence

    frames = []
    with Image.open(path) as im:
        for f in ImageSequence.Iterator(im):
            frames += [np.asarray(f.convert("RGB"), float)] * round(f.info["duration"] * fps / 1000)
    return frames


def _shift(a: np.ndarray, b: np.ndarray, r: int = 20) -> int:
    """How far right the camera moved from frame a to frame b, in pixels: b(x) ~ a(x + dx)."""
    w = a.shape[1]
    errs = {dx: np.abs(b[:, :w - dx] - a[:, dx:]).mean() if dx >= 0 else np.abs(b[:, -dx:] - a[:, :w + dx]).mean()
            for dx in range(-r, r + 1)}
    return min(errs, key=errs.get)


@pytest.mark.skipif(comfy_frontend.chromium() is None, reason="no Chromium here")
def test_the_play_template_plays_in_the_frontend(server):
    """The live template as a user plays it: queued from the frontend, the node's button opens the play page,
    a key held moves the world (the trained world pans over its photograph), the legend and the numbers are
    shown, and stop ends the session with the frames saved on the graph."""
    sync_api = pytest.importorskip("playwright.sync_api")
    snap = ("() => [window.__fastar.shown, Array.from(document.getElementById('screen').getContext('2d')"
            ".getImageData(0, 0, 64, 64).data)]")  # the frame's number and its pixels
    with sync_api.sync_playwright() as p:
        browser, page = comfy_frontend.frontend(p, server["url"], sync_api, COMFYUI_PATH)
        try:
            page.evaluate("(wf) => window.app.loadGraphData(wf)", json.loads(PLAY_WORKFLOW.read_text()))
            page.wait_for_timeout(800)
            page.evaluate(comfy_frontend.CLOSE_DIALOGS)
            label = page.evaluate("() => window.app.graph._nodes.find((n) => n.type === 'FastARWorldPlay')"
                                  ".fastarPlayButton.label")
            page.evaluate("() => window.app.queuePrompt(0)")
            page.wait_for_function("() => !!window.app.graph._nodes.find((n) => n.type === 'FastARWorldPlay')"
                                   ".fastarPlayUrl", timeout=120000)
            with page.expect_popup() as popup:
                page.evaluate("() => window.app.graph._nodes.find((n) => n.type === 'FastARWorldPlay')"
                              ".fastarPlayButton.callback()")
            play = popup.value
            play.wait_for_function("() => window.__fastar && window.__fastar.drawn >= 36", timeout=120000)
            idle = play.evaluate(snap)
            play.keyboard.down("d")
            play.wait_for_function("""() => { const s = window.__fastar, c = s.chunks.find((c) => c.seq >= 1);
                                              return c && s.drawn >= c.frames[0] + c.frames[1] - 12 + 12; }""",
                                   timeout=60000)
            moved = play.evaluate(snap)
            play.keyboard.up("d")
            play.wait_for_function("() => window.__fastar.latencies.length > 0", timeout=60000)
            shown = play.evaluate("""() => Object.fromEntries([...document.querySelectorAll('[data-field]')]
                                     .map((e) => [e.dataset.field, e.textContent]))""")
            legend = play.text_content("#legend")
            play.set_viewport_size({"width": 860, "height": 430})
            comfy_frontend.screenshot(play, "world_play.png")
            play.click("#stop")
            play.wait_for_function("() => window.__fastar.end !== null", timeout=60000)
            end = play.evaluate("() => window.__fastar.end")
            page.wait_for_function("""() => { const n = window.app.graph._nodes.find((n) => n.type === 'SaveAnimatedWEBP');
                                              return n && n.imgs && n.imgs.length > 0; }""", timeout=120000)
        finally:
            browser.close()
    assert label == "open the play page (queue first)"
    assert end["reason"] == "stopped" and "D*" in end["log"]
    # what the page showed moved; the frames played (saved by the graph) pan right while D was held, and
    # stand still while nothing was: a latent frame's worth (4 video frames) at a time
    (before, before_pixels), (after, after_pixels) = idle, moved
    assert after > before and before_pixels != after_pixels
    from comfyui_fastar.fastar.actions import ActionSpec, parse_actions

    rows = parse_actions(end["log"], ActionSpec(), 12)
    frames = _webp_frames(max((server["base"] / "output" / "fastar").glob("world_play*.webp"), key=os.path.getmtime))
    assert len(frames) == len(rows)
    pans = {}
    for held in ("D", "idle"):
        row = parse_actions(held, ActionSpec(), 1)[0]
        pans[held] = [_shift(frames[i], frames[i + 4]) for i in range(12, len(rows) - 4, 4)
                      if (rows[i:i + 5] == row).all()]
    assert pans["D"] and np.mean(pans["D"]) >= 6 and pans["idle"] and abs(np.mean(pans["idle"])) <= 2, pans
    for key in ("W", "A", "S", "D", "zoom_in", "zoom_out", "mouse"):
        assert key in legend, legend
    assert float(shown["fps"]) > 0 and shown["latency"].endswith(" ms") and "tokens" in shown["cache"], shown
    assert shown["dense"].endswith("tokens") and shown["action"] == "idle", shown


@pytest.mark.slow
@pytest.mark.parametrize("decoder", ["wan", pytest.param("taehv", marks=pytest.mark.taehv)])
def test_the_play_benchmark_times_a_live_session_and_its_replay(comfy, tmp_path, decoder):
    """bench/play_bench.py --smoke: a live session (the pack's routes, a player on its socket) and its log
    played offline, each timed, decoded by the Wan VAE or a fast decoder; the file names the device, the
    shapes and the decoder."""
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    import play_bench

    result = play_bench.main(["--comfyui", COMFYUI_PATH, "--smoke", "--chunks", "5", "--hold", "1", "--repeats", "1",
                              "--decoder", decoder, "--out", str(tmp_path)])
    name = "play_bench_taehv_smoke.json" if decoder == "taehv" else "play_bench_smoke.json"
    assert json.loads((tmp_path / name).read_text())["summary"] == result["summary"]
    assert result["settings"]["decoder"].startswith("the Wan 2.1 VAE" if decoder == "wan" else "a TAEHV")
    live, offline = result["summary"]["live"], result["summary"]["offline"]
    assert live["frames"] == 9 + 12 * 4 and live["posts_timed"] >= 2
    assert 0 < live["key_to_frame_ms"] <= live["key_to_frame_max_ms"]
    assert live["fps"] > 0 and offline["fps"] > 0 and live["rollout_ms"] > 0 and offline["rollout_ms"] > 0
    # pipelined, a chunk's decode overlaps the next chunk's sampling: it is timed, not bounded by the period
    assert live["decode_ms"] > 0 and offline["decode_ms"] > 0 and result["settings"]["loop"] == "pipelined"
    assert result["shape"] == {"height": 48, "width": 64, "model": "tiny"}
    assert result["summary"]["replay_max_abs"] == [0.0]  # the CPU replays its session bit for bit
