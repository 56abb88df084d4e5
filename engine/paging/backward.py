"""Backward: bring saved parameters back before the nodes that use them run, and release them
once their gradient is final, their module's backward is over, or backward ends.

- ``SavedTensorHooks``: ``saved_tensors_hooks`` active during the wrapped forward. A saved tensor
  whose storage is a managed parameter's (the parameter, or a view such as the ``W.t()`` linear
  saves) is packed with its handle; unpack materializes the parameter again and returns the same
  tensor, which sees the refilled storage. With ``EngineConfig.activation_tier``, other saved
  tensors go to the store (``engine.paging.saved_activations``).
- ``BackwardTracker``: per autograd graph task, what backward holds; at the task's end (a callback
  queued on the autograd engine) it releases them, and at the end of the outermost backward it
  drops prefetched parameters so an optimizer step that follows sees no stale copies.
- Gradient-final seam: ``register_post_accumulate_grad_hook`` per trainable parameter calls
  ``on_grad_final`` (multi-rank training reduce-scatters and offloads the gradient there).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Optional

import torch
from torch.autograd.graph import register_multi_grad_hook, saved_tensors_hooks

from engine.paging.handle import ParamHandle
from engine.paging.pager import Pager
from engine.paging.saved_activations import SavedActivation, SavedActivations


# [Note: Backward holds]
# The saved-tensor hooks pack a saved tensor whose storage is a managed parameter's (matched by the
# storage's identity, so views count) as (handle, tensor); unpack holds the handle for backward,
# fetching it if released, and returns the same tensor. A backward hold ends at the first of:
# - the parameter's post-accumulate-grad hook: its gradient is final (every node taking it ran);
# - the module's post-backward, a ``register_multi_grad_hook`` on the module's non-leaf inputs that
#   fires once their gradients exist. Without it a frozen parameter (LoRA-style training) or a tied
#   weight whose accumulation waits for the embedding's backward would stay materialized to the end
#   of backward, breaking [Note: Memory bound]. Leaf inputs are left out: ``autograd.grad`` cannot
#   evaluate multi-grad hooks on leaves;
# - the end of that backward (a callback queued on the autograd engine), which catches the rest
#   (``autograd.grad`` of inputs only, inputs that need no gradient).
# A node that unpacks a parameter released earlier fetches it again: results never depend on when
# a parameter was released.
#
# [Note: Saved tensors are detached]
# Every tensor a pack hook keeps or returns is detached (the parameters' aliases here, the
# activations engine.paging.saved_activations keeps or offloads). A saved output keeps its
# ``grad_fn``, which holds what pack returns; returning the tensor itself would make a reference
# cycle through C++ that the garbage collector cannot see, keeping alive a graph that is never run
# backward. Autograd attaches the ``grad_fn`` again on unpack.


def in_backward() -> bool:
    """True on a thread that is running an autograd backward pass."""
    return torch._C._current_graph_task_id() != -1


class BackwardTracker:
    """What each running backward (graph task) holds, released when that task ends."""

    def __init__(self, pager: Pager) -> None:
        self._pager = pager
        self._tasks: dict[int, list[ParamHandle]] = {}
        self._outside: list[ParamHandle] = []  # unpacked outside backward (a user reading grad_fn._saved_*)
        self._post_backward_hooks: list[Any] = []

    def hold(self, handle: ParamHandle) -> None:
        """Backward needs ``handle`` until its gradient is final or the backward ends."""
        with self._pager.lock:
            task = torch._C._current_graph_task_id()
            if task == -1:
                held = self._outside
            else:
                held = self._tasks.get(task)
                if held is None:
                    held = self._tasks[task] = []
                    torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._task_done, task))
            if not handle.bwd_hold:
                held.append(handle)
            self._pager.hold_for_backward(handle)

    def release(self, handles: Iterable[ParamHandle]) -> None:
        """Backward is done with ``handles`` (their module's backward ended)."""
        for handle in handles:
            self._pager.end_backward_hold(handle)

    def reset(self) -> None:
        """Release every backward hold (a new step starts outside backward: whatever is left belongs
        to a backward that failed, or to saved tensors unpacked outside backward), and remove the last
        step's post-backward hooks."""
        with self._pager.lock:
            tasks, self._tasks = self._tasks, {}
            outside, self._outside = self._outside, []
            for held in [*tasks.values(), outside]:
                self.release(held)
            hooks, self._post_backward_hooks = self._post_backward_hooks, []
        for hook in hooks:
            hook.remove()

    def add_post_backward_hook(self, hook: Any) -> None:
        """Keep a module's post-backward hook until the next step. Removing it then frees a graph that
        never ran backward: the hook's closure holds the graph's nodes and the nodes hold the hook, a
        cycle through C++ that Python's garbage collector cannot see."""
        self._post_backward_hooks.append(hook)

    def _task_done(self, task: int) -> None:
        with self._pager.lock:
            self.release(self._tasks.pop(task, ()))
            if not self._tasks:
                self._pager.drop_prefetched()


class _SavedParam:
    """What the pack hook keeps for a saved tensor that aliases a managed parameter."""

    __slots__ = ("handle", "tensor", "version")

    def __init__(self, handle: ParamHandle, tensor: torch.Tensor) -> None:
        self.handle = handle
        self.tensor = tensor
        self.version = handle.version


class SavedTensorHooks:
    """Pack/unpack hooks that re-materialize parameters saved for backward, and move other saved
    tensors through the store when ``activations`` is given."""

    def __init__(
        self, by_storage: dict[int, ParamHandle], tracker: BackwardTracker,
        activations: Optional[SavedActivations] = None,
    ) -> None:
        self._by_storage = by_storage
        self._tracker = tracker
        self._activations = activations

    def begin_forward(self, model: torch.nn.Module) -> None:
        """The wrapped model's forward starts a step."""
        if self._activations is not None:
            self._activations.begin_forward(model)

    def context(self) -> saved_tensors_hooks:
        """A fresh ``saved_tensors_hooks`` context with these hooks."""
        return saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> Any:
        """Tag a saved alias of a managed parameter with its handle; offload other tensors or leave them."""
        if tensor.layout is not torch.strided or tensor.device.type == "meta":
            return tensor.detach()
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without plain storage (subclasses)
            return tensor.detach()
        handle = self._by_storage.get(storage._cdata)
        # Detached: see [Note: Saved tensors are detached].
        if handle is not None:
            return _SavedParam(handle, tensor.detach())
        return tensor.detach() if self._activations is None else self._activations.pack(tensor, storage)

    def unpack(self, packed: Any) -> torch.Tensor:
        """Materialize the parameter a tagged tensor aliases, then return the tensor (or the offloaded one)."""
        if type(packed) is SavedActivation:
            assert self._activations is not None
            return self._activations.unpack(packed)
        if type(packed) is _SavedParam:
            handle = packed.handle
            self._tracker.hold(handle)
            if handle.version != packed.version:  # autograd's own check, which saved-tensor hooks turn off
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: parameter {handle.name!r} was saved at version {packed.version} and is now at "
                    f"version {handle.version}"
                )
            return packed.tensor
        return packed


