"""Checkpoint sourcing: turn a model name, HF dir or GGUF file into a ready Hugging Face model dir.

Split by job: :mod:`.resolve` (names and paths to dirs), :mod:`.cache` (build once, rename into
place), :mod:`.builtin` (the built-in models and tokenizer files), :mod:`.gguf_convert`,
:mod:`.gguf_tensors` and :mod:`.gguf_tokenizer` (GGUF to HF). It sits below the engine and the
serve layer and imports neither.
"""
