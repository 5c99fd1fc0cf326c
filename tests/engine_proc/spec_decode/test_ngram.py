"""The n-gram proposer against a brute-force search of the same rule."""

from __future__ import annotations

import random

from engine_proc.spec_decode.ngram import SHORT_MATCH, NgramProposer


def brute_force(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    for n in range(n_max, n_min - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence first
            if tokens[start : start + n] == suffix:
                short = n <= SHORT_MATCH and n_max > SHORT_MATCH
                future = list(tokens)  # the sequence going on as it did after the match
                for i in range(1 if short else k):
                    future.append(future[start + n + i])
                return future[len(tokens) :]
    return []


def test_matches_brute_force_on_random_sequences() -> None:
    rng = random.Random(0)
    for trial in range(3000):
        vocab = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        n_min = rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        k = rng.randint(1, 6)
        proposer = NgramProposer(k, n_max, n_min)
        assert proposer.propose(tokens) == brute_force(tokens, n_min, n_max, k), (trial, tokens)


def test_prefers_the_longest_suffix_then_the_latest_occurrence() -> None:
    p = NgramProposer(3, 3, 1)
    # "1 2 3" occurs once (followed by 7 8 9); "3" alone occurs later (followed by 5)
    assert p.propose([1, 2, 3, 7, 8, 9, 3, 5, 1, 2, 3]) == [7, 8, 9]
    assert p.propose([4, 3, 5, 6, 4, 3, 6, 6, 9, 3]) == [6]  # latest "3" (a short match)
    assert p.propose([1, 2, 3, 4]) == []
    assert p.propose([1, 2, 3, 4], k=1) == []
    assert NgramProposer(4, 2, 2).propose([1, 2, 9, 1, 2], k=2) == [9, 1]


def test_a_short_match_drafts_one_token_where_longer_ones_were_looked_for() -> None:
    assert SHORT_MATCH == 2
    p = NgramProposer(4, 4, 2)
    # the suffix "5 1 2" occurs earlier: 3 tokens, all four drafts
    assert p.propose([5, 1, 2, 7, 8, 9, 6, 5, 1, 2]) == [7, 8, 9, 6]
    # only "1 2" occurs earlier: two tokens, one draft
    assert p.propose([4, 1, 2, 7, 8, 9, 6, 5, 1, 2]) == [7]
    assert NgramProposer(4, 4, 1).propose([7, 8, 9, 6, 2]) == []
    assert NgramProposer(4, 4, 1).propose([2, 8, 9, 6, 2]) == [8]  # one token matched
    # a proposer told to match two tokens at most keeps all its drafts
    assert NgramProposer(4, 2, 2).propose([4, 1, 2, 7, 8, 9, 6, 5, 1, 2]) == [7, 8, 9, 6]


def test_a_match_that_runs_into_the_end_drafts_its_repeat() -> None:
    """A loop (the latest match of "7 8 9" three tokens back): the drafts go on repeating it
    for all k, not only the tokens that follow the match in the sequence."""
    p = NgramProposer(8, 3, 1)
    assert p.propose([1, 7, 8, 9, 7, 8, 9]) == [7, 8, 9, 7, 8, 9, 7, 8]
    assert NgramProposer(8, 2, 1).propose([5, 5, 5]) == [5] * 8
    assert p.propose([3, 1, 2, 1, 2, 1, 2], k=5) == [1, 2, 1, 2, 1]
