"""Screenshot of the keras_scale TensorBoard dashboard with headless Chromium (docs/dashboard.png).

    apt-get install -y chromium                     # once
    python examples/quickstart.py --out runs/quickstart
    python tools/dashboard_screenshot.py --logdir runs/quickstart --out docs/dashboard.png

Starts TensorBoard in this process on 127.0.0.1 (a free port) with the keras_scale plugin, waits until the run's
data is loaded, and lets Chromium render the keras_scale tab (``--whole-page``: TensorBoard's own frame around it;
default: the dashboard's page alone, as TensorBoard shows it inside its frame). Not part of ``make test``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def serve(logdir: str):
    """A TensorBoard server with the keras_scale plugin (installed or not); returns (server, url)."""
    from tensorboard import default, program

    from keras_scale.tensorboard_plugin import KerasScalePlugin

    # installed, the entry point already brings it (TensorBoard refuses a duplicate name): this worktree's one
    plugins = [p for p in default.get_plugins() if getattr(p, "plugin_name", None) != KerasScalePlugin.plugin_name]
    plugins.append(KerasScalePlugin)
    tb = program.TensorBoard(plugins=plugins)
    tb.configure(argv=[None, "--logdir", logdir, "--host", "127.0.0.1", "--port", str(_free_port()),
                       "--load_fast", "false", "--reload_interval", "2"])
    server = tb._make_server()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.get_url().rstrip("/")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--logdir", default=os.path.join(ROOT, "runs", "quickstart"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "dashboard.png"))
    p.add_argument("--width", type=int, default=1150)
    p.add_argument("--height", type=int, default=2050)
    p.add_argument("--whole-page", action="store_true", help="TensorBoard's frame too (the #keras_scale tab)")
    p.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser")
                   or shutil.which("google-chrome"))
    args = p.parse_args()
    if not args.chromium:
        print("no chromium found: apt-get install -y chromium", file=sys.stderr)
        return 2
    if not os.path.isdir(args.logdir):
        print(f"{args.logdir} does not exist: run python examples/quickstart.py --out {args.logdir} first",
              file=sys.stderr)
        return 2
    server, url = serve(args.logdir)
    try:
        runs = _get_json(url + "/data/plugin/keras_scale/runs")
        if not runs:
            print(f"no keras_scale run under {args.logdir}", file=sys.stderr)
            return 1
        deadline = time.monotonic() + 60  # TensorBoard's first load of the event files
        while time.monotonic() < deadline:
            listing = _get_json(url + "/data/plugin/scalars/tags")
            if any(tags for tags in listing.values()):
                time.sleep(3)
                break
            time.sleep(1)
        page = url + ("/#keras_scale" if args.whole_page else "/data/plugin_entry.html?name=keras_scale")
        with tempfile.TemporaryDirectory() as profile_dir:
            cmd = [args.chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile_dir}",
                   f"--window-size={args.width},{args.height}", "--virtual-time-budget=20000",
                   f"--screenshot={os.path.abspath(args.out)}", page]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        if proc.returncode != 0 or not os.path.exists(args.out):
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes) from {page}")
        return 0
    finally:
        server.shutdown()


if __name__ == "__main__":
    sys.exit(main())
