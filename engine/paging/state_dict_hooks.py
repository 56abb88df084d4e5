"""StateDictHooks: ``model.state_dict()`` and ``model.load_state_dict()`` keep working on a wrapped model.

A released parameter has no storage, so the plain ``state_dict()`` would hand out empty tensors
(and ``torch.save`` would write a checkpoint that cannot load). The post-hook replaces each managed
parameter's entry with a copy read from the store (``keep_vars=True`` entries, the Parameter
objects themselves, are left alone). ``load_state_dict`` materializes each module's parameters
before the module loads and writes them back to the store right after, one module at a time.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from torch import nn

from engine.paging.handle import HandleState, ParamHandle
from engine.paging.pager import Pager
from engine.paging.shard_io import ShardIO


class StateDictHooks:
    """state_dict post-hooks and load_state_dict pre/post hooks on every module with parameters."""

    def __init__(
        self,
        by_module: dict[nn.Module, list[ParamHandle]],
        pager: Pager,
        shard_io: ShardIO,
        after_write: Optional[Callable[[list[ParamHandle]], None]] = None,
        before: Optional[Callable[[str], None]] = None,
    ) -> None:
        """``after_write(handles)``: parameters were loaded; ``before(intent)``: the store is about to be
        read ("read") or written ("write") from outside a step (engine.AdamW brings it to one step's state)."""
        self._pager = pager
        self._io = shard_io
        self._after_write = after_write  # engine.AdamW's master weights follow loaded values
        self._before = before
        self._direct: dict[nn.Module, list[tuple[str, ParamHandle]]] = {}
        self._loading: dict[nn.Module, list[ParamHandle]] = {}
        self._removers = []
        by_id = {id(h.param): h for handles in by_module.values() for h in handles}
        for module in by_module:
            direct = [(n, by_id[id(p)]) for n, p in module._parameters.items() if p is not None and id(p) in by_id]
            if not direct:
                continue
            self._direct[module] = direct
            # torch marks hooks with an attribute, which bound methods cannot take: hand it partials.
            self._removers += [
                module.register_state_dict_pre_hook(functools.partial(self._before_state_dict)),
                module.register_state_dict_post_hook(functools.partial(self._after_state_dict)),
                module.register_load_state_dict_pre_hook(functools.partial(self._before_load)),
                module.register_load_state_dict_post_hook(functools.partial(self._after_load)),
            ]

    def remove(self) -> None:
        """Unregister every hook."""
        for remover in self._removers:
            remover.remove()
        self._removers = []

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self._before is not None:
            self._before("read")
        # torch's own code takes param.detach() of every parameter; a released one answers that only
        # with its own class (a 0-byte alias, replaced below before anyone reads it).
        with self._pager.lock:
            for _, handle in self._direct[module]:
                handle.unmark_released()

    def _after_state_dict(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        with self._pager.lock:
            for _, handle in self._direct[module]:
                if handle.state is HandleState.RELEASED:
                    handle.mark_released()
        for name, handle in self._direct[module]:
            key = prefix + name
            if key in state_dict and state_dict[key] is not handle.param:
                state_dict[key] = self._io.read_copy(handle)

    def _before_load(self, module: nn.Module, state_dict: Any, prefix: str, local_metadata: dict, *args: Any) -> None:
        if local_metadata.get("assign_to_params_buffers"):
            raise ValueError(
                "load_state_dict(assign=True) would replace parameters the engine manages; load with assign=False, "
                "or pass the state dict to engine.wrap(state_dict=...)"
            )
        if self._before is not None:
            self._before("write")
        handles = [h for _, h in self._direct[module]]
        self._pager.materialize(handles)
        self._loading[module] = handles

    def _after_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        handles = self._loading.pop(module, [])
        try:
            self._pager.write_back(handles)
            if self._after_write is not None:
                self._after_write(handles)
        finally:
            for handle in handles:
                self._pager.release(handle)
