"""The sections of docs/results.md, in order; each returns markdown lines
computed from the results files in scripts/results/ (see make_results_doc.py).
`headline` is the README's results summary."""

from . import (
    agnostic,
    budgets,
    chat,
    continuation,
    eval_runs,
    kvzap,
    kvzip_defaults,
    pareto,
    peak,
    peers,
    quantized,
    reuse,
    serving,
    speed,
    studies,
)
from .headline import headline

__all__ = ["SECTIONS", "headline"]

SECTIONS = [
    agnostic.passkey_agnostic,
    reuse.kvzip_plus,
    reuse.ppl_agnostic,
    continuation.kvzip_decode,
    kvzip_defaults.kvzip_defaults,
    kvzap.kvzap,
    reuse.second_text,
    pareto.pareto,
    continuation.equal_bytes,
    agnostic.compress_cost,
    serving.serve_bench,
    serving.shared_system,
    chat.chat_bench,
    agnostic.kvzip_in_generate,
    eval_runs.passkey_all,
    agnostic.passkey_aware_new,
    eval_runs.quantized_ppl,
    peers.versus_veloxquant,
    speed.memory,
    peak.peak_memory,
    peak.attention_tiles,
    peak.long_prompt,
    speed.decode_quantized,
    quantized.quantizer_grid,
    quantized.rotated,
    quantized.eviction_holes,
    quantized.decode_on_kernels,
    speed.decode_eviction,
    speed.overhead,
    speed.softmax_cpu,
    budgets.perplexity,
    budgets.knorm_recent,
    budgets.passkey,
    budgets.lookahead,
    budgets.prompt_chunks,
    studies.a2ats_codebook,
    studies.qfilters_rank,
]
