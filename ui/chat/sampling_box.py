"""The chat's sampling controls: temperature, top-p, top-k, max tokens, seed.

Each conversation keeps its own values (`Conversation.sampling`); the box shows the current
conversation's and says when they change so the panel can save them with it.
"""

from __future__ import annotations

from dataclasses import asdict, fields

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QDoubleSpinBox, QFormLayout, QGroupBox, QSpinBox, QWidget

from app.settings import SamplingDefaults


class SamplingBox(QGroupBox):
    changed = Signal()

    def __init__(self, defaults: SamplingDefaults, parent: QWidget | None = None) -> None:
        super().__init__("Sampling", parent)
        self.defaults = defaults
        form = QFormLayout(self)
        form.setContentsMargins(6, 10, 6, 4)
        form.setVerticalSpacing(2)
        self.temperature = QDoubleSpinBox(decimals=2, minimum=0.0, maximum=2.0, singleStep=0.05)
        self.temperature.setToolTip("0 = greedy")
        self.top_p = QDoubleSpinBox(decimals=2, minimum=0.01, maximum=1.0, singleStep=0.05)
        self.top_k = QSpinBox(minimum=0, maximum=100000)
        self.top_k.setSpecialValueText("off")
        self.max_tokens = QSpinBox(minimum=1, maximum=32768)
        self.seed = QSpinBox(minimum=-1, maximum=2**31 - 1)
        self.seed.setSpecialValueText("random")
        for name, w in (("temperature", self.temperature), ("top-p", self.top_p),
                        ("top-k", self.top_k), ("max tokens", self.max_tokens),
                        ("seed", self.seed)):
            form.addRow(name, w)
            w.valueChanged.connect(lambda _v: self.changed.emit())
        self.set_values(defaults)

    def values(self) -> SamplingDefaults:
        return SamplingDefaults(
            temperature=self.temperature.value(), top_p=self.top_p.value(),
            top_k=self.top_k.value(), max_tokens=self.max_tokens.value(), seed=self.seed.value())

    def set_values(self, s: SamplingDefaults) -> None:
        """Show `s` without announcing a change (it is the conversation's own)."""
        widgets = (self.temperature, self.top_p, self.top_k, self.max_tokens, self.seed)
        for w in widgets:
            w.blockSignals(True)
        self.temperature.setValue(s.temperature)
        self.top_p.setValue(s.top_p)
        self.top_k.setValue(s.top_k)
        self.max_tokens.setValue(s.max_tokens)
        self.seed.setValue(s.seed)
        for w in widgets:
            w.blockSignals(False)

    def set_from_dict(self, saved: dict) -> None:
        """A conversation's saved settings over the app's defaults; unknown or ill-typed keys
        (a file from another version) fall back to the default."""
        base = asdict(self.defaults)
        for f in fields(SamplingDefaults):
            v = saved.get(f.name)
            if isinstance(v, int | float) and not isinstance(v, bool):
                base[f.name] = type(base[f.name])(v)
        self.set_values(SamplingDefaults(**base))

    def to_dict(self) -> dict:
        return asdict(self.values())
