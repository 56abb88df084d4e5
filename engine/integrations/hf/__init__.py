"""Hugging Face over the engine: ``from_pretrained``, accelerate's big-model calls, the Trainer and PEFT."""
