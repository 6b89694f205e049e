"""The page: one self-contained HTML file (inline CSS and script, nothing fetched).

The run's data (`jax_agent_rl.view.data`) is embedded as JSON in a ``<script
type="application/json">`` block with ``<``, ``>`` and ``&`` written as ``\\u003c`` etc., so no
model text can end the block; the script builds the page from it with ``textContent`` only
(never ``innerHTML``), so model text is shown as text and never parsed as markup. The one
line written into the HTML itself (`shown_steps`) is escaped.

What is shown is in the address's fragment (``#t=3&mode=ratio&stop=eos``): the selected
trajectory, the colouring and the filters, so a view can be linked to (and a test can open
one with a headless browser).
"""

from __future__ import annotations

import html
import json
from typing import Any

from jax_agent_rl.view.script import SCRIPT

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0 1.5em 2em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin: 1.2em 0 .4em; }
table { border-collapse: collapse; } td, th { padding: 2px 8px; border-bottom: 1px solid #ddd; }
th { text-align: left; background: #f4f4f4; } tr.pick { cursor: pointer; }
tr.pick:hover { background: #fff6d5; } tr.sel { background: #ffe9a8; }
#filters label { margin-right: 1em; } #filters select, #filters input { margin-left: .3em; }
.modes button { margin-right: .3em; } .modes button.on { font-weight: bold; background: #ffe9a8; }
.tokens { font: 13px/1.6 ui-monospace, monospace; white-space: pre-wrap; word-break: break-all; }
.turn { border-left: 3px solid #bbb; padding-left: .6em; margin: .4em 0; }
.turn-label { font: 11px system-ui; color: #777; }
.tok { border-radius: 2px; }
.tok.s { background: #c6f0c2; border-bottom: 2px solid #2e8b3a; }
.tok.t { background: #d6e6ff; font-style: italic; }
.tok.p { background: #eeeeee; color: #666; }
.prompt { color: #777; }
.block { border: 1px solid #ccc; border-radius: 4px; margin: .4em 0; padding: .3em .6em; }
.block.tool { background: #eef4ff; } .block.assistant { background: #f0fbef; }
.block .role { font-weight: bold; font: 12px system-ui; color: #555; }
.block pre { margin: .2em 0; white-space: pre-wrap; word-break: break-all; }
#group { display: grid; grid-auto-flow: column; grid-auto-columns: minmax(18em, 1fr); gap: .8em;
  overflow-x: auto; }
#group .col { border: 1px solid #ccc; padding: .4em; font-size: 12px; }
#group .col.sel { border-color: #c90; }
.tree ul { margin: 0; padding-left: 1.3em; } .tree li { list-style: "\\2514  "; }
.legend span { margin-right: 1em; padding: 0 .3em; }
.error { color: #b00; white-space: pre-wrap; }
.scroll { max-height: 16em; overflow-y: auto; border: 1px solid #eee; }
summary { cursor: pointer; color: #777; }
"""


def embedded_json(data: dict[str, Any]) -> str:
    """``data`` as JSON that cannot end the script block it sits in."""
    text = json.dumps(data, allow_nan=False)  # ASCII only: no U+2028 or bidi characters either
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def shown_steps(steps: list[int]) -> str:
    """Which steps' traces the page holds, as a line above the trajectories."""
    if not steps:
        return "no traced steps"
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]} to {steps[-1]}"
    return f"traces of {span} ({len(steps)} traced; jarl view --steps A:B shows others)"


def render_page(data: dict[str, Any]) -> str:
    """The page of a run's `run_data`."""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src 'self';
 style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>jarl view</title>
<style>{STYLE}</style></head>
<body>
<h1 id="title"></h1>
<div id="plots"></div>
<h2>Steps</h2><table id="steps"></table>
<h2>Trajectories</h2><p style="color:#666">{html.escape(shown_steps(data["traced_steps"]))}</p>
<div id="filters"></div><div class="scroll"><table id="list"></table></div>
<h2>Trajectory</h2><div id="detail"></div>
<h2>Its group, side by side</h2><div id="group"></div>
<div id="tree" class="tree"></div>
<script type="application/json" id="data">{embedded_json(data)}</script>
<script>{SCRIPT}</script>
</body></html>
"""
