"""A reply's Markdown as HTML for Qt's rich-text engine (QTextDocument), with highlighted code.

Model output is untrusted: raw HTML is off (a `<img src=file:...>` or a `<script>` stays literal
text), links survive only for http, https and mailto (anything else stays as its source text), and
images become plain links, so a document never loads a resource. QTextDocument knows a subset of
HTML 4 and inline CSS only (no classes), so every style is inline and tables carry the border and
cellpadding attributes Qt reads. Each fenced code block gets a header line whose `Copy` link is
`copy:N`, N indexing `Rendered.code_blocks` (the raw code, for the clipboard).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from markdown_it import MarkdownIt
from markdown_it.token import Token as MdToken
from markdown_it.utils import EnvType, OptionsDict
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexer import Lexer
from pygments.lexers import get_all_lexers, get_lexer_by_name
from pygments.styles import get_style_by_name
from pygments.token import Token
from pygments.util import ClassNotFound

from ui import theme

LINK_SCHEMES = ("http:", "https:", "mailto:")
CODE_STYLE = "one-dark"  # Atom's One Dark: the palette ui/theme.py's colours come from
CODE_BG = theme.BG
CODE_TEXT = "#" + (get_style_by_name(CODE_STYLE).style_for_token(Token)["color"] or "d7dae0")
INLINE_CODE_BG = theme.EMPTY
RULE = "#3a3f4b"


@dataclass(frozen=True, slots=True)
class CodeBlock:
    lang: str  # the fence's first info word ("" when none)
    code: str  # the block's text, without the newline that ends its last line


@dataclass(slots=True)
class Rendered:
    html: str
    code_blocks: list[CodeBlock] = field(default_factory=list)


def render_markdown(text: str) -> Rendered:
    env: EnvType = {"code_blocks": []}
    # Qt keeps a newline after the last closing tag as a trailing space of the last block
    body = _parser().render(text, env).rstrip("\n")
    return Rendered(html=body, code_blocks=env["code_blocks"])


def _valid_link(url: str) -> bool:
    return url.strip().lower().startswith(LINK_SCHEMES)


@lru_cache(maxsize=1)
def _parser() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "linkify": False, "typographer": False})
    md.enable(["table", "strikethrough"])
    md.validateLink = _valid_link  # type: ignore[method-assign]  # markdown-it's documented hook
    rules = {
        "fence": _fence, "code_block": _fence, "code_inline": _code_inline,
        "link_open": _link_open, "image": _image, "table_open": _table_open,
        "th_open": _cell_open, "td_open": _cell_open, "blockquote_open": _blockquote_open,
        "paragraph_open": _paragraph_open, "hr": _hr,
        "bullet_list_open": _list_open, "ordered_list_open": _list_open,
    }  # fmt: skip
    for name, rule in rules.items():
        md.add_render_rule(name, rule)
    return md


# --- render rules (markdown-it calls them as methods of its RendererHTML: `self` is that) ---

def _fence(self, tokens: Sequence[MdToken], idx: int, options: OptionsDict, env: EnvType) -> str:
    tok = tokens[idx]
    lang = tok.info.strip().split(maxsplit=1)[0] if tok.info.strip() else ""
    code = tok.content[:-1] if tok.content.endswith("\n") else tok.content
    blocks: list[CodeBlock] = env["code_blocks"]
    blocks.append(CodeBlock(lang=lang, code=code))
    header = (
        f'<p style="margin-top:6px; margin-bottom:0px; font-size:8pt; color:{theme.MUTED};">'
        f"{html.escape(lang or 'text')}&nbsp;&nbsp;·&nbsp;&nbsp;"
        f'<a href="copy:{len(blocks) - 1}" style="color:{theme.ACCENT};">Copy</a></p>'
    )
    # pre-wrap: long lines wrap instead of widening a widget that has no scroll bars
    pre = (f'<pre style="margin-top:2px; margin-bottom:6px; white-space:pre-wrap; '
           f'background-color:{CODE_BG}; color:{CODE_TEXT};">')
    return f"{header}\n{pre}{highlight_code(code, lang)}</pre>\n"


def _code_inline(self, tokens: Sequence[MdToken], idx: int, options: OptionsDict,
                 env: EnvType) -> str:  # fmt: skip
    code = html.escape(tokens[idx].content, quote=False)
    return f'<code style="background-color:{INLINE_CODE_BG};">{code}</code>'


def _link_open(self, tokens: Sequence[MdToken], idx: int, options: OptionsDict,
               env: EnvType) -> str:  # fmt: skip
    tokens[idx].attrSet("style", f"color:{theme.ACCENT};")  # Qt's default is the palette's blue
    return self.renderToken(tokens, idx, options, env)


def _image(self, tokens: Sequence[MdToken], idx: int, options: OptionsDict, env: EnvType) -> str:
    """A link to the image, never an <img>: the document must not fetch anything."""
    tok = tokens[idx]
    alt = self.renderInlineAsText(tok.children or [], options, env) or "image"
    src = html.escape(str(tok.attrGet("src") or ""))
    return f'<a href="{src}" style="color:{theme.ACCENT};">[image: {html.escape(alt)}]</a>'


def _table_open(self, tokens: Sequence[MdToken], idx: int, options: OptionsDict,
                env: EnvType) -> str:  # fmt: skip
    return (f'<table border="1" cellspacing="0" cellpadding="4" '
            f'style="border-collapse:collapse; border-color:{RULE}; margin-top:6px; '
            f'margin-bottom:6px;">\n')


def _cell_open(self, tokens: Sequence[MdToken], idx: int, options: OptionsDict,
               env: EnvType) -> str:  # fmt: skip
    """markdown-it writes alignment as CSS text-align; Qt's table cells read the align attribute."""
    tok = tokens[idx]
    style = str(tok.attrGet("style") or "")
    align = style.removeprefix("text-align:") if style.startswith("text-align:") else ""
    attrs = f' align="{html.escape(align)}"' if align else ""
    return f"<{tok.tag}{attrs}>"


