"""Syscall wrappers for tests that make preadv/pwritev move less than they were asked."""

from __future__ import annotations

import random
from typing import Callable


def first_bytes(views: list, limit: int) -> list:
    """The leading ``limit`` bytes of an iovec list."""
    out, left = [], limit
    for v in views:
        if left <= 0:
            break
        out.append(v[:left])
        left -= len(out[-1])
    return out


def capped(fn: Callable, limit: int) -> Callable:
    """A preadv/pwritev that moves at most ``limit`` bytes per call (as a signal or a busy disk may)."""
    return lambda fd, views, offset: fn(fd, first_bytes(views, limit), offset)


def random_prefix(fn: Callable, rng: random.Random, align: int) -> Callable:
    """A preadv/pwritev that moves a random, ``align``-multiple prefix of what it is asked."""

    def call(fd, views, offset):
        total = sum(len(v) for v in views)
        return fn(fd, first_bytes(views, max(align, rng.randrange(0, total + 1) // align * align)), offset)

    return call
