"""Files attached to a chat message: reading them into text, a rough token estimate, how they are
written into the message, and the warning shown when a message would not fit the model's context.

No widgets here (ui/chat/attachment_bar.py shows them). Two kinds are read:

- "text": any text or code file. UTF-8, with or without a BOM; a UTF-16 file with its BOM
  (Windows editors write those). Anything else falls back to Latin-1, which decodes every byte:
  a legacy 8-bit file (an old source file with accented comments) still attaches, with the odd
  character wrong. The fallback is taken only for bytes that look like text (no NUL byte, under 1%
  of control characters), so a binary file is refused instead of being read as noise.
- "pdf": text extracted page by page with pypdf, each page under a "[page i/n]" line. Scanned
  PDFs (images, no text layer) and password-protected ones are refused: there is no OCR here.
"""

from __future__ import annotations

import codecs
import io
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from app.conversations import model
from app.conversations.model import Message
from ipc.protocol import MAX_CLIENT_MESSAGE_BYTES

AttachmentKind = Literal["text", "pdf"]
ALLOWED_KINDS = "text or code files (UTF-8, UTF-16 with a BOM, or Latin-1) and PDFs"
MAX_FILE_BYTES = 16 << 20  # a PDF carries images and fonts: its file is far bigger than its text
# An engine request is at most MAX_CLIENT_MESSAGE_BYTES on the wire (the history, the sampling
# and this message included): one message's attached text takes at most half of it.
MAX_TEXT_BYTES = MAX_CLIENT_MESSAGE_BYTES // 2
CHARS_PER_TOKEN = 4  # BPE tokenizers average 3-5 characters of English or code per token
_CONTROL = bytes([*range(0, 9), 11, *range(14, 27), *range(28, 32), 127])  # tab, LF, FF, CR, ESC ok
_MAX_CONTROL_FRACTION = 0.01


class AttachmentError(ValueError):
    """A file that cannot be attached; the message names the file and why."""


@dataclass(slots=True)
class Attachment:
    name: str  # the file's name, without its folder
    text: str
    kind: AttachmentKind
    size: int  # the file's size in bytes
    tokens: int | None = None  # None until counted
    tokens_estimated: bool = False  # `tokens` is estimate_tokens' guess, not the tokenizer's count


def read_attachment(path: str | os.PathLike[str]) -> Attachment:
    """The file at `path` as an Attachment (tokens not yet counted); AttachmentError otherwise."""
    p = Path(path)
    name = p.name
    try:
        size = p.stat().st_size
        if p.is_dir():
            raise AttachmentError(f"{name} is a folder; attach {ALLOWED_KINDS}")
        if size > MAX_FILE_BYTES:
            raise AttachmentError(f"{name} is {_mib(size)}; a file can be at most "
                                  f"{_mib(MAX_FILE_BYTES)}")
        data = p.read_bytes()
    except OSError as exc:
        raise AttachmentError(f"{name} could not be read: {exc.strerror or exc}") from exc
    if data.startswith(b"%PDF-"):
        kind: AttachmentKind = "pdf"
        text = pdf_text(name, data)
    elif p.suffix.lower() == ".pdf":
        raise AttachmentError(f"{name} is named .pdf but is not a PDF (no %PDF- header)")
    else:
        kind = "text"
        text = decode_text(name, data)
    check_text_size(name, text)
    return Attachment(name=name, text=text, kind=kind, size=len(data))


