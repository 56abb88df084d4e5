"""Every code block of docs/migrating.md runs as written (with /nvme/ pointed at a temporary directory)."""

from __future__ import annotations

import contextlib
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "migrating.md")


def code_blocks(language: str = "python") -> list[str]:
    with open(DOC, encoding="utf-8") as f:
        return re.findall(rf"```{language}\n(.*?)```", f.read(), flags=re.S)


def test_the_page_has_its_thirteen_examples():
    assert len(code_blocks()) == 13


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's own call
@pytest.mark.parametrize("index", range(13))
def test_migrating_example_runs(index, tmp_path, capsys, monkeypatch):
    source = code_blocks()[index].replace("/nvme/", f"{tmp_path}/")
    if index == 7:  # accelerate's DeepSpeed config: the page's YAML file, in the working directory
        (tmp_path / "zero3_nvme.yaml").write_text(code_blocks("yaml")[0].replace("/nvme/", f"{tmp_path}/"))
        monkeypatch.chdir(tmp_path)
    # engine.initialize's block loads before its first save, as DeepSpeed scripts do: (None, None) and a warning
    nothing_saved = pytest.warns(UserWarning, match="no checkpoint to load") if index == 1 else contextlib.nullcontext()
    with nothing_saved:
        exec(compile(source, f"docs/migrating.md block {index}", "exec"), {"__name__": f"migrating_{index}"})
    out = capsys.readouterr().out
    if index == 1:  # engine.initialize: 64 examples, micro-batches of 4, accumulation 2
        assert re.search(r"^8 steps, 64 samples, lr \[\d", out), out
        assert (tmp_path / "initialize-ckpt" / "latest").read_text() == "global_step8"
        assert os.path.isfile(tmp_path / "initialize-ckpt" / "global_step8" / "metadata.json")
    if index == 2:
        assert re.search(r"loss \d+\.\d+, scale \d+, skipped \d+", out), out
    if index == 4:  # the Trainer from a DeepSpeed config: WarmupDecayLR's warmup to the arguments' lr
        lrs = [float(x) for x in re.search(r"^lr \[(.*)\], store True$", out, flags=re.M).group(1).split(", ")]
        assert len(lrs) == 4 and lrs[0] < max(lrs) == 1e-3, out
    if index == 5:
        assert len(re.findall(r"loss \d+\.\d+", out)) == 4, out  # accelerate's loop: 4 micro-batches
    if index == 6:  # accelerate's loop with the engine's loss scaling: the first steps overflow
        assert re.search(r"loss \d+\.\d+, scale \d+, skipped [1-9]\d*, lr ", out), out
    if index == 7:  # from accelerate's DeepSpeed config: accumulation 2, the store under its nvme path
        store = re.escape(f"{tmp_path}/accelerate-ds/tiered")
        assert re.search(rf"^loss \d+\.\d+, accumulation 2, store in {store}$", out, flags=re.M), out
    if index == 8:
        assert "released by the tiered engine" in out and "eng.gathered" in out
    if index == 9:  # DeepSpeed's safe_get_full_*: a gradient for each of the 4 parameters, then the state
        assert len(re.findall(r"^\d\.(weight|bias) \d+\.\d+", out, flags=re.M)) == 4, out
        assert "torch.Size([8, 8])" in out, out
    if index == 10:
        assert re.search(r"tensor\(\[\[ *1, +2, +3,", out), out  # the prompt, then what was generated
    if index == 11:  # engine.from_pretrained
        assert re.search(r"tensor\(\[\[ *1, +2, +3,", out), out
    if index == 12:  # LoRA over a meta base: the adapter of 2 blocks, lora_A and lora_B each
        assert re.search(r"loss \d+\.\d+, adapter tensors 4", out), out
    if index == 0:
        assert os.path.isfile(tmp_path / "model.pt") and os.path.isfile(tmp_path / "ckpt" / "step4" / "metadata.json")


def test_the_device_lines_run_on_this_machine():
    """The table's replacements for DeepSpeed's get_accelerator() device calls run as written with or
    without a GPU, and name the device type a DeepSpeed script would get (DeepSpeed's CPU
    accelerator says "cpu")."""
    with open(DOC, encoding="utf-8") as f:
        row = next(line for line in f if line.startswith("| `deepspeed.comm`"))
    spans = re.findall(r"`([^`]*)`", row)
    set_device = next(s for s in spans if "set_device_index" in s)
    device_type = next(s for s in spans if "current_accelerator" in s)
    names = {"torch": torch, "local_rank": 0}
    exec(compile(set_device, "docs/migrating.md device line", "exec"), names)
    expected = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"
    assert eval(device_type, names) == expected
    if torch.accelerator.is_available():
        assert torch.accelerator.current_device_index() == 0
