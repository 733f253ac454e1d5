"""Model loading: `models.load` (the embedded SmolLM2 GGUF, other llama GGUFs,
or mlx-lm models), `gguf` (a GGUF file as an mlx-lm llama model and tokenizer),
and the header checks that run before `mx.load` reads a file (`fileformat` for
GGUF and the shared file mapping, `safetensors_header`). Calibration and cache
files are safetensors too: `checked_io` checks their headers here, so this
`__init__` imports nothing.
"""
