"""How many drafts a sequence proposes next: its draft length follows how its last drafts
fared, up to num_speculative_tokens. It starts at START, grows by GROW after a step that
confirmed every draft and halves after one that rejected some (Hugging Face's assisted
generation adapts its num_assistant_tokens alike: +2, then -1).

Why: a verification row costs a fraction of a one-row step that depends on the CPU (a quarter
to a third on an AVX2 Zen 1, a tenth on an AVX-512 Zen 4, where several rows' products are
bound by arithmetic), and drafts come right in runs (a quoted sentence, an unchanged line of
code) broken by the model's own words. A fixed k pays k rows after every break, and stops
short of a long run. Whole replies, one process alternating with the fixed k = 4 it replaced
(medians of 5, 1 thread): the spec-ngram quote 2.60x -> 3.36x of no speculation on Zen 4,
1.99x -> 2.14x with the extension built for Zen 1; code edit 1.75x -> 1.79x and 1.51x ->
1.51x; free text 1.03x -> 1.05x and 1.15x -> 1.11x (docs/PERFORMANCE.md)."""

from __future__ import annotations

START = 2
GROW = 2


def first_draft_length(most: int) -> int:
    return min(START, most)


def next_draft_length(length: int, drafted: int, accepted: int, most: int) -> int:
    """The draft length after a step that verified `drafted` drafts (at most `length`) and
    confirmed `accepted` of them."""
    assert 0 <= accepted <= drafted and most >= 1, (accepted, drafted, most)
    if drafted == 0:
        return length
    if accepted == drafted:
        return min(most, length + GROW)
    return max(1, length // 2)
