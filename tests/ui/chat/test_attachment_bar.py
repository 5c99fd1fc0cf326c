"""The attachment bar: chips with their token counts, removal, errors beside good files, the
Attach… dialog, drops on the bar and on the chat's input box, and the warning line."""

from __future__ import annotations

from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl
from PySide6.QtGui import QDragEnterEvent, QDropEvent
from PySide6.QtWidgets import QApplication, QFileDialog, QPlainTextEdit

from ipc import protocol as P
from tests.ui.chat.pdfs import pdf_with_text
from ui.chat.attachment_bar import AttachmentBar, accept_file_drops, local_paths
from ui.chat.attachments import attachment_block, estimate_tokens
from ui.chat.token_counter import TokenCounter


def _files(tmp_path) -> tuple[str, str, str]:
    (tmp_path / "notes.txt").write_text("alpha beta gamma\n" * 10)
    (tmp_path / "paper.pdf").write_bytes(pdf_with_text(["Blocks of sixteen tokens"]))
    (tmp_path / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    return tuple(str(tmp_path / n) for n in ("notes.txt", "paper.pdf", "logo.png"))


def _bar(qtbot, counter: TokenCounter | None = None) -> AttachmentBar:
    bar = AttachmentBar(counter)
    qtbot.addWidget(bar)
    bar.show()
    return bar


def _chip_texts(bar: AttachmentBar) -> list[str]:
    return [chip.label.text() for _, _, chip in bar._items]


def test_chips_estimates_and_an_error_beside_good_files(qtbot, tmp_path):
    notes, pdf, png = _files(tmp_path)
    bar = _bar(qtbot)
    errors: list[str] = []
    bar.failed.connect(errors.append)
    with qtbot.waitSignal(bar.changed):
        added = bar.add_paths([notes, png, pdf])
    assert [a.name for a in added] == ["notes.txt", "paper.pdf"]
    assert [a.name for a in bar.attachments()] == ["notes.txt", "paper.pdf"]
    n = estimate_tokens(attachment_block(added[0]))
    assert _chip_texts(bar)[0] == f"notes.txt · text · ≈{n:,} tokens"  # no counter: estimated
    assert _chip_texts(bar)[1].startswith("paper.pdf · PDF · ≈")
    assert len(errors) == 1 and "logo.png looks like a binary file" in errors[0]
    assert bar.error_label.isVisible() and "logo.png" in bar.error_label.text()
    bar.add_paths([notes + ".missing"])  # the next try's errors replace the last ones
    assert "notes.txt.missing could not be read" in bar.error_label.text()
    assert "logo.png" not in bar.error_label.text() and len(bar.attachments()) == 2


def test_counted_tokens_removal_and_clear(qtbot, tmp_path):
    notes, pdf, _ = _files(tmp_path)
    sent: dict[str, str] = {}
    counter = TokenCounter(lambda rid, text: sent.setdefault(rid, text) is not None)
    bar = _bar(qtbot, counter)
    bar.add_paths([notes, pdf])
    assert _chip_texts(bar) == ["notes.txt · text · counting…", "paper.pdf · PDF · counting…"]
    assert list(sent.values()) == [attachment_block(a) for a in bar.attachments()]
    assert bar.token_total()[1] is True  # still counting: estimated
    rid_notes, rid_pdf = sent
    with qtbot.waitSignal(bar.changed):
        counter.take_replies([P.Tokenized(request_id=rid_notes, token_ids=[1] * 1234, text="",
                                          max_model_len=4096)])
    assert _chip_texts(bar)[0] == "notes.txt · text · 1,234 tokens"
    assert bar.attachments()[0].tokens == 1234 and not bar.attachments()[0].tokens_estimated
    # removing the PDF while it is counted: its late count changes nothing
    qtbot.mouseClick(bar._items[1][2].remove_btn, Qt.MouseButton.LeftButton)
    assert [a.name for a in bar.attachments()] == ["notes.txt"]
    counter.take_replies([P.Tokenized(request_id=rid_pdf, token_ids=[1], text="",
                                      max_model_len=4096)])
    assert bar.token_total() == (1234, False)
    bar.set_tokens("notes.txt", 1200, estimated=True)
    assert _chip_texts(bar) == ["notes.txt · text · ≈1,200 tokens"]
    bar.set_tokens(0, 7)
    assert bar.token_total() == (7, False)
    bar.set_warning("too long")
    with qtbot.waitSignal(bar.changed):
        bar.clear()
    assert bar.attachments() == [] and _chip_texts(bar) == []
    assert not bar.warning_label.isVisible() and not bar.error_label.isVisible()


def test_set_tokens_names_what_exists(qtbot, tmp_path):
    bar = _bar(qtbot)
    bar.add_paths([_files(tmp_path)[0]])
    for bad, err in (("other.txt", KeyError), (3, IndexError)):
        try:
            bar.set_tokens(bad, 1)
        except err as exc:
            assert "notes.txt" in str(exc) or "1 attached" in str(exc)
        else:
            raise AssertionError(f"set_tokens({bad!r}) did not raise")


def test_warning_line(qtbot):
    bar = _bar(qtbot)
    assert not bar.warning_label.isVisible()
    bar.set_warning("This message would need 5,722 tokens")
    assert bar.warning_label.isVisible() and "5,722" in bar.warning_label.text()
    bar.set_warning(None)
    assert not bar.warning_label.isVisible()


def test_attach_button_opens_a_file_dialog(qtbot, tmp_path, monkeypatch):
    notes, pdf, _ = _files(tmp_path)
    asked: list = []

    def fake_dialog(parent, caption, folder, filters):
        asked.append(caption)
        return [notes, pdf], filters

    monkeypatch.setattr(QFileDialog, "getOpenFileNames", staticmethod(fake_dialog))
    bar = _bar(qtbot)
    qtbot.mouseClick(bar.attach_btn, Qt.MouseButton.LeftButton)
    assert asked == ["Attach files"] and len(bar.attachments()) == 2


def _mime(paths: list[str], text: str | None = None) -> QMimeData:
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(p) for p in paths] + [QUrl("https://example.com/x.txt")])
    if text is not None:
        mime.setText(text)
    return mime


