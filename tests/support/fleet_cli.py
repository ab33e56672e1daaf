"""The fleet as a trainer reads it in-process: ``flows.fleet``'s command and the node records it reads."""

from __future__ import annotations

import json
from pathlib import Path

from flows.fleet import main as fleet_main
from storage.catalog.nodes import nodes_url


def fleet(capsys, lab, *args: str) -> tuple[int, dict]:
    """``python -m flows.fleet ARGS --json`` as a trainer runs it: its exit code and its JSON."""
    capsys.readouterr()
    code = fleet_main([args[0], "--catalog", lab.catalog, "--model", lab.model, *args[1:], "--json"])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def record_of(lab, node: str) -> dict:
    """Node ``node``'s record as written in a file:// catalog."""
    folder = nodes_url(lab.catalog, lab.model).removeprefix("file://")
    return json.loads(Path(folder, f"{node}.json").read_text())
