"""The spec-ngram benchmark on the default model, cut short: it runs both ways at 1 and 2
streams, speculation finds drafts on a prompt whose answer quotes it, and the texts are the
same (the benchmark's own exactness check, which this test makes fail loudly)."""

from __future__ import annotations

import re

import pytest

from engine_proc.bench import spec_ngram

pytestmark = pytest.mark.slow


def test_quote_prompt_gets_drafts_and_the_same_text(capsys):
    assert spec_ngram.main(["--tokens", "16", "--streams", "1", "2", "--repeats", "1",
                            "--threads", "1", "--prompts", "quote"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("quote")]
    assert len(lines) == 2
    for line in lines:
        assert "same text" in line, line
        accepted, drafted = map(int, re.search(r"(\d+)/(\d+) drafts accepted", line).groups())
        assert 0 < accepted <= drafted