def _drop_on(widget, mime: QMimeData) -> tuple[bool, bool]:
    """Drag `mime` over `widget` and drop it; whether the enter and the drop were accepted."""
    pos = widget.rect().center()
    actions = Qt.DropAction.CopyAction
    enter = QDragEnterEvent(pos, actions, mime, Qt.MouseButton.LeftButton,
                            Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(widget, enter)
    drop = QDropEvent(QPointF(QPoint(pos)), actions, mime, Qt.MouseButton.LeftButton,
                      Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(widget, drop)
    return enter.isAccepted(), drop.isAccepted()


def test_dropping_files_on_the_bar(qtbot, tmp_path):
    notes, pdf, _ = _files(tmp_path)
    assert local_paths(_mime([notes])) == [notes]  # the web link is not a local file
    bar = _bar(qtbot)
    assert _drop_on(bar, _mime([notes, pdf])) == (True, True)
    assert [a.name for a in bar.attachments()] == ["notes.txt", "paper.pdf"]
    enter_ok, _ = _drop_on(bar, _mime([]))  # no local files: refused
    assert not enter_ok and len(bar.attachments()) == 2


def test_dropping_files_on_the_input_box(qtbot, tmp_path):
    notes, _, _ = _files(tmp_path)
    bar = _bar(qtbot)
    box = QPlainTextEdit()
    qtbot.addWidget(box)
    box.show()
    accept_file_drops(box, bar.add_paths)
    assert _drop_on(box.viewport(), _mime([notes])) == (True, True)  # text boxes: the viewport
    assert [a.name for a in bar.attachments()] == ["notes.txt"]
    assert box.toPlainText() == ""  # the file was attached, not pasted as its URL
    mime = QMimeData()
    mime.setText("plain words")
    assert _drop_on(box.viewport(), mime)[1]  # text drops still go into the box
    assert box.toPlainText() == "plain words" and len(bar.attachments()) == 1
