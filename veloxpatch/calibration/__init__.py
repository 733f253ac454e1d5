"""Calibration: per-model statistics some caches read from a file.

One module a kind (`qfilters`, `a2ats` codebooks, `kvzap` surrogates), each
running its calibration through the probe seam and writing its file; `run`
holds `calibrate`, the one entry over them. The file format, which the caches
read, is `caches/calibration_files.py`.
"""
