"""The ``tiered`` console command: the store's commands and the engine's (train, estimate, export,
import-deepspeed, launch)."""

from engine.cli.main import main

__all__ = ["main"]
