"""Speculative decoding on the block map: the slots that held a request's drafts in its last
speculative step, and those whose K/V was rolled back because the target model rejected the
draft, shown for one frame (the engine reports a step once, in the next snapshot).

A frame's RequestView carries the step: drafts at positions draft_start.., the physical block of
each slot (draft_blocks, noted before the rollback freed any), the first draft_accepted confirmed.
The map marks whole blocks (a hatched outline: drafted; a red cross: rolled back; shapes, since
the cells' colours already name requests); the detail pane draws the selected request's slots,
one character each."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QBrush, QColor

from ui import theme
from ui.telemetry import Frame, RequestView

SLOT_KV, SLOT_CONFIRMED, SLOT_ROLLED_BACK, SLOT_EMPTY = "█", "▒", "x", "·"
SLOT_LEGEND = (f"{SLOT_KV} K/V  {SLOT_CONFIRMED} confirmed draft  {SLOT_ROLLED_BACK} rolled back"
               f"  {SLOT_EMPTY} empty")  # fmt: skip


@dataclass(slots=True)
class SpecMarks:
    """Blocks touched by the frame's speculative steps (any request)."""

    drafted: set[int] = field(default_factory=set)  # held a draft's slot
    rolled_back: set[int] = field(default_factory=set)  # held a rejected draft's slot


def rolled_back_positions(r: RequestView) -> range:
    """The positions whose drafts the target rejected: their K/V was forgotten."""
    return range(r.draft_start + r.draft_accepted, r.draft_start + len(r.draft_blocks))


def spec_marks(f: Frame) -> SpecMarks:
    marks = SpecMarks()
    for r in f.requests:
        if r.draft_blocks and r.status != "finished":
            marks.drafted.update(r.draft_blocks)
            marks.rolled_back.update(r.draft_blocks[r.draft_accepted :])
    return marks


def slot_strip(r: RequestView, logical: int, block_size: int) -> str:
    """Logical block `logical` of r, a character per slot."""
    confirmed = range(r.draft_start, r.draft_start + r.draft_accepted)
    rejected = rolled_back_positions(r)
    out = []
    for p in range(logical * block_size, (logical + 1) * block_size):
        if p in rejected:
            out.append(SLOT_ROLLED_BACK)
        elif p in confirmed:
            out.append(SLOT_CONFIRMED)
        elif p < r.num_computed_tokens:
            out.append(SLOT_KV)
        else:
            out.append(SLOT_EMPTY)
    return "".join(out)


def drafted_logical_blocks(r: RequestView, block_size: int) -> dict[int, int]:
    """Logical block -> physical block, of the blocks r's last step wrote drafts to."""
    return {(r.draft_start + j) // block_size: b for j, b in enumerate(r.draft_blocks)}


def spec_lines(r: RequestView, block_size: int) -> list[str]:
    """The detail pane's summary of r's speculation (its table lines carry the slot strips),
    and the blocks the rollback freed, which its table no longer lists."""
    lines = []
    if r.num_draft_tokens:
        pct = r.num_accepted_tokens / r.num_draft_tokens * 100
        lines.append(f"speculation so far: drafts {r.num_accepted_tokens}/{r.num_draft_tokens} "
                     f"accepted ({pct:.0f}%)")  # fmt: skip
    if not r.draft_blocks:
        return lines
    k, a = len(r.draft_blocks), r.draft_accepted
    end = r.draft_start + k - 1
    lines.append(f"last speculative step: {k} draft{'s' if k != 1 else ''} at positions "
                 f"{r.draft_start}–{end}, {a} confirmed, {k - a} rolled back")  # fmt: skip
    lines.append(f"  slots: {SLOT_LEGEND}")
    table = r.block_table
    for logical, b in sorted(drafted_logical_blocks(r, block_size).items()):
        if logical >= len(table) or table[logical] != b:
            lines.append(f"{logical:5d} → {b:<8d}  {slot_strip(r, logical, block_size)}  freed: "
                         "only rolled-back drafts filled it")  # fmt: skip
    return lines


def table_strips(r: RequestView | None, block_size: int) -> dict[int, str]:
    """Physical block -> slot strip, for the table lines of the blocks r's last step drafted to."""
    if r is None or not r.draft_blocks:
        return {}
    return {b: slot_strip(r, logical, block_size)
            for logical, b in drafted_logical_blocks(r, block_size).items()}  # fmt: skip


def spec_tooltip(f: Frame, b: int) -> str:
    """Hover text for block b: the speculative steps that wrote drafts to it."""
    lines = []
    bs = f.block_size
    for r in f.requests:
        if b not in r.draft_blocks or r.status == "finished":
            continue
        slots = [r.draft_start + j for j, x in enumerate(r.draft_blocks) if x == b]
        rejected = [p for p in slots if p in rolled_back_positions(r)]
        line = f"drafts of {r.request_id}: {_slots(slots, bs)}"
        if rejected:
            line += f", {_slots(rejected, bs)} rolled back"
        lines.append(line)
    return "\n".join(lines)


def _slots(positions: list[int], block_size: int) -> str:
    """'slot 3' or 'slots 0–2': consecutive positions, as slots of their block."""
    first, last = positions[0] % block_size, positions[-1] % block_size
    return f"slot {first}" if first == last else f"slots {first}–{last}"


class SpecOverlay:
    """Two scatter items over the block map's image, made once: a hatched outline around each
    drafted block, a red cross over each rolled-back one (outlined dark, so that it stands out
    on a red request's cell too)."""

    def __init__(self, view_box: pg.ViewBox) -> None:
        draft = QColor(theme.SPEC_DRAFT)
        self.drafted = pg.ScatterPlotItem(
            pxMode=False, symbol="s", pen=pg.mkPen(draft, width=1.5),
            brush=QBrush(draft, Qt.BrushStyle.BDiagPattern))  # fmt: skip
        self.rolled_back = pg.ScatterPlotItem(
            pxMode=False, symbol="x", pen=pg.mkPen(theme.BG, width=1),
            brush=pg.mkBrush(theme.SPEC_ROLLBACK))  # fmt: skip
        for item in (self.drafted, self.rolled_back):
            item.setZValue(10)
            view_box.addItem(item)
        self.shown = SpecMarks()  # what is drawn (for tests)
        self._drawn: tuple | None = None

    def update(self, marks: SpecMarks, cols: int, cell: int, pitch: int, n: int) -> None:
        key = (marks.drafted, marks.rolled_back, cols, cell, pitch, n)
        if key == self._drawn:
            return
        self._drawn, self.shown = key, marks
        for item, blocks, size in ((self.drafted, marks.drafted, pitch),
                                   (self.rolled_back, marks.rolled_back, cell * 1.1)):
            bs = sorted(b for b in blocks if 0 <= b < n)
            x = [(b % cols) * pitch + cell / 2 for b in bs]
            y = [(b // cols) * pitch + cell / 2 for b in bs]
            item.setData(x=x, y=y, size=size)

    def clear(self) -> None:
        self.update(SpecMarks(), 1, 1, 1, 0)
