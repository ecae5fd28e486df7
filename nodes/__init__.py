"""ComfyUI node classes: schemas and glue into ``fastar``; no math lives here."""

NODES: list = []