def decode_text(name: str, data: bytes) -> str:
    """The bytes of a text file as text (module docstring: the encodings tried, and why)."""
    for bom, encoding in ((codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16")):
        if data.startswith(bom):  # before the NUL test: UTF-16 is full of NUL bytes
            try:
                return data.decode(encoding)
            except UnicodeDecodeError as exc:
                raise _binary(name, "broken UTF-16") from exc
    if b"\0" in data:
        raise _binary(name, "it holds NUL bytes")
    controls = len(data) - len(data.translate(None, _CONTROL))
    if controls > _MAX_CONTROL_FRACTION * len(data):
        raise _binary(name, f"{controls:,} of its {len(data):,} bytes are control characters")
    try:
        return data.decode("utf-8-sig")  # strips a UTF-8 BOM when there is one
    except UnicodeDecodeError:
        return data.decode("latin-1")


def _binary(name: str, why: str) -> AttachmentError:
    return AttachmentError(f"{name} looks like a binary file ({why}); attach {ALLOWED_KINDS}")


def pdf_text(name: str, data: bytes) -> str:
    """The text of a PDF, page by page, each under a "[page i/n]" line; AttachmentError for an
    encrypted PDF, one without extractable text, or one pypdf cannot parse."""
    from pypdf import PdfReader  # only when a PDF is attached: the window starts without it

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not _opens_without_password(name, reader):
            raise AttachmentError(f"{name} is password-protected; remove the password (print it "
                                  "to a new PDF) and attach that copy")
        pages: list[str] = []
        n = len(reader.pages)
        total = 0
        for i, page in enumerate(reader.pages, 1):
            text = (page.extract_text() or "").strip()
            total += len(text.encode("utf-8"))
            if total > MAX_TEXT_BYTES:  # stop early: a 1,000-page PDF need not be read to refuse it
                raise _too_much_text(name, total, f" by page {i} of {n}")
            pages.append(f"[page {i}/{n}]\n{text}")
    except AttachmentError:
        raise
    except Exception as exc:  # pypdf fails in many ways (PyPdfError, KeyError, ...) on a broken PDF
        raise AttachmentError(f"{name} could not be read as a PDF: {exc}") from exc
    if total == 0:
        raise AttachmentError(f"{name} has no extractable text ({n} page(s) of images or "
                              "drawings, e.g. a scan); KVScope does not read text from images")
    return "\n\n".join(pages)


def _opens_without_password(name: str, reader) -> bool:
    """Many PDFs are encrypted only to restrict printing or copying: the empty password opens
    them. False when a real password is needed."""
    from pypdf import PasswordType
    from pypdf.errors import DependencyError

    try:
        return reader.decrypt("") != PasswordType.NOT_DECRYPTED
    except DependencyError as exc:  # AES needs the `cryptography` package
        raise AttachmentError(f"{name} is encrypted with AES, which needs the 'cryptography' "
                              f"package to read: {exc}") from exc


def check_text_size(name: str, text: str) -> None:
    """AttachmentError when `text` is more than one message may carry (MAX_TEXT_BYTES)."""
    n = len(text.encode("utf-8"))
    if n > MAX_TEXT_BYTES:
        raise _too_much_text(name, n)


def _too_much_text(name: str, n: int, where: str = "") -> AttachmentError:
    return AttachmentError(f"{name} holds {_kib(n)} of text{where}; a message can carry at most "
                           f"{_kib(MAX_TEXT_BYTES)} of attached text")


def check_total(attachments: Iterable[Attachment], new: Attachment) -> None:
    """AttachmentError when adding `new` puts the message's attached text past MAX_TEXT_BYTES."""
    total = sum(len(a.text.encode("utf-8")) for a in (*attachments, new))
    if total > MAX_TEXT_BYTES:
        raise AttachmentError(f"{new.name} would make {_kib(total)} of attached text; a message "
                              f"can carry at most {_kib(MAX_TEXT_BYTES)}")


def estimate_tokens(text: str) -> int:
    """A rough token count (CHARS_PER_TOKEN characters a token, rounded up), for when no
    tokenizer is reachable: a remote HTTP server, the demo, no engine yet. Real counts differ by
    tens of percent (code and non-English text take more tokens per character)."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def attachment_block(a: Attachment) -> str:
    """How an attachment is written into the message the model sees (its tokens are counted on
    this text, so the count is what the message costs)."""
    return model.attachment_block(a.name, a.text)


def to_message(typed: str, attachments: Iterable[Attachment]) -> Message:
    """The user turn: the typed text, the files kept beside it (shown as chips, sent after the
    text by `Message.prompt_text`)."""
    return Message("user", typed.strip(), attachments=[
        {"name": a.name, "text": a.text, "tokens": a.tokens} for a in attachments])


def context_warning(history_tokens: int, attachment_tokens: int, typed_tokens: int,
                    max_tokens: int, max_model_len: int) -> str | None:
    """None when the history, the new message and the reply's budget fit the model's context;
    else one sentence with every number and what to do about it."""
    for field, value in (("history_tokens", history_tokens),
                         ("attachment_tokens", attachment_tokens),
                         ("typed_tokens", typed_tokens), ("max_tokens", max_tokens)):
        if value < 0:
            raise ValueError(f"{field} must be >= 0, got {value}")
    if max_model_len <= 0:
        raise ValueError(f"max_model_len must be > 0, got {max_model_len}")
    prompt = history_tokens + attachment_tokens + typed_tokens
    total = prompt + max_tokens
    if total <= max_model_len:
        return None
    parts = [f"{history_tokens:,} history", f"{attachment_tokens:,} attached",
             f"{typed_tokens:,} typed"]
    if prompt >= max_model_len:  # no reply budget would help
        fix = "remove an attachment or start a new chat" if attachment_tokens else (
            "shorten the message or start a new chat")
    else:
        fix = (f"lower the reply's max tokens to {max_model_len - prompt:,}, "
               + ("remove an attachment" if attachment_tokens else "shorten the message")
               + " or start a new chat")
    return (f"This message would need {prompt:,} prompt tokens ({' + '.join(parts)}) + "
            f"{max_tokens:,} for the reply = {total:,}, past the model's context of "
            f"{max_model_len:,} tokens; {fix}.")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _kib(n: int) -> str:
    return f"{n / 1024:,.0f} KiB"
