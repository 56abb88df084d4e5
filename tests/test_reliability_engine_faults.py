"""Engine faults: ENOSPC and EIO inside step(), a full real filesystem under the swap files, and a
damaged step record.

What must hold: step() raises the store's typed error (CapacityError / TransferError naming the
entry); the record still names the last completed step; a step that failed before changing anything
leaves everything as it was, and one that failed part way says so and is finished by the next
step() from its durable gradients; and the losses from there on equal plain torch's. A step record
that cannot be read stops a resume with advice.
"""

from __future__ import annotations

import copy
import errno
import os
from typing import Callable, Optional

import pytest
import torch
from engine_models import TinyGPT, gpt_tokens, store_config
from small_filesystems import fill

import engine
import tiered
from engine.optim.step_record import STEP_RECORD_KEY, StepRecord
from engine.errors import StepRecordError
from tiered import CapacityError, TransferError
from tiered.io import Syscalls

pytestmark = pytest.mark.timeout(120)

KiB = 1024
LR = 1e-2


def config_at(tmp_path, step_in_backward: Optional[bool] = None, **store_kw) -> engine.EngineConfig:
    return engine.EngineConfig(host_budget="host_tier", store=store_config(tmp_path,
                               host_bytes=64 * KiB).replace(**store_kw), param_tier="nvme",
                               optimizer_tier="nvme", grad_tier="nvme", optimizer_group_bytes=8 * KiB,
                               prefetch_bytes=16 * KiB, step_in_backward=step_in_backward)


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    return model(gpt_tokens(seed=step)).float().pow(2).mean()


class Injected:
    """``pwritev`` that passes ``ok`` calls to the real one, then fails ``failures`` calls (None: all
    later ones) with ``err``, then passes again."""

    def __init__(self, real: Callable, ok: int, err: int, failures: Optional[int]) -> None:
        self.real, self.ok, self.err, self.failures, self.calls, self.failed = real, ok, err, failures, 0, 0

    def __call__(self, *args):
        self.calls += 1
        if self.calls > self.ok and (self.failures is None or self.failed < self.failures):
            self.failed += 1
            raise OSError(self.err, os.strerror(self.err))
        return self.real(*args)


def snapshot(eng: engine.Engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in eng.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def train_with_a_fault(eng: engine.Engine, model: torch.nn.Module, fail_at: int, steps: int,
                       inject: Callable[[], None], heal: Callable[[], None], error: type, match: str,
                       part_way: Optional[bool] = None) -> None:
    """Train ``steps`` steps beside plain torch; step ``fail_at`` first fails (``inject``) and, after
    ``heal``, the next step() runs it again (nothing was written) or finishes it (it stopped part
    way; ``part_way`` says which is expected, None: either). Losses equal torch's throughout."""
    ref = copy.deepcopy(eng.state_dict())
    ref_model = TinyGPT()
    ref_model.load_state_dict(ref)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LR)
    for step in range(steps):
        loss, ref_loss = loss_of(model, step), loss_of(ref_model, step)
        assert loss.item() == ref_loss.item(), step
        loss.backward()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == fail_at:
            before, completed = snapshot(eng), eng.completed_steps
            shard_steps = eng.optimizer.shard_steps
            eng._training.grads.flush()  # the gradient puts are done: the fault hits the step's own writes
            inject()
            with pytest.raises(error, match=match) as failure:
                eng.step()
            heal()
            assert eng.completed_steps == completed and eng.optimizer.shard_steps == shard_steps
            record = StepRecord.read(eng.store)
            assert record.step == completed
            notes = "".join(getattr(failure.value, "__notes__", []))
            stopped = record.applying is not None
            assert part_way is None or stopped == part_way, record
            if stopped:
                assert f"step {completed + 1} stopped part way" in notes and "eng.step() finishes it" in notes
            else:
                assert not notes
                assert_same(snapshot(eng), before)  # nothing was written
        eng.step()  # the gradients were kept: the same step, now whole
        eng.zero_grad()
    assert_same(snapshot(eng), {k: v.detach() for k, v in ref_model.state_dict().items()})


