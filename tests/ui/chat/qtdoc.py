"""Reading a QTextDocument back: its blocks, text fragments, anchors and per-character formats, so
tests check what Qt shows rather than the HTML that was fed to it."""

from __future__ import annotations

from collections.abc import Iterator

from PySide6.QtGui import QTextBlock, QTextCharFormat, QTextCursor, QTextDocument, QTextFragment


def blocks(doc: QTextDocument) -> Iterator[QTextBlock]:
    """Every block in document order, table cells included."""
    b = doc.begin()
    while b.isValid():
        yield b
        b = b.next()


def block(doc: QTextDocument, text: str) -> QTextBlock:
    found = [b for b in blocks(doc) if b.text() == text]
    assert len(found) == 1, f"{len(found)} blocks read {text!r}"
    return found[0]


def fragments(doc: QTextDocument) -> Iterator[QTextFragment]:
    for b in blocks(doc):
        it = b.begin()
        while not it.atEnd():
            yield it.fragment()
            it += 1


def fragment(doc: QTextDocument, text: str) -> QTextFragment:
    found = [f for f in fragments(doc) if f.text() == text]
    assert len(found) == 1, f"{len(found)} fragments read {text!r}"
    return found[0]


def anchors(doc: QTextDocument) -> list[tuple[str, str]]:
    """(text, href) of every link, in order."""
    return [(f.text(), f.charFormat().anchorHref()) for f in fragments(doc)
            if f.charFormat().isAnchor()]  # fmt: skip


def char_format(b: QTextBlock, column: int) -> QTextCharFormat:
    """The format of the character at `column` of block `b`."""
    cur = QTextCursor(b)
    cur.setPosition(b.position() + column + 1)  # a cursor reports the character before it
    return cur.charFormat()


def formats_of_line(b: QTextBlock) -> list[QTextCharFormat]:
    return [char_format(b, i) for i in range(len(b.text()))]
