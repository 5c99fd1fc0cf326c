"""Attachment token counts from a real engine (tiny random model, real SmolLM2 tokenizer), through
the window's link and feed: exactly what the tokenizer itself counts, while chats still stream."""

from __future__ import annotations

import pytest

from tests.ui.conftest import send_chat, window_on_tiny_engine
from ui.chat.attachment_bar import AttachmentBar
from ui.chat.attachments import attachment_block

pytestmark = pytest.mark.slow
MAX_MODEL_LEN = 512
CODE = ('def area(r: float) -> float:\n    """π r² — naïve, in café units 🚀"""\n'
        "    return 3.14159 * r * r\n\n\nprint(area(2))  # 12.56636\n")


@pytest.fixture(scope="module")
def win(qapp, tmp_path_factory):
    args = ("--num-kv-blocks", "64", "--max-model-len", str(MAX_MODEL_LEN))
    with window_on_tiny_engine(tmp_path_factory.mktemp("kvscope-data"), *args, show=False) as w:
        yield w


def _tokenizer_count(text: str) -> int:
    """The independent reference: the model's tokenizer in this process, no special tokens (the
    attachment is a fragment of a message; the chat template adds BOS once)."""
    from transformers import AutoTokenizer

    from tests.tiny_models import tiny_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir()))
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def test_attachment_tokens_are_the_tokenizers_count(win, qtbot, tmp_path):
    f = tmp_path / "area.py"
    f.write_text(CODE, encoding="utf-8")
    bar = AttachmentBar(win.token_counter)
    qtbot.addWidget(bar)
    (a,) = bar.add_paths([str(f)])
    qtbot.waitUntil(lambda: a.tokens is not None, timeout=30_000)
    assert not a.tokens_estimated
    assert a.tokens == _tokenizer_count(attachment_block(a)) > 20
    assert bar._items[0][2].label.text() == f"area.py · text · {a.tokens:,} tokens"
    assert win.token_counter.max_model_len == MAX_MODEL_LEN
    # the chat's replies still reach the chat through the same feed
    send_chat(win, "Hello", max_tokens=4)
    conv = win.chat.current
    qtbot.waitUntil(lambda: not win.chat.busy(conv.id), timeout=60_000)
    assert conv.messages[-1].stats["completion_tokens"] == 4
