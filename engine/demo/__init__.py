"""The model and data behind ``tiered train --demo`` and the end-to-end benchmarks."""

from engine.demo.data import BigramStream
from engine.demo.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "BigramStream"]
