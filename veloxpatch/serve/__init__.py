"""`veloxpatch serve`: mlx-lm's OpenAI-compatible server on a patched model.

`server` reuses mlx-lm's server (its HTTP handler, generation thread, batch
generator and prompt cache) with three changes: the model it loads is patched,
requests naming another model are refused, and `kv` bounds the KV bytes held.
Importing this package imports nothing from mlx (entry points preload BLAS).
"""