@pytest.mark.parametrize("fail_at, ok, part_way", [(0, 0, False), (0, 4, True), (2, 9, True)],
                         ids=["before-any-write", "first-step", "later-step"])
@pytest.mark.parametrize("err, error, match", [
    (errno.ENOSPC, CapacityError, "No space left on device"),
    (errno.EIO, TransferError, "Input/output error"),
])
def test_a_write_fault_in_step_is_finished_by_the_next_step(tmp_path, fail_at, ok, part_way, err, error, match):
    """Writes fail after ``ok`` succeeded, persistently until healed: with none, the step's first
    write (its record) fails and nothing changes; with some, a few groups commit and the rest fail,
    and the next step() finishes the step from its gradients with the values it recorded (the step after
    backward; inside backward: the next test)."""
    torch.manual_seed(3)
    model = TinyGPT()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config_at(tmp_path, step_in_backward=False))
    real = eng.store._io.syscalls

    def inject() -> None:
        eng.store._io.syscalls = Syscalls(pwritev=Injected(real.pwritev, ok, err, None), preadv=real.preadv,
                                          fdatasync=real.fdatasync)

    def heal() -> None:
        eng.store._io.syscalls = real

    try:
        train_with_a_fault(eng, model, fail_at, 4, inject, heal, error, match, part_way)
    finally:
        eng.close()


def test_a_transient_eio_in_step_is_finished_without_healing(tmp_path):
    """One failed write in the middle of a step: the step stopped part way, and the next step()
    finishes it with nothing healed."""
    torch.manual_seed(4)
    model = TinyGPT()
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config_at(tmp_path, step_in_backward=False))
    real = eng.store._io.syscalls

    def inject() -> None:
        # Armed when the step starts writing its second group (nothing else writes then), so the
        # failure lands in the step's own writes however many syscalls coalescing makes of them;
        # the rollback's writes pass.
        failing = Injected(real.pwritev, 2**62, errno.EIO, 1)

        def arm(event: str, group: int) -> None:
            if event == "write" and group == 1 and failing.ok == 2**62:
                failing.ok = failing.calls

        eng._training.on_event = arm
        eng.store._io.syscalls = Syscalls(pwritev=failing, preadv=real.preadv, fdatasync=real.fdatasync)

    try:
        train_with_a_fault(eng, model, 2, 4, inject, lambda: None, TransferError, "Input/output error", True)
    finally:
        eng.close()


@pytest.mark.parametrize("err, error", [(errno.ENOSPC, CapacityError), (errno.EIO, TransferError)])
def test_a_write_fault_inside_backward_leaves_the_last_step_and_the_batch_runs_again(tmp_path, err, error):
    """Writes fail in the middle of a step's updates inside backward (after two batches wrote): the
    backward raises and says to run the batch again; once healed, the forward puts the last committed
    step's values back, the batch runs again, and training equals torch's."""
    torch.manual_seed(5)
    model = TinyGPT()
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LR)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config_at(tmp_path, step_in_backward=True))
    real = eng.store._io.syscalls
    failing = Injected(real.pwritev, 2**62, err, None)

    def arm(event: str, batch: int) -> None:
        if event == "renamed" and batch >= 2 and failing.ok == 2**62:
            failing.ok = failing.calls  # every write from here on fails, until healed

    try:
        for step in range(4):
            if step == 2:
                eng._training.on_event = arm
                eng.store._io.syscalls = Syscalls(pwritev=failing, preadv=real.preadv, fdatasync=real.fdatasync)
                with pytest.raises(RuntimeError, match="update inside backward failed") as failure:
                    loss_of(model, step).backward()
                assert isinstance(failure.value.__cause__, error)
                assert "run its batch again" in "".join(failure.value.__notes__)
                eng.store._io.syscalls = real
                eng._training.on_event = None
                assert eng.completed_steps == 2
            loss, ref_loss = loss_of(model, step), loss_of(ref_model, step)
            assert loss.item() == ref_loss.item(), step
            loss.backward()
            ref_loss.backward()
            eng.step()
            ref_opt.step()
            ref_opt.zero_grad()
        assert_same(snapshot(eng), {k: v.detach() for k, v in ref_model.state_dict().items()})
    finally:
        eng.close()


