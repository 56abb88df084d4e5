"""DeepSpeed's monitors for ``engine.initialize``'s engine: ``model_engine.monitor``.

A DeepSpeed config's ``tensorboard``, ``csv_monitor``, ``wandb`` and ``comet`` sections name where
events go; an event is DeepSpeed's ``(name, value, step)`` tuple. The engine writes DeepSpeed's own
(``Train/Samples/lr``, ``Train/Samples/loss_scale`` with fp16, and the ``elapsed_time_ms_*`` timings
with ``wall_clock_breakdown``) at every optimizer step, the step being ``global_samples``, and
scripts write theirs with ``model_engine.monitor.write_events([...])``, as with DeepSpeed. Only
rank 0 writes; on other ranks :meth:`DeepSpeedMonitor.write_events` does nothing.
"""

from __future__ import annotations

import abc
import csv
import importlib
import importlib.util
import numbers
import os
from typing import Any, Mapping, Optional, Sequence

import torch

#: DeepSpeed's event: (name, value, step).
Event = tuple[str, Any, int]

#: Each monitor's config section, and the package it needs.
PACKAGES = {"tensorboard": "tensorboard", "csv_monitor": None, "wandb": "wandb", "comet": "comet_ml"}
#: DeepSpeed's defaults for a section's keys the config leaves out.
DEFAULT_JOB_NAME = "DeepSpeedJobName"
DEFAULT_WANDB_PROJECT = "deepspeed"
DEFAULT_COMET_SAMPLES_INTERVAL = 100


class MonitorBackend(abc.ABC):
    """One place events go (TensorBoard, CSV files, W&B, Comet)."""

    @abc.abstractmethod
    def write_events(self, events: Sequence[Event]) -> None:
        """Record each ``(name, value, step)``."""

    def close(self) -> None:
        """Flush and release what the backend holds open (nothing by default)."""


class CsvMonitor(MonitorBackend):
    """DeepSpeed's ``csv_monitor``: one file per event name in ``log_dir``
    (``Train/Samples/lr`` -> ``Train_Samples_lr.csv``), rows ``step,<last part of the name>``."""

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir

    def write_events(self, events: Sequence[Event]) -> None:
        """Record each ``(name, value, step)`` of ``events``."""
        for name, value, step in events:
            path = os.path.join(self.log_dir, name.replace("/", "_").replace(" ", "_") + ".csv")
            with open(path, "a", newline="", encoding="utf-8") as f:
                writer = csv.writer(f)
                if f.tell() == 0:  # a resumed run appends to its files without a second header
                    writer.writerow(["step", name.rsplit("/", 1)[-1]])
                writer.writerow([step, value])


class TensorBoardMonitor(MonitorBackend):
    """DeepSpeed's ``tensorboard``: scalars in an event file in ``log_dir``, flushed after every write."""

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(log_dir, exist_ok=True)
        self._writer = SummaryWriter(log_dir=log_dir)

    def write_events(self, events: Sequence[Event]) -> None:
        """Record each ``(name, value, step)`` of ``events``."""
        for name, value, step in events:
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()


class WandbMonitor(MonitorBackend):
    """DeepSpeed's ``wandb``: ``wandb.log({name: value}, step=step)`` into the script's run, or one
    started with the section's ``project``, ``group`` and ``team`` (W&B's entity) when there is none."""

    def __init__(self, project: str, group: Optional[str], team: Optional[str]) -> None:
        wandb = importlib.import_module("wandb")
        self._run = wandb.run if wandb.run is not None else wandb.init(project=project, group=group, entity=team)

    def write_events(self, events: Sequence[Event]) -> None:
        """Record each ``(name, value, step)`` of ``events``."""
        for name, value, step in events:
            self._run.log({name: value}, step=step)


class CometMonitor(MonitorBackend):
    """DeepSpeed's ``comet``: ``experiment.log_metric(name, value, step=step)``, each name at most
    once per ``samples_log_interval`` steps (samples), as DeepSpeed thins them."""

    def __init__(self, section: Mapping[str, Any]) -> None:
        comet_ml = importlib.import_module("comet_ml")
        self._experiment = comet_ml.start(**{k: section.get(k) for k in (
            "api_key", "project", "workspace", "experiment_key", "mode", "online")})
        if section.get("experiment_name") is not None:
            self._experiment.set_name(section["experiment_name"])
        self._interval = section.get("samples_log_interval", DEFAULT_COMET_SAMPLES_INTERVAL)
        self._last_logged: dict[str, int] = {}

    def write_events(self, events: Sequence[Event]) -> None:
        """Record each ``(name, value, step)`` of ``events``."""
        for name, value, step in events:
            last = self._last_logged.get(name)
            if last is not None and step - last < self._interval:
                continue
            self._last_logged[name] = step
            self._experiment.log_metric(name, value, step=step)


