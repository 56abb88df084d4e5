"""Checkpoints and exports: sharded checkpoints at any world size, one parameter's whole state, and the
weights in Hugging Face's safetensors layout (from a wrapped model or from a checkpoint)."""