# ------------------------------------------------------------------- a real full filesystem



def test_a_full_disk_under_the_swap_files_fails_the_step_cleanly(tmp_path, small_tmpfs):
    """The swap files on a real 2 MiB tmpfs, filled just before the first step (which must grow them
    for the optimizer state): CapacityError, the last completed step in the record, and the step is
    done once a file is deleted."""
    torch.manual_seed(5)
    model = TinyGPT()
    config = config_at(tmp_path, nvme_paths=[os.path.join(small_tmpfs, "nvme")], swap_grow_bytes=256 * KiB)
    eng = engine.wrap(model, optimizer=engine.AdamW(lr=LR), config=config)
    filler: list[str] = []
    try:
        train_with_a_fault(eng, model, 0, 3, lambda: filler.append(fill(small_tmpfs)),
                           lambda: os.unlink(filler[0]), CapacityError, "free disk space")
    finally:
        eng.close()
    with tiered.TieredStore.open(config.store) as store:  # and a reopen finds the last step, space exact
        assert StepRecord.read(store).step == 3
        space = store.nvme_space()
        assert space.allocated_bytes == space.entry_bytes, space


# ------------------------------------------------------------------- a damaged step record


@pytest.mark.parametrize("damage", ["garbage", "wrong dtype", "bad field", "flipped bit"])
def test_a_damaged_step_record_stops_a_resume_with_advice(tmp_path, damage):
    config = config_at(tmp_path)
    eng = engine.wrap(TinyGPT(), optimizer=engine.AdamW(lr=LR), config=config)
    loss_of(eng.model, 0).backward()
    eng.step()
    eng.close()
    with tiered.TieredStore.open(config.store) as store:
        good = store.sync.get(STEP_RECORD_KEY)
        if damage == "garbage":
            store.sync.put(STEP_RECORD_KEY, torch.frombuffer(bytearray(b"\x00{not json"), dtype=torch.uint8), "nvme")
        elif damage == "wrong dtype":
            store.sync.put(STEP_RECORD_KEY, torch.ones(3), "nvme")
        elif damage == "bad field":
            text = bytes(good.numpy()).decode().replace('"step": 1', '"step": -4')
            store.sync.put(STEP_RECORD_KEY, torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8), "nvme")
    if damage == "flipped bit":
        _flip_record_bit(config.store)
    with pytest.raises(StepRecordError, match="load_checkpoint.*or wrap without resume"):
        engine.wrap(TinyGPT(), optimizer=engine.AdamW(lr=LR), config=config.replace(resume=True))
    # The advice works: a fresh wrap over the same store starts afresh.
    with engine.wrap(TinyGPT(), optimizer=engine.AdamW(lr=LR), config=config) as fresh:
        assert fresh.completed_steps == 0


def _flip_record_bit(store_cfg: tiered.StoreConfig) -> None:
    """Flip one bit of the record's bytes in its swap file (located through the manifest)."""
    import array
    import sqlite3

    db = sqlite3.connect(os.path.join(store_cfg.path, "manifest.sqlite"))
    try:
        (blob,) = db.execute("SELECT extents FROM entries WHERE key = ?", (STEP_RECORD_KEY,)).fetchone()
    finally:
        db.close()
    ext = array.array("q")
    ext.frombytes(blob)
    file_index, offset = ext[0], ext[1]
    swaps = sorted(n for n in os.listdir(store_cfg.path) if n.startswith("swap-"))
    with open(os.path.join(store_cfg.path, swaps[file_index]), "r+b") as f:
        f.seek(offset + 5)
        byte = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([byte[0] ^ 0x10]))
