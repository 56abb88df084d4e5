"""File formats and streaming: safetensors files read and written one tensor at a time, checkpoint
directories, weight sources (state dicts, files, ``save_pretrained`` directories) and progress bars."""
