"""StoreConfig validation: a ValueError naming the field and the value."""

from __future__ import annotations

import dataclasses

import pytest

import tiered


@pytest.mark.parametrize(
    "field, value",
    [
        ("host_bytes", -1),
        ("device_bytes", 1.5),
        ("nvme_bytes", -4096),
        ("block_size", 1000),
        ("block_size", 4096 + 512),
        ("queue_depth", 0),
        ("io_threads", 0),
        ("coalesce_bytes", -1),
        ("swap_files_per_dir", 0),
        ("swap_grow_bytes", 5000),
        ("direct_io", "yes"),
        ("nvme_paths", []),
        ("nvme_paths", "/not/a/list"),
        ("path", ""),
    ],
)
def test_invalid_values_name_field_and_value(tmp_path, field, value):
    kwargs = {"path": str(tmp_path)}
    kwargs[field] = value
    with pytest.raises(ValueError) as info:
        tiered.StoreConfig(**kwargs)
    assert field in str(info.value) and repr(value).strip("'") in str(info.value)


def test_frozen_and_normalized(tmp_path):
    cfg = tiered.StoreConfig(path=str(tmp_path / "x" / ".." / "s"))
    assert cfg.path == str(tmp_path / "s")
    assert cfg.nvme_paths == (cfg.path,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.host_bytes = 1  # type: ignore[misc]
    assert cfg.replace(host_bytes=4096).host_bytes == 4096


def test_a_new_path_takes_default_swap_files_along(tmp_path):
    cfg = tiered.StoreConfig(path=str(tmp_path / "a"))
    moved = cfg.replace(path=str(tmp_path / "b"))
    assert moved.nvme_paths == (str(tmp_path / "b"),)
    striped = tiered.StoreConfig(path=str(tmp_path / "a"), nvme_paths=[str(tmp_path / "d1"), str(tmp_path / "d2")])
    assert striped.replace(path=str(tmp_path / "b")).nvme_paths == striped.nvme_paths  # named: kept
    assert cfg.replace(path=str(tmp_path / "b"), nvme_paths=[str(tmp_path / "d")]).nvme_paths == (
        str(tmp_path / "d"),)


def test_tier_parse():
    assert tiered.Tier.parse("host") is tiered.Tier.HOST
    assert tiered.Tier("nvme") == "nvme"
    with pytest.raises(ValueError, match="'ram'"):
        tiered.Tier.parse("ram")
