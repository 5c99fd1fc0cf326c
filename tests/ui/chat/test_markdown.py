"""A reply's Markdown as Qt shows it: every construct read back from the reply's QTextDocument
(heading levels, lists, the table, the block quote, links, inline and fenced code with its
highlighting), the code blocks' Copy links, and model output that must stay literal text."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QPoint, Qt
from PySide6.QtGui import QFont, QFontInfo, QGuiApplication, QTextCursor, QTextFormat, QTextTable
from PySide6.QtGui import QTextListFormat as LF

from app.conversations import Message
from tests.ui.chat.qtdoc import (
    anchors,
    block,
    blocks,
    char_format,
    formats_of_line,
    fragment,
    fragments,
)
from ui.chat.message_view import MessageView

PY = '''def fib(n: int) -> int:
    """The n-th Fibonacci number."""
    return n if n < 2 else fib(n - 1) + fib(n - 2)'''
UNKNOWN = "+++ unknown <language> & co"
BARE = "no language at all\n  indented line"

REPLY = f"""# Heading one
## Heading two
### Heading three

Some *emphasis*, **strong**, ~~struck~~ and `inline_code()` with a \
[link](https://example.org/docs?a=1&b=2) and [mail](mailto:someone@example.org).

- first item
- second item
  - nested item
    1. deep ordered
- third item

1. one
2. two

Then:

3. gamma
4. delta

> A block quote
> over two lines.

| Name | Value | Note |
|:-----|------:|:----:|
| alpha | 1 | left |
| beta | 22 | mid |

```python
{PY}
```

---

```klingon
{UNKNOWN}
```

```
{BARE}
```

Done.
"""


@pytest.fixture
def view(qtbot) -> MessageView:
    v = MessageView(Message("assistant", REPLY))
    qtbot.addWidget(v)
    v.resize(760, 400)
    v.show()
    qtbot.waitExposed(v)
    return v


def test_headings_and_emphasis(view):
    doc = view.text.document()
    for text, level in (("Heading one", 1), ("Heading two", 2), ("Heading three", 3)):
        assert block(doc, text).blockFormat().headingLevel() == level
    assert block(doc, "Done.").blockFormat().headingLevel() == 0
    assert fragment(doc, "emphasis").charFormat().fontItalic()
    assert fragment(doc, "strong").charFormat().fontWeight() >= QFont.Weight.Bold
    assert fragment(doc, "struck").charFormat().fontStrikeOut()
    plain = fragment(doc, "Some ").charFormat()
    assert not plain.fontItalic() and not plain.fontStrikeOut() and not plain.isAnchor()


def test_lists_nest_with_their_kinds_and_numbers(view):
    doc = view.text.document()
    first, second, third = (block(doc, t) for t in ("first item", "second item", "third item"))
    nested, deep = block(doc, "nested item"), block(doc, "deep ordered")
    top = first.textList()
    assert top is not None and top.format().style() == LF.Style.ListDisc
    assert top.format().indent() == 1
    assert [top.itemNumber(b) for b in (first, second, third)] == [0, 1, 2]  # one list
    assert nested.textList().format().indent() == 2
    assert nested.textList().format().style() in (LF.Style.ListDisc, LF.Style.ListCircle,
                                                  LF.Style.ListSquare)
    assert nested.textList().itemNumber(first) == -1  # a list of its own
    assert deep.textList().format().style() == LF.Style.ListDecimal
    assert deep.textList().format().indent() == 3
    one, two = block(doc, "one"), block(doc, "two")
    assert one.textList().format().style() == LF.Style.ListDecimal
    assert [one.textList().itemNumber(b) for b in (one, two)] == [0, 1]
    assert one.textList().format().start() == 1
    gamma = block(doc, "gamma")
    assert gamma.textList().format().start() == 3 and gamma.textList().count() == 2
    assert block(doc, "Then:").textList() is None


def test_table_has_its_rows_columns_cells_and_alignment(view):
    doc = view.text.document()
    tables = [f for f in doc.rootFrame().childFrames() if isinstance(f, QTextTable)]
    assert len(tables) == 1
    t = tables[0]
    assert (t.rows(), t.columns()) == (3, 3)

    def cell_text(r: int, c: int) -> str:
        cell = t.cellAt(r, c)
        cur = cell.firstCursorPosition()
        cur.setPosition(cell.lastCursorPosition().position(), QTextCursor.MoveMode.KeepAnchor)
        return cur.selectedText()

    assert [[cell_text(r, c) for c in range(3)] for r in range(3)] == [
        ["Name", "Value", "Note"], ["alpha", "1", "left"], ["beta", "22", "mid"]]
    assert t.format().border() > 0  # Qt draws no grid without it
    head = t.cellAt(0, 0).firstCursorPosition()
    head.movePosition(QTextCursor.MoveOperation.Right)
    assert head.charFormat().fontWeight() >= QFont.Weight.Bold
    align = [t.cellAt(1, c).firstCursorPosition().block().blockFormat().alignment()
             for c in range(3)]  # fmt: skip
    assert align[0] & Qt.AlignmentFlag.AlignLeft and align[1] & Qt.AlignmentFlag.AlignRight
    assert align[2] & Qt.AlignmentFlag.AlignHCenter


def test_block_quote_is_indented(view):
    doc = view.text.document()
    quote = block(doc, "A block quote over two lines.").blockFormat()  # one paragraph
    assert quote.intProperty(QTextFormat.Property.BlockQuoteLevel) == 1
    assert quote.leftMargin() > 0
    done = block(doc, "Done.").blockFormat()
    assert done.intProperty(QTextFormat.Property.BlockQuoteLevel) == 0 and done.leftMargin() == 0


def test_links_inline_code_and_rule(view):
    doc = view.text.document()
    assert ("link", "https://example.org/docs?a=1&b=2") in anchors(doc)
    assert ("mail", "mailto:someone@example.org") in anchors(doc)
    code = fragment(doc, "inline_code()").charFormat()
    assert QFontInfo(code.font()).fixedPitch()
    assert code.background().style() != Qt.BrushStyle.NoBrush  # set off from the prose
    assert not QFontInfo(fragment(doc, "Some ").charFormat().font()).fixedPitch()
    rules = [b for b in blocks(doc) if b.blockFormat().hasProperty(
        QTextFormat.Property.BlockTrailingHorizontalRulerWidth)]
    assert len(rules) == 1


def _code_lines(doc, code: str) -> list:
    """The blocks that show `code`, one per line, checked to follow each other."""
    lines = code.split("\n")
    first = block(doc, lines[0])
    out = [first]
    while len(out) < len(lines):
        out.append(out[-1].next())
    assert [b.text() for b in out] == lines
    return out


def test_code_blocks_show_their_source_in_monospace(view):
    doc = view.text.document()
    for code in (PY, UNKNOWN, BARE):
        assert code in doc.toPlainText()
        for b in _code_lines(doc, code):
            assert all(QFontInfo(f.font()).fixedPitch() for f in formats_of_line(b))


def test_python_is_highlighted_and_an_unknown_language_is_not(view):
    doc = view.text.document()
    line = _code_lines(doc, PY)[0]  # def fib(n: int) -> int:
    keyword = char_format(line, line.text().index("def")).foreground().color()
    ident = char_format(line, line.text().index("(n") + 1).foreground().color()
    assert keyword != ident
    for code in (UNKNOWN, BARE):
        colours = {f.foreground().color().name() for b in _code_lines(doc, code)
                   for f in formats_of_line(b)}  # fmt: skip
        assert len(colours) == 1, code


@pytest.mark.parametrize(("lang", "code"), [
    ("py", "def f(): return 1"), ("js", "const x = 1;"), ("sh", "echo $HOME | grep x"),
    ("c++", "int main() { return 0; }"), ("nosuchlang", "def f(): return 1"), ("", "def f(): 1"),
])  # fmt: skip
def test_fence_language_aliases(qtbot, lang: str, code: str):
    v = MessageView(Message("assistant", f"```{lang}\n{code}\n```\n"))
    qtbot.addWidget(v)
    line = block(v.text.document(), code)
    colours = {f.foreground().color().name() for f in formats_of_line(line)}
    assert (len(colours) > 1) == (lang not in ("nosuchlang", ""))
    assert [b.lang for b in v.text.code_blocks] == [lang]


def test_copy_links_put_the_raw_code_on_the_clipboard(qtbot, view):
    doc = view.text.document()
    copies = [(text, href) for text, href in anchors(doc) if href.startswith("copy:")]
    assert copies == [("Copy", "copy:0"), ("Copy", "copy:1"), ("Copy", "copy:2")]
    assert block(doc, "python  ·  Copy".replace(" ", "\u00a0")).next().text() == PY.split("\n")[0]
    for n, code in enumerate((PY, UNKNOWN, BARE)):
        QGuiApplication.clipboard().clear()
        qtbot.mouseClick(view.text.viewport(), Qt.MouseButton.LeftButton,
                         pos=_anchor_point(view, f"copy:{n}"))
        assert QGuiApplication.clipboard().text() == code


def _anchor_point(view: MessageView, href: str) -> QPoint:
    """A point inside the first character of the link to `href`."""
    doc = view.text.document()
    f = next(f for f in fragments(doc) if f.charFormat().anchorHref() == href)
    cur = QTextCursor(doc)
    cur.setPosition(f.position())
    r = view.text.cursorRect(cur)
    return QPoint(r.x() + 3, r.center().y())


def test_raw_html_and_unsafe_links_stay_literal_text(qtbot):
    evil = ('<img src="file:///etc/passwd"> <script>alert(1)</script> <b>bold?</b> '
            "[bad](javascript:alert(1)) [file](file:///etc/passwd) <javascript:alert(2)> "
            "![pic](http://example.org/p.png)")
    v = MessageView(Message("assistant", evil))
    qtbot.addWidget(v)
    doc = v.text.document()
    text = doc.toPlainText()
    for literal in ('<img src="file:///etc/passwd">', "<script>alert(1)</script>",
                    "<b>bold?</b>", "[bad](javascript:alert(1))", "[file](file:///etc/passwd)",
                    "<javascript:alert(2)>"):  # fmt: skip
        assert literal in text
    assert not any(f.charFormat().isImageFormat() for f in fragments(doc))
    assert "<img" not in doc.toHtml()
    assert [href for _, href in anchors(doc)] == ["http://example.org/p.png"]  # a link, no image
    bold = [f for f in fragments(doc) if "bold?" in f.text()]
    assert all(f.charFormat().fontWeight() < QFont.Weight.Bold for f in bold)
