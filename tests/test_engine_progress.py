"""Progress bars of the engine's long operations, drawn on a real terminal: a child process whose
stderr is a pseudo-terminal wraps a 268 MB model, saves and loads a checkpoint and saves its
weights; each draws a bar. A small model's operations, before it, draw none."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import textwrap

import pytest

import engine
from engine_models import store_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import sys, torch, engine, tiered

    root = sys.argv[1]

    def run(name, features):
        with torch.device("meta"):
            model = torch.nn.Linear(features, features, bias=False)
        store = tiered.StoreConfig(path=f"{root}/{name}/store", host_bytes=0, prefault_host=False, durable=False)
        eng = engine.wrap(model, config=engine.EngineConfig(store=store, host_budget="host_tier"),
                          init_fn=lambda m: torch.nn.init.constant_(m.weight, 0.5))
        eng.save_checkpoint(f"{root}/{name}/ckpt")
        eng.load_checkpoint(f"{root}/{name}/ckpt")
        eng.save_weights(f"{root}/{name}/export")
        eng.close()

    run("small", 256)
    print("small done", file=sys.stderr, flush=True)
    run("large", 8192)  # 8192 x 8192 fp32: 268 MB, above engine.io.progress.MIN_BYTES
""")


def test_long_operations_draw_a_bar_on_a_terminal_and_short_ones_none(tmp_path):
    primary, secondary = pty.openpty()
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=secondary, env=env, cwd=str(tmp_path))
    os.close(secondary)
    chunks = []
    while True:
        try:
            data = os.read(primary, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(primary)
    assert proc.wait(timeout=300) == 0, b"".join(chunks).decode(errors="replace")
    text = b"".join(chunks).decode(errors="replace")
    before, after = text.split("small done", 1)
    assert "[" not in before  # nothing drawn for 256 KB
    for label in ("wrap: parameters to the store", "saving checkpoint", "loading checkpoint", "saving weights"):
        assert f"{label} [##############################] 256.0 MiB / 256.0 MiB" in after, text  # reached its total


def test_progress_must_be_a_bool(tmp_path):
    with pytest.raises(ValueError, match="progress must be True or False, got 'no'"):
        engine.EngineConfig(host_budget="host_tier", store=store_config(tmp_path), progress="no")