def _blockquote_open(self, tokens: Sequence[MdToken], idx: int, options: OptionsDict,
                     env: EnvType) -> str:  # fmt: skip
    return f'<blockquote style="margin-left:16px; margin-right:0px; color:{theme.MUTED};">\n'


def _paragraph_open(self, tokens: Sequence[MdToken], idx: int, options: OptionsDict,
                    env: EnvType) -> str:  # fmt: skip
    if tokens[idx].hidden:  # a tight list's item: no paragraph of its own
        return ""
    return '<p style="margin-top:4px; margin-bottom:4px;">'


def _list_open(self, tokens: Sequence[MdToken], idx: int, options: OptionsDict,
               env: EnvType) -> str:  # fmt: skip
    """markdown-it puts a newline between a tight item's text and its nested list; Qt would show
    it as a trailing space of the item."""
    return self.renderToken(tokens, idx, options, env).lstrip("\n")


def _hr(self, tokens: Sequence[MdToken], idx: int, options: OptionsDict, env: EnvType) -> str:
    return "<hr />\n"


# --- code highlighting ---------------------------------------------------------------------

@lru_cache(maxsize=256)  # a streaming reply re-renders its finished code blocks every time
def highlight_code(code: str, lang: str) -> str:
    """`code` as HTML spans with inline colours; plain escaped text for an unknown language."""
    lexer = _lexer(lang.lower())
    if lexer is None:
        return html.escape(code, quote=False)
    out = highlight(code, lexer, _formatter())
    # the formatter ends its last line with a newline the code may not have: Qt would show it
    return out[:-1] if out.endswith("\n") and not code.endswith("\n") else out


@lru_cache(maxsize=64)
def _lexer(lang: str) -> Lexer | None:
    # no guessing for a missing name (a wrong guess colours prose like code); only pygments' own
    # lexers: an unknown name makes it scan every installed package's entry points (~300 ms, at
    # each partial name of a fence that is still streaming in: "p", "py", "pyt", ...)
    if lang not in _builtin_aliases():
        return None
    try:
        # keep the text exactly: no stripped or added newlines
        return get_lexer_by_name(lang, stripnl=False, ensurenl=False)
    except ClassNotFound:
        return None


@lru_cache(maxsize=1)
def _builtin_aliases() -> frozenset[str]:
    return frozenset(a for _, aliases, _, _ in get_all_lexers(plugins=False) for a in aliases)


@lru_cache(maxsize=1)
def _formatter() -> HtmlFormatter:
    return HtmlFormatter(noclasses=True, nowrap=True, style=CODE_STYLE)
