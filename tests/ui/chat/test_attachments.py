"""Reading attachments (text, code, BOMs, Latin-1, binary, oversize, PDFs), the token estimate, how
they go into the message, and the context-length warning's numbers."""

from __future__ import annotations

import codecs

import pytest

from tests.ui.chat.pdfs import blank_pdf, encrypted, pdf_with_text
from ui.chat.attachments import (
    MAX_FILE_BYTES,
    MAX_TEXT_BYTES,
    Attachment,
    AttachmentError,
    attachment_block,
    check_total,
    context_warning,
    estimate_tokens,
    read_attachment,
    to_message,
)

CODE = 'def area(r: float) -> float:\n    """π r²"""\n    return 3.14159 * r * r  # café\n'


def test_text_and_code_files_are_read_as_utf8(tmp_path):
    f = tmp_path / "area.py"
    f.write_text(CODE, encoding="utf-8")
    a = read_attachment(f)
    assert a == Attachment(name="area.py", text=CODE, kind="text", size=len(CODE.encode()))
    assert a.tokens is None and not a.tokens_estimated
    (tmp_path / "Makefile").write_text("all:\n\techo hi\n")  # no suffix, tabs: still text
    assert read_attachment(tmp_path / "Makefile").text == "all:\n\techo hi\n"


def test_boms_are_stripped(tmp_path):
    f = tmp_path / "bom.txt"
    f.write_bytes(codecs.BOM_UTF8 + "naïve\n".encode())
    assert read_attachment(f).text == "naïve\n"
    for bom, enc in ((codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be")):
        f.write_bytes(bom + "naïve ✓\n".encode(enc))  # NUL bytes everywhere, but text
        assert read_attachment(f).text == "naïve ✓\n"


def test_latin1_falls_back_for_textual_bytes(tmp_path):
    f = tmp_path / "legacy.c"
    f.write_bytes("/* résumé */\nint x;\n".encode("latin-1"))  # not valid UTF-8
    assert read_attachment(f).text == "/* résumé */\nint x;\n"


@pytest.mark.parametrize("data, why", [
    (b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)), "NUL bytes"),
    (bytes(range(1, 32)) * 40 + b"text", "control characters"),
])
def test_binary_files_are_refused(tmp_path, data, why):
    f = tmp_path / "prog.bin"
    f.write_bytes(data)
    with pytest.raises(AttachmentError) as exc:
        read_attachment(f)
    msg = str(exc.value)
    assert "prog.bin" in msg and why in msg and "text or code files" in msg and "PDF" in msg


def test_oversize_files_and_texts_are_refused_with_the_numbers(tmp_path):
    big = tmp_path / "huge.log"
    with open(big, "wb") as fh:
        fh.truncate(MAX_FILE_BYTES + 1)  # sparse: not read, refused on its size
    with pytest.raises(AttachmentError, match=r"huge\.log is 16\.0 MiB; .* at most 16\.0 MiB"):
        read_attachment(big)
    long = tmp_path / "long.txt"
    long.write_text("x" * (MAX_TEXT_BYTES + 1024))
    with pytest.raises(AttachmentError, match=r"long\.txt holds 513 KiB of text; .* 512 KiB"):
        read_attachment(long)
    half = Attachment(name="half.txt", text="y" * (MAX_TEXT_BYTES // 2 + 1), kind="text", size=0)
    check_total([], half)
    with pytest.raises(AttachmentError, match=r"half\.txt would make 512 KiB .* at most 512 KiB"):
        check_total([half], half)


def test_missing_files_and_folders(tmp_path):
    with pytest.raises(AttachmentError, match="gone.txt could not be read"):
        read_attachment(tmp_path / "gone.txt")
    with pytest.raises(AttachmentError, match=r"is a folder; attach text or code files"):
        read_attachment(tmp_path)


def test_pdf_text_is_extracted_page_by_page(tmp_path):
    f = tmp_path / "paper.pdf"
    data = pdf_with_text(["Paged attention stores KV in blocks", "Prefix caching shares them"])
    f.write_bytes(data)
    a = read_attachment(f)
    assert a.kind == "pdf" and a.size == len(data) and a.name == "paper.pdf"
    assert a.text == ("[page 1/2]\nPaged attention stores KV in blocks\n\n"
                      "[page 2/2]\nPrefix caching shares them")


def test_encrypted_pdfs(tmp_path):
    f = tmp_path / "secret.pdf"
    f.write_bytes(encrypted(pdf_with_text(["classified"]), user_password="hunter2"))
    with pytest.raises(AttachmentError, match=r"secret\.pdf is password-protected"):
        read_attachment(f)
    # encrypted only against editing (empty user password): opens like any PDF
    f.write_bytes(encrypted(pdf_with_text(["readable"]), user_password=""))
    assert read_attachment(f).text == "[page 1/1]\nreadable"


def test_pdfs_without_text_or_broken_are_refused(tmp_path):
    f = tmp_path / "scan.pdf"
    f.write_bytes(blank_pdf())
    with pytest.raises(AttachmentError, match=r"scan\.pdf has no extractable text \(1 page"):
        read_attachment(f)
    f.write_bytes(b"%PDF-1.4\nnot really")
    with pytest.raises(AttachmentError, match=r"scan\.pdf could not be read as a PDF"):
        read_attachment(f)
    g = tmp_path / "fake.pdf"
    g.write_text("just text")
    with pytest.raises(AttachmentError, match=r"fake\.pdf is named \.pdf but is not a PDF"):
        read_attachment(g)


def test_estimate_and_message():
    assert estimate_tokens("") == 0
    assert estimate_tokens("abcd") == 1 and estimate_tokens("abcde") == 2
    a = Attachment(name="a.txt", text="alpha", kind="text", size=5)
    assert attachment_block(a) == "File: a.txt\n```\nalpha\n```"
    turn = to_message("  why?\n", [a])
    assert turn.content == "why?" and turn.prompt_text() == "why?\n\n" + attachment_block(a)
    assert to_message("hi", []).prompt_text() == "hi"


def test_context_warning_numbers():
    assert context_warning(1000, 2000, 500, 512, 4096) is None
    assert context_warning(0, 3584, 0, 512, 4096) is None  # exactly full fits
    msg = context_warning(1_000, 4_000, 210, 512, 4_096)
    assert msg == ("This message would need 5,210 prompt tokens (1,000 history + 4,000 attached + "
                   "210 typed) + 512 for the reply = 5,722, past the model's context of 4,096 "
                   "tokens; remove an attachment or start a new chat.")
    # the prompt fits, the reply budget does not: say how far to lower it
    msg = context_warning(100, 3_000, 20, 2_000, 4_096)
    assert msg is not None and "= 5,120" in msg and "lower the reply's max tokens to 976" in msg
    msg = context_warning(4_000, 0, 200, 16, 4_096)
    assert msg is not None and msg.endswith("shorten the message or start a new chat.")
    with pytest.raises(ValueError, match="typed_tokens must be >= 0, got -1"):
        context_warning(0, 0, -1, 1, 10)
    with pytest.raises(ValueError, match="max_model_len must be > 0, got 0"):
        context_warning(0, 0, 0, 1, 0)