class DeepSpeedMonitor:
    """``model_engine.monitor``: DeepSpeed's ``MonitorMaster``. :attr:`enabled` when the config turns
    on any monitor (on every rank, as DeepSpeed's); events written on rank 0 go to each of them."""

    def __init__(self, backends: Sequence[MonitorBackend] = (), *, enabled: bool = False) -> None:
        self._backends = list(backends)
        self._enabled = enabled

    @classmethod
    def from_config(cls, ds: Mapping[str, Any], *, rank: int) -> "DeepSpeedMonitor":
        """The monitors a DeepSpeed config dict turns on; rank 0 opens them (creating
        ``output_path/job_name``; W&B and Comet start a run). ImportError, on every rank, when
        one needs a package that is not installed."""
        sections = enabled_monitors(ds)
        for name in sections:
            package = PACKAGES[name]
            if package is not None and importlib.util.find_spec(package) is None:
                raise ImportError(f"the DeepSpeed config turns on {name!r}, which needs the {package} package: "
                                  f"pip install {package} (or set {name}.enabled to false)")
        if rank != 0 or not sections:
            return cls(enabled=bool(sections))
        backends: list[MonitorBackend] = []
        try:
            for name, section in sections.items():
                backends.append(_open_backend(name, section))
        except BaseException:
            for backend in backends:
                backend.close()
            raise
        return cls(backends, enabled=True)

    @property
    def enabled(self) -> bool:
        """Whether the config turns on any monitor (DeepSpeed's ``monitor.enabled``)."""
        return self._enabled

    def write_events(self, event_list: Sequence[Event]) -> None:
        """Write DeepSpeed-style events, ``[(name, value, step), ...]``, to every monitor (on rank 0;
        elsewhere nothing). A value may be a number or a one-element tensor."""
        if not self._backends:
            return
        events = [_checked_event(event) for event in event_list]
        for backend in self._backends:
            backend.write_events(events)

    def close(self) -> None:
        """Flush and close every monitor; later events are dropped."""
        backends, self._backends = self._backends, []
        for backend in backends:
            backend.close()


def enabled_monitors(ds: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The config's monitor sections with ``"enabled": true``, by name."""
    return {name: ds[name] for name in PACKAGES
            if isinstance(ds.get(name), Mapping) and ds[name].get("enabled") is True}


def _open_backend(name: str, section: Mapping[str, Any]) -> MonitorBackend:
    if name in ("tensorboard", "csv_monitor"):
        # DeepSpeed's: output_path defaults to "", so the directory is job_name, under the working directory
        log_dir = os.path.join(section.get("output_path") or "", section.get("job_name") or DEFAULT_JOB_NAME)
        return TensorBoardMonitor(log_dir) if name == "tensorboard" else CsvMonitor(log_dir)
    if name == "wandb":
        return WandbMonitor(section.get("project") or DEFAULT_WANDB_PROJECT, section.get("group"),
                            section.get("team"))
    assert name == "comet", name
    return CometMonitor(section)


def _checked_event(event: Any) -> Event:
    """``(name, value, step)`` with a tensor value as its Python number; TypeError for anything else."""
    if not isinstance(event, (tuple, list)) or len(event) != 3:
        raise TypeError(f"a monitor event is a (name, value, step) tuple, got {event!r}")
    name, value, step = event
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"monitor event {name!r}: a tensor value must hold one element, got shape "
                            f"{tuple(value.shape)}")
        value = value.item()
    if not isinstance(name, str) or not isinstance(value, numbers.Number) or isinstance(step, bool) \
            or not isinstance(step, numbers.Integral):
        raise TypeError(f"a monitor event is (name: str, value: number, step: int), got {event!r}")
    return name, value, int(step)


__all__ = ["CometMonitor", "CsvMonitor", "DeepSpeedMonitor", "Event", "MonitorBackend", "TensorBoardMonitor",
           "WandbMonitor", "enabled_monitors"]
