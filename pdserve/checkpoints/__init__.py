"""Checkpoint sourcing: turn a model name, HF dir or GGUF file into a ready Hugging Face model dir.

Split by job: :mod:`.resolve` (names and paths to dirs), :mod:`.cache` (build once, rename into
place), :mod:`.builtin` (the built-in models and tokenizer files), :mod:`.gguf_convert`,
:mod:`.gguf_tensors` and :mod:`.gguf_tokenizer` (GGUF to HF), :mod:`.model_dir` (EOS ids and
sampling defaults of a model dir). It sits below text, the engine and the serve layer and imports
nothing else of pdserve.
"""
