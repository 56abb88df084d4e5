"""Forward hooks: each module holds its parameters while it runs; the outermost one opens the scope
(access mode, saved-tensor hooks) and the root module's call starts a step.

Pre-hook: acquire the module's direct parameters plus the "extras" it read last time from other
modules (the pager fetches or waits for a prefetch). Post-hook (``always_call``, so an exception
still releases): release them, or, while backward re-runs a forward (activation checkpointing),
turn them into backward holds because their gradients are still to come.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from engine.paging.access_mode import ParamAccessMode
from engine.paging.backward import BackwardTracker, SavedTensorHooks, in_backward, register_module_post_backward
from engine.paging.handle import ParamHandle
from engine.paging.pager import Pager
from engine.stats import EngineCounters


# [Note: Forward scope]
# The pre-hook (registered with ``prepend=True``, so it runs before the user's own pre-hooks)
# acquires the module's direct parameters plus the extras it was seen reading last time; the
# post-hook (``always_call=True``, so an exception still releases) releases them and tops up the
# prefetch. The outermost hooked module opens the scope: the access mode and, outside backward, the
# saved-tensor hooks (see [Note: Parameters read outside their module], [Note: Backward holds]);
# the root module's call starts a step. Nested containers, a module called several times per step
# (each call is a need and a release) and shared submodules need nothing special. One forward at a
# time per engine: the hooks share one scope.
#
# [Note: Activation checkpointing]
# Reentrant: the first pass runs under no_grad (fetch, release, nothing saved); in backward the
# checkpoint re-runs the forward: the hooks see they are inside a backward (``in_backward()``),
# fetch as usual and turn each module's use into a backward hold instead of releasing it (its
# gradients are still to come), released by the inner backward's post-accumulate-grad hooks and its
# end. Non-reentrant: the checkpoint's own saved-tensor hooks are innermost during the first pass,
# so nothing of the region is packed by ours; the recompute in backward runs under the same
# backward-hold rule and our saved-tensor hooks are not opened there, so the checkpoint's
# recomputation hooks keep collecting. A checkpointed region's parameters are all held while its
# backward runs (as in FSDP2).
# A checkpointed function may also read a parameter directly, outside any hooked module (a module's
# own ``nn.Parameter`` in a checkpointed method, another module's weight through ``F.linear``). In
# the first pass the access mode catches it, since the root module's scope is open; the recompute
# runs inside backward with no scope open (the checkpoint calls the function itself, not a module),
# so the parameter's released class sees the read: it asks ``on_backward_read``, which fetches the
# parameter and holds it for this backward, released as every backward hold is (its gradient final,
# or the backward's end). Outside a backward that reader refuses, and the read raises as before.


class _Frame:
    """One running module call: its hooks and the handles it acquired (extras appended as found)."""

    __slots__ = ("hooks", "acquired")

    def __init__(self, hooks: "ModuleHooks") -> None:
        self.hooks = hooks
        self.acquired: list[ParamHandle] = []


class ForwardScope:
    """The wrapped model's forward nesting, shared by every module's hooks (one forward at a time)."""

    def __init__(
        self,
        root: torch.nn.Module,
        pager: Pager,
        tracker: BackwardTracker,
        saved: SavedTensorHooks,
        by_id: dict[int, ParamHandle],
        counters: EngineCounters,
    ) -> None:
        self._root = root
        self._pager = pager
        self._tracker = tracker
        self._saved = saved
        self._by_id = by_id
        self._counters = counters
        self._frames: list[_Frame] = []
        self._contexts: Optional[contextlib.ExitStack] = None
        #: Called with the root module's ``(args, kwargs)`` as a step's forward starts, once the holds
        #: of an earlier backward are released and before any parameter is fetched (the optimizer
        #: finishes a step left part way there).
        self.on_root_forward: Optional[Callable[[tuple], None]] = None

    @property
    def depth(self) -> int:
        """Modules of the wrapped model running right now (nested calls)."""
        return len(self._frames)

    def enter(self, hooks: "ModuleHooks", inputs: tuple) -> None:
        """A hooked module's forward is about to run."""
        outermost = not self._frames
        frame = _Frame(hooks)
        self._frames.append(frame)  # first, so the always-called post-hook finds it whatever fails below
        backward = in_backward()
        if outermost:
            if hooks.module is self._root and not backward:
                self._tracker.reset()
                if self.on_root_forward is not None:
                    self.on_root_forward(inputs)
                self._saved.begin_forward(self._root)
                grad = torch.is_grad_enabled()
                self._pager.begin_step(grad, wrap_around=not grad)
            self._open_contexts(saved=not backward)
        for handle in (*hooks.handles, *hooks.extras):
            self._pager.acquire(handle, backward=backward)
            frame.acquired.append(handle)
        if frame.acquired and torch.is_grad_enabled() and not backward:
            register_module_post_backward(inputs, frame.acquired, self._tracker)

    def exit(self, hooks: "ModuleHooks") -> None:
        """A hooked module's forward returned or raised."""
        if not self._frames or self._frames[-1].hooks is not hooks:
            return  # its pre-hook never ran (another pre-hook raised first)
        frame = self._frames.pop()
        try:
            backward = in_backward()
            for handle in frame.acquired:
                if backward:  # a forward re-run by backward: see [Note: Activation checkpointing]
                    self._tracker.hold(handle)
                self._pager.release(handle)
        finally:
            if not self._frames:
                self._close_contexts()

    def on_param_read(self, handle: ParamHandle) -> Optional[Callable[[], None]]:
        """The access mode found ``handle`` read while nothing holds it: the running module holds it
        until it returns, and acquires it up front from now on."""
        self._counters.on_demand_fetches += 1
        self._pager.acquire(handle, backward=in_backward())
        if not self._frames:
            return lambda: self._pager.release(handle)
        frame = self._frames[-1]
        frame.acquired.append(handle)
        if handle not in frame.hooks.extras and handle not in frame.hooks.handles:
            frame.hooks.extras.append(handle)
        return None

    def on_backward_read(self, handle: ParamHandle) -> bool:
        """A released parameter's values are read outside the forward's scope: inside a backward (a
        checkpointed function re-run by it) hold it for that backward and return True; elsewhere
        return False (the read raises). See [Note: Activation checkpointing]."""
        if not in_backward():
            return False
        self._counters.on_demand_fetches += 1
        self._tracker.hold(handle)
        return True

    def _open_contexts(self, *, saved: bool) -> None:
        assert self._contexts is None
        stack = contextlib.ExitStack()
        stack.enter_context(ParamAccessMode(self._by_id, self.on_param_read))
        if saved:
            stack.enter_context(self._saved.context())
        self._contexts = stack

    def _close_contexts(self) -> None:
        stack, self._contexts = self._contexts, None
        if stack is not None:
            stack.close()


class ModuleHooks:
    """The forward pre/post hooks of one module of the wrapped model (see [Note: Forward scope])."""

    def __init__(self, module: torch.nn.Module, handles: list[ParamHandle], scope: ForwardScope) -> None:
        self.module = module
        self.handles = handles
        self.extras: list[ParamHandle] = []
        self._scope = scope
        self._removers = [
            module.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True),
            module.register_forward_hook(self._post, always_call=True),
        ]

    def remove(self) -> None:
        """Unregister both hooks."""
        for remover in self._removers:
            remover.remove()
        self._removers = []

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._scope.enter(self, (args, kwargs))

    def _post(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self._scope.exit(self)
