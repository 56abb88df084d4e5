"""engine.extensions: the weight layouts an engine is given apply on load and on export, in order,
and only those; the core itself knows no library."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import engine
from engine.extensions import DEFAULT_EXTENSIONS, Extensions, TransformersLayout
from engine.io.weight_source import WeightSource
from engine_models import engine_config


class Prefixed:
    """A library whose checkpoints name every tensor ``<prefix><name>``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.calls: list[str] = []

    def loading(self, model, source, shapes=None):
        self.calls.append("loading")
        return source.renamed({name: self.prefix + name for name, _ in model.state_dict().items()})

    def saving(self, model, tensors):
        self.calls.append("saving")
        return [(type(spec)(self.prefix + spec.name, spec.dtype, spec.shape), read) for spec, read in tensors]


def test_a_layout_renames_on_load_and_export(tmp_path):
    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    on_disk = {"lib." + name: t.clone() for name, t in ref.state_dict().items()}
    layout = Prefixed("lib.")
    with torch.device("meta"):
        model = nn.Linear(4, 3)
    with engine.wrap(model, config=engine_config(tmp_path), state_dict=on_disk,
                     extensions=Extensions(weight_layouts=(layout,))) as eng, torch.no_grad():
        x = torch.randn(2, 4)
        assert torch.equal(model(x), ref(x))  # every tensor found under the library's names
        assert eng.extensions.weight_layouts == (layout,)
        eng.save_weights(tmp_path / "out")
    assert layout.calls == ["loading", "saving"]
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(saved) == sorted(on_disk) and all(torch.equal(saved[k], on_disk[k]) for k in saved)


def test_without_the_layout_the_librarys_names_match_nothing(tmp_path):
    on_disk = {"lib." + name: t for name, t in nn.Linear(4, 3).state_dict().items()}
    with torch.device("meta"):
        model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match="match no parameter"):
        engine.wrap(model, config=engine_config(tmp_path), state_dict=on_disk, extensions=Extensions())


class Recorded:
    """A layout for another library's models: it leaves this model as it is and says it was asked."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def loading(self, model, source, shapes=None):
        self.log.append(f"{self.name}.loading")
        return source

    def saving(self, model, tensors):
        self.log.append(f"{self.name}.saving")
        return tensors


def test_layouts_apply_in_order_and_the_default_is_the_transformers_layout():
    log: list[str] = []
    extensions = Extensions(weight_layouts=(Recorded("first", log), Recorded("second", log)))
    model = nn.Linear(2, 2)
    source = WeightSource.from_mapping(model.state_dict())
    assert extensions.loading(model, source) is source
    assert extensions.saving(model, []) == []
    assert log == ["first.loading", "second.loading", "first.saving", "second.saving"]
    assert [type(layout) for layout in DEFAULT_EXTENSIONS.weight_layouts] == [TransformersLayout]
    assert DEFAULT_EXTENSIONS.loading(model, source) is source  # not a transformers model: left as it is


def test_what_is_not_an_extension_is_refused(tmp_path):
    with pytest.raises(TypeError, match="loading\\(\\) and saving\\(\\)"):
        Extensions(weight_layouts=(object(),))
    with pytest.raises(TypeError, match="must be a tuple"):
        Extensions(weight_layouts=[Prefixed("x.")])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="extensions must be an engine.extensions.Extensions"):
        engine.wrap(nn.Linear(2, 2), config=engine_config(tmp_path), extensions=json)  # type: ignore[arg-type]
    assert not (tmp_path / "store").exists()  # refused before the store was opened
