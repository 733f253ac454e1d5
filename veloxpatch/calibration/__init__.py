"""Calibration: per-model statistics some caches read from a file.

One module a kind (`qfilters`, `a2ats` codebooks, `kvzap` surrogates), each
running its calibration through the probe seam and writing its file; `run`
holds `calibrate`, the one entry over them; `format` is the file format the
kinds write and the caches read (through `Options.bind`). The caches import
`format` alone, so this package's `__init__` imports nothing.
"""
