"""Prompt-lookup (n-gram) drafts: a sequence that is repeating text it already holds (code edits,
quotes, summaries of the prompt) most likely goes on as it did the last time. For n from
prompt_lookup_max down to prompt_lookup_min, the latest earlier occurrence of the sequence's last
n tokens is found, and the k tokens that followed it are the drafts (where the match runs into
the sequence's end, they go on repeating it); from a match of SHORT_MATCH tokens or fewer, only
the first of them (when longer matches were looked for). How many k is, the engine decides per
sequence (draft_length.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# A match this short is weak evidence: two tokens recur by chance, and the drafts after them are
# mostly rejected, each costing a verification row (about a third of a decode step on an AVX2
# CPU). So it drafts one token. `python -m engine_proc.bench.spec_ngram --streams 1 --threads 1
# --decode-activations int8` (k = 4, 2-core Zen 1, two runs of each rule alternating): edit-code
# 1.11-1.16x -> 1.37-1.38x of no speculation, quote 1.95-2.00x -> 1.90-1.94x, free text 0.93-0.94x
# -> 0.90-0.96x (16 drafts instead of 40, none accepted by either).
SHORT_MATCH = 2


@dataclass(slots=True)
class NgramProposer:
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int

    def __post_init__(self) -> None:
        assert 1 <= self.prompt_lookup_min <= self.prompt_lookup_max
        assert self.num_speculative_tokens >= 1

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """At most k (default num_speculative_tokens) drafts to follow token_ids; [] if none
        of its suffixes occurred earlier."""
        k = self.num_speculative_tokens if k is None else min(k, self.num_speculative_tokens)
        if k <= 0:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        start, n = find_match(tokens, self.prompt_lookup_min, self.prompt_lookup_max)
        if n == 0:
            return []
        if n <= SHORT_MATCH < self.prompt_lookup_max:
            k = 1
        drafts = tokens[start + n : start + n + k].tolist()
        # A match that runs into the end is a repeat d tokens apart (a loop, rows of a table):
        # its continuation is the drafts' own, d back (an overlapping copy, as in LZ77).
        d = tokens.shape[0] - start - n
        while len(drafts) < k:
            drafts.append(drafts[len(drafts) - d])
        return drafts


def find_match(tokens: np.ndarray, n_min: int, n_max: int) -> tuple[int, int]:
    """(start, n) of the latest earlier match of the longest suffix of length n in
    [n_min, n_max] that has one, (0, 0) if none (numpy over the candidates, no loop over the
    history)."""
    length = tokens.shape[0]
    if length <= n_min:
        return 0, 0
    # Candidate starts i of a match of length n end at i + n - 1 < length - 1 with the last
    # token; found once (for n_min: the widest range), then narrowed per n.
    ends = np.flatnonzero(tokens[n_min - 1 : length - 1] == tokens[-1]) + (n_min - 1)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        starts = ends - (n - 1)
        starts = starts[starts >= 0]
        ok = np.ones(starts.shape[0], dtype=bool)
        for j in range(n - 1):  # the last token matches by construction
            ok &= tokens[starts + j] == tokens[length - n + j]
        if ok.any():
            return int(starts[ok][-1]), n
    return 0, 0
