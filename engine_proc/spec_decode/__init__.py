"""Speculative decoding: draft proposers (ngram.py) and the verification of drafts against the
target model's own tokens (verify.py)."""
