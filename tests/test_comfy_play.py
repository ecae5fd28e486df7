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

from comfyui_fastar.testing import comfy_harness

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


def _saved(server, events) -> np.ndarray:
    from PIL import Image

    (shown,) = [e["data"]["output"] for e in events if e["type"] == "executed" and e["data"]["node"] == "3"]
    files = sorted(shown["images"], key=lambda f: f["filename"])
    return np.stack([np.asarray(Image.open(server["base"] / "output" / f["subfolder"] / f["filename"]))
                     for f in files])


async def _session(server, plan):
    """Queues a live graph, plays it with ``plan(chunk message) -> messages to send``, and returns what the
    page got (hello, chunk messages, acks, errors, frame numbers, end) and ComfyUI's events."""
    import aiohttp

    client_id, events, got = uuid.uuid4().hex, [], {"chunks": [], "acks": [], "errors": [], "frames": []}
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(f"ws://127.0.0.1:{server['port']}/ws?clientId={client_id}") as comfy:
            async with http.post(server["url"] + "/prompt", json={"prompt": _graph(f"play_{client_id[:8]}"),
                                                                  "client_id": client_id}) as r:
                assert r.status == 200, await r.text()
            while True:  # the node says where its session plays, to the page that queued it
                m = json.loads((await comfy.receive(timeout=120)).data)
                events.append(m)
                if m["type"] == "fastar.play":
                    url = server["url"] + m["data"]["url"]
                    break
            session, token = url.split("/fastar/play/")[1].split("?token=")
            refused = []
            for bad in (f"/fastar/play/{session}", f"/fastar/play/{session}?token=x", f"/fastar/play/{session}/ws",
                        f"/fastar/play/{session}/ws?token={token[:-1]}", f"/fastar/play/0000/ws?token={token}"):
                async with http.get(server["url"] + bad) as r:
                    refused.append(r.status)
            got["refused"] = refused
            async with http.get(url) as r:
                got["page"] = (r.status, await r.text())
            async with http.ws_connect(url.replace("http://", "ws://").replace("?token=", "/ws?token=")) as ws:
                while True:
                    msg = await ws.receive(timeout=120)
                    if msg.type == aiohttp.WSMsgType.BINARY:
                        got["frames"].append(int.from_bytes(msg.data[:4], "big"))
                        assert msg.data[4:7] == b"\xff\xd8\xff"  # a JPEG
                        continue
                    m = json.loads(msg.data)
                    if m["type"] == "hello":
                        got["hello"] = m
                        m = {"type": "chunk", "chunk": -1}
                    elif m["type"] in ("ack", "error", "restart"):
                        got.setdefault(m["type"] + "s", []).append(m)
                        continue
                    elif m["type"] == "end":
                        got["end"] = m
                        break
                    else:
                        got["chunks"].append(m)
                    for out in plan(m):
                        await ws.send_str(json.dumps(out))
            while not any(e["type"] == "executing" and e["data"].get("node") is None for e in events):
                events.append(json.loads((await comfy.receive(timeout=120)).data))
    return got, events


def test_a_session_plays_the_actions_as_they_come_and_its_log_replays_it(server):
    def plan(m):  # press D, then a mouse look with W, a key this world lacks, idle, then stop
        return {-1: [{"action": "D", "id": 1}], 1: [{"action": "W+look(0.05,-0.03)", "id": 2}],
                2: [{"action": "jump", "id": 3}], 3: [{"action": "idle", "id": 4}],
                5: [{"stop": True}]}.get(m["chunk"], [])

    got, events = asyncio.run(_session(server, plan))
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
    # the frames in order, after the 12 the world was shown first, a chunk's 12 each
    assert got["frames"] == list(range(12, 12 + 12 * len(chunks)))
    assert all(c["frames"] == [12 + 12 * i, 12] for i, c in enumerate(chunks))
    assert chunks[-1]["cache"]["tokens"] > 0 and chunks[-1]["cache"]["dense_tokens"] > 0
    live = _saved(server, events)
    assert live.shape == (12 + 12 * len(chunks), 64, 64, 3)
    log = got["end"]["log"]
    (play,) = [e["data"]["output"] for e in events if e["type"] == "executed" and e["data"]["node"] == "2"]
    assert play["text"] == [log]
    assert log.startswith("idle*") and re.search(r"(^|, )D\*\d+f", log) and "W+look(" in log
    # the log, as an Action Schedule, replays the session with no page: the same frames
    _, replay_events = asyncio.run(comfy_harness.run_prompt(server["url"], server["port"],
                                                            _graph(f"replay_{uuid.uuid4().hex[:8]}", log), timeout=300))
    assert not [e for e in replay_events if e["type"] == "execution_error"]
    assert np.array_equal(_saved(server, replay_events), live)


def test_restart_plays_the_world_from_its_start(server):
    seen = []

    def plan(m):
        seen.append(m["chunk"])
        if m["chunk"] == -1:
            return [{"action": "A"}]
        if len(seen) == 3:  # chunk 1 shown: from the start again
            return [{"restart": True}]
        return [{"stop": True}] if seen.count(0) == 2 and m["chunk"] == 1 else []

    got, events = asyncio.run(_session(server, plan))
    chunks = [c["chunk"] for c in got["chunks"]]
    restart = chunks.index(0, 1)
    assert len(got["restarts"]) == 1
    assert restart in (2, 3) and chunks == list(range(restart)) + list(range(len(chunks) - restart)), chunks
    assert got["end"]["reason"] == "stopped"
    played = len(chunks) - restart
    assert _saved(server, events).shape == (12 + played * 12, 64, 64, 3)  # the restarted run's frames
    # its log: A, held across the restart, from the restarted run's first chunk
    assert got["end"]["log"] == f"idle*12f, A*{12 * played}f"
