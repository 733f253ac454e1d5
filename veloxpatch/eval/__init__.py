"""Evaluation primitives: real text, perplexity, passkey cases, agreement."""
