"""`veloxpatch serve`: mlx-lm's OpenAI-compatible server on a patched model.

One module a job: `server` (mlx-lm's HTTP handler, generation thread and batch
generator on the one patched model), `checks` (what a request may say),
`admission` (what a request may hold, reserved under `--kv-cap`), `prompt_cache`
(what finished requests leave for later), `replay` (the same prompt again,
from its entry's logits), `disk` (entries across restarts) and `cuts`
(disconnects and signals). Importing this package imports nothing from mlx
(entry points preload BLAS).
"""