def register_module_post_backward(
    inputs: Iterable[Any], handles: list[ParamHandle], tracker: BackwardTracker
) -> Optional[Any]:
    """Release ``handles``' backward holds once the gradients of a module's inputs are computed
    (its backward is over). None when no input requires a gradient (then post-accumulate-grad
    hooks and the end of backward release them). See [Note: Backward holds]."""
    # Leaves are left out: autograd.grad() cannot evaluate a multi-grad hook on a leaf.
    tensors = [t for t in _tensors(inputs) if t.requires_grad and t.grad_fn is not None]
    if not tensors or not handles:
        return None
    hook = register_multi_grad_hook(tensors, lambda _grads: tracker.release(handles), mode="all")
    tracker.add_post_backward_hook(hook)
    return hook


def register_grad_final_hooks(
    handles: Iterable[ParamHandle], on_grad_final: Callable[[ParamHandle], None]
) -> list[Any]:
    """A post-accumulate-grad hook per trainable parameter calling ``on_grad_final(handle)``."""
    removers = []
    for handle in handles:
        if handle.trainable:
            hook = functools.partial(_grad_final, on_grad_final, handle)
            removers.append(handle.param.register_post_accumulate_grad_hook(hook))
    return removers


def _grad_final(on_grad_final: Callable[[ParamHandle], None], handle: ParamHandle, _param: torch.Tensor) -> None:
    on_grad_final(handle)


def _tensors(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    stack = list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
