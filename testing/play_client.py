"""A scripted player of FAST-AR World Play for the pack's server tests: a live graph queued through ComfyUI's
``/prompt``, its session found from the ``fastar.play`` event and played over the session's socket, and
the frames a graph saved read back."""
from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import numpy as np


def saved(base: Path, events: list, node: str) -> np.ndarray:
    """The frames the prompt's SaveImage ``node`` wrote under ``base``/output, in order."""
    from PIL import Image

    (shown,) = [e["data"]["output"] for e in events if e["type"] == "executed" and e["data"]["node"] == node]
    files = sorted(shown["images"], key=lambda f: f["filename"])
    return np.stack([np.asarray(Image.open(base / "output" / f["subfolder"] / f["filename"])) for f in files])


async def session(url: str, port: int, graph: dict, plan):
    """Queues the live ``graph``, plays it with ``plan(chunk message) -> messages to send`` (the n-th hello
    comes as chunk -n; ``{"away": s}`` closes the page for s seconds), and returns what the page got (hello, chunk messages, acks, errors, restarts, frame numbers,
    end; the statuses of requests without the token and of the page itself) and ComfyUI's events."""
    import aiohttp

    client_id, events, got = uuid.uuid4().hex, [], {"chunks": [], "acks": [], "errors": [], "frames": []}
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(f"ws://127.0.0.1:{port}/ws?clientId={client_id}") as comfy:
            async with http.post(url + "/prompt", json={"prompt": graph, "client_id": client_id}) as r:
                assert r.status == 200, await r.text()
            while True:  # the node says where its session plays, to the page that queued it
                m = json.loads((await comfy.receive(timeout=120)).data)
                events.append(m)
                if m["type"] == "fastar.play":
                    page = url + m["data"]["url"]
                    break
            name, token = page.split("/fastar/play/")[1].split("?token=")
            refused = []
            for bad in (f"/fastar/play/{name}", f"/fastar/play/{name}?token=x", f"/fastar/play/{name}/ws",
                        f"/fastar/play/{name}/ws?token={token[:-1]}", f"/fastar/play/0000/ws?token={token}"):
                async with http.get(url + bad) as r:
                    refused.append(r.status)
            got["refused"] = refused
            async with http.get(page) as r:
                got["page"] = (r.status, await r.text())
            socket = page.replace("http://", "ws://").replace("?token=", "/ws?token=")
            away = None  # seconds the page closes for before it opens again ({"away": s} from the plan)
            while "end" not in got:
                if away is not None:
                    await asyncio.sleep(away)
                    away = None
                async with http.ws_connect(socket) as ws:
                    while away is None:
                        msg = await ws.receive(timeout=120)
                        if msg.type == aiohttp.WSMsgType.BINARY:
                            got["frames"].append(int.from_bytes(msg.data[:4], "big"))
                            assert msg.data[4:7] == b"\xff\xd8\xff"  # a JPEG
                            continue
                        m = json.loads(msg.data)
                        if m["type"] == "hello":
                            got.setdefault("hellos", []).append(m)
                            got["hello"] = m
                            m = {"type": "chunk", "chunk": -len(got["hellos"])}
                        elif m["type"] in ("ack", "error", "restart"):
                            got.setdefault(m["type"] + "s", []).append(m)
                            continue
                        elif m["type"] == "end":
                            got["end"] = m
                            break
                        else:
                            got["chunks"].append(m)
                        for out in plan(m):
                            if "away" in out:
                                away = out["away"]
                            else:
                                await ws.send_str(json.dumps(out))
            while not any(e["type"] == "executing" and e["data"].get("node") is None for e in events):
                events.append(json.loads((await comfy.receive(timeout=120)).data))
    return got, events
