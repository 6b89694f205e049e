"""``jarl view RUN``: the run's page written to a folder, or served on the loopback interface.

Served, the page and the run's plots are the only things answered (every other path is a
404); the server binds 127.0.0.1 on a free port (or ``--port``) and prints its address. A
request whose Host header is not that address (``127.0.0.1:PORT`` or ``localhost:PORT``) is
refused with 400: a page elsewhere whose DNS name is rebound to 127.0.0.1 cannot read the view.
Trace records whose step is not a whole number are skipped, and counted in a warning.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import shutil
import sys
from pathlib import Path
from typing import Any

from jax_agent_rl.train.traces import TRACES_FILE
from jax_agent_rl.view.data import pick_steps, run_data
from jax_agent_rl.view.page import render_page

PAGE = "index.html"


def _run_data(run_dir: Path, steps: str | None, last: int) -> dict[str, Any]:
    """`run_data`, warning on stderr of the records it skipped."""
    data = run_data(run_dir, steps, last)
    if data["skipped"]:
        print(
            f"warning: {data['skipped']} trace records skipped: their step is not a whole number",
            file=sys.stderr,
        )
    return data


def write_view(run_dir: Path, out: Path, steps: str | None = None, last: int = 50) -> Path:
    """``out/index.html`` (the traces of the steps `pick_steps` picks) and a copy of the
    run's plots beside it; returns the page's path. Raises ValueError when ``out`` cannot
    hold them."""
    data = _run_data(run_dir, steps, last)
    page = out / PAGE
    try:  # (a file there, a folder that cannot be made or written)
        out.mkdir(parents=True, exist_ok=True)
        page.write_text(render_page(data), encoding="utf-8")
        for plot in data["plots"]:
            if (run_dir / plot).resolve() != (out / plot).resolve():
                shutil.copyfile(run_dir / plot, out / plot)
    except OSError as e:
        raise ValueError(f"cannot write the page into {out}: {e.strerror or e}") from None
    return page


def view_server(
    run_dir: Path,
    port: int = 0,
    steps: str | None = None,
    last: int = 50,
    idle_timeout_s: float = 30.0,
) -> http.server.ThreadingHTTPServer:
    """A server (bound, not yet serving) of the page (built once) and the plots on 127.0.0.1;
    any other Host than its own address gets 400; a connection that sends nothing for
    ``idle_timeout_s`` is closed (each holds a thread)."""
    data = _run_data(run_dir, steps, last)
    files = {f"/{PAGE}": (render_page(data).encode(), "text/html; charset=utf-8")}
    files["/"] = files[f"/{PAGE}"]
    for plot in data["plots"]:
        files[f"/{plot}"] = ((run_dir / plot).read_bytes(), "image/png")

    hosts: set[str] = set()  # this server's own addresses, once it is bound

    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = idle_timeout_s  # on the socket: a read waiting longer ends the connection

        def do_GET(self) -> None:
            if self.headers.get("Host") not in hosts:
                self.send_error(400, "Host is not this server's loopback address")
                return
            found = files.get(self.path.split("?")[0].split("#")[0])
            if found is None:
                self.send_error(404)
                return
            body, kind = found
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            del format, args  # quiet: the address printed is all the console needs

    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    except OSError as e:  # the port taken, or one this user may not bind
        raise ValueError(f"cannot serve on 127.0.0.1:{port}: {e.strerror or e}") from None
    hosts.update(f"{name}:{server.server_address[1]}" for name in ("127.0.0.1", "localhost"))
    return server


def serve(run_dir: Path, port: int = 0, steps: str | None = None, last: int = 50) -> None:
    """Serves `view_server` until interrupted."""
    with view_server(run_dir, port, steps, last) as server:
        print(f"serving {run_dir} at http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C ends)")
        sys.stdout.flush()
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever()


def view_command(args: argparse.Namespace) -> int:
    folder = Path(args.run_dir)
    if not (folder / TRACES_FILE).is_file():
        print(f"error: no {TRACES_FILE} in {folder}", file=sys.stderr)
        return 2
    if args.last < 1:
        print(f"error: --last {args.last}: expected a whole number >= 1", file=sys.stderr)
        return 2
    try:
        pick_steps([], args.steps, args.last)  # a malformed --steps before the file is read
        if args.out:
            print(write_view(folder, Path(args.out), args.steps, args.last))
            return 0
        serve(folder, args.port, args.steps, args.last)
    except ValueError as e:  # a malformed --steps, or a traces file that is not a run's
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
