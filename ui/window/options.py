"""The window's *Engine → Decode weights* (with the decode arithmetic) and *Engine → KV cache*
menus (`window.option_menus`): options the engine starts with. A change is remembered in the
settings and restarts a spawned engine (asking first when replies are in flight); an attached
engine keeps what it was started with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtGui import QAction, QActionGroup
from PySide6.QtWidgets import QMenu

from app.supervisor import KV_CACHE_DTYPES, KV_DISK_SUBDIR, SPECULATIVE_TOKEN_CHOICES
from ui.units import short_bytes
from ui.window.host import WindowHost

DECODE_WEIGHT_CHOICES = (
    ("auto", "Automatic (4-bit on a CPU, dense on a GPU)",
     "what the app starts with unless told otherwise"),
    ("dense", "Dense (the model's own precision)", "exact; prompts and decode on full weights"),
    ("int4", "4-bit for decode (faster on CPU)",
     "4-bit copies of the linear layers for steps of up to 16 tokens: ~2x faster replies on a "
     "CPU; the default model's own Q4_1 codes, activations in bf16"),
)
# the second group of *Decode weights*: the fused step's arithmetic (decode_activations)
DECODE_ACTIVATION_CHOICES = (
    ("auto", "Automatic (8-bit activations where our CPU kernels run)",
     "what the app starts with: 8-bit activations where our 4-bit kernels run (measured 1.7x "
     "faster on AVX2, 1.0-1.1x on AVX-512, and as close to the full-precision model as "
     "llama.cpp is), exact arithmetic elsewhere"),
    ("exact", "Exact arithmetic",
     "float32 activations for one reply or a few: replies are the 4-bit model's own"),
    ("int8", "8-bit activations (llama.cpp's arithmetic, faster)",
     "activations quantized to 8 bits per group of 32 in every decode step, as llama.cpp does: "
     "1.6-1.7x faster replies measured on an AVX2 CPU; replies leave the exact ones where two "
     "tokens were nearly tied"),
)
MIB, GIB = 1 << 20, 1 << 30
# Engine → KV cache: (value, label, tooltip) per exclusive group.
KV_DTYPE_CHOICES = (
    ("auto", "Automatic (the model's dtype; fp16 beside 4-bit decode)",
     "K and V kept in the model's own element type, except float16 when a float32 model decodes "
     "on 4-bit weights on an AVX-512 bf16 CPU: half the bytes, as llama.cpp keeps them"),
    ("fp32", "fp32 (exact beside 4-bit decode)",
     "float32 K and V whatever the model's type (CPU): 4 bytes per value"),
    ("fp16", "fp16 (half the bytes of fp32)",
     "float16 K and V whatever the model's type (CPU): the fused decode step reads them at "
     "twice the speed of float32 ones"),
    ("int8", "int8 (about half the bytes per token)",
     "int8 K and V with a float16 scale per token and KV head: about twice the tokens in the "
     "same pool, a small loss of precision"),
    ("fp8", "fp8 e4m3 (half the bytes per token of bf16)",
     "float8 e4m3 K and V with one scale per layer, set when the engine starts: the bytes of "
     "int8 without its scales, but less precise (mean KL divergence 1e-2 against the float32 "
     "cache on the default model; int8 7e-4)"),
)
KV_HOST_CHOICES = (
    (0, "Off", "evicted prefix blocks are gone"),
    (256 * MIB, "256 MiB", ""),
    (1 * GIB, "1 GiB", ""),
    (4 * GIB, "4 GiB", ""),
)
KV_DISK_CHOICES = (
    (0, "Off", "no KV blocks on disk"),
    (1 * GIB, "1 GiB", ""),
    (8 * GIB, "8 GiB", ""),
)
SPEC_CHOICES = (
    (0, "Off", "one token per step per reply"),
    (2, "Up to 2 draft tokens", "propose up to 2 tokens (by prompt lookup, or from the draft "
     "model), verified in one forward pass of the model: exact; each reply drafts more after "
     "its drafts were right and fewer after they were not"),
    (4, "Up to 4 draft tokens", "as above with up to 4"),
    (8, "Up to 8 draft tokens", "as above with up to 8: more to gain where drafts are often "
     "right in long runs (replies that repeat their input, a good draft model)"),
)
assert tuple(c[0] for c in SPEC_CHOICES) == SPECULATIVE_TOKEN_CHOICES
KV_HOST_TIP = ("prefix blocks evicted from the KV pool are kept in this much host memory and "
               "loaded back instead of recomputed")
KV_DISK_TIP = ("prefix blocks are written to files in the data directory (kv-cache), which a "
               "restarted engine finds again")




class EngineOptionMenus:
    """Builds the two menus, validates and applies their choices."""

    def __init__(self, window: WindowHost) -> None:
        self.w = window
        self.kv_menu: QMenu | None = None
        self.kv_actions: dict[str, dict[object, QAction]] = {}
        self.spec_actions: dict[object, QAction] = {}
        self.activation_actions: dict[object, QAction] = {}

    # --- decode weights ------------------------------------------------------------------------
    def add_decode_weights_menu(self, menu: QMenu) -> tuple[QMenu, dict[str, QAction]]:
        w = self.w
        weights = menu.addMenu("&Decode weights")
        actions = self._radio_group(weights, DECODE_WEIGHT_CHOICES, w.set_decode_weights)
        current = w.source.options.decode_weights or "dense"
        actions.get(current, actions["dense"]).setChecked(True)
        weights.addSeparator()
        self.activation_actions = self._radio_group(weights, DECODE_ACTIVATION_CHOICES,
                                                    self.set_decode_activations)  # fmt: skip
        # None: no flag, the engine's own default (the app always passes one: auto unless told)
        choice = w.source.options.decode_activations or "exact"
        self.activation_actions.get(choice, self.activation_actions["exact"]).setChecked(True)
        return weights, actions  # type: ignore[return-value]

    def _radio_group(
        self, menu: QMenu, choices: tuple, on_choose: Callable[[object], None]
    ) -> dict[object, QAction]:
        """Exclusive checkable actions (value, label, tooltip) in `menu`; picking one calls
        on_choose(value). Returns {value: action}."""
        w = self.w
        menu.setToolTipsVisible(True)
        group = QActionGroup(w)
        actions: dict[object, QAction] = {}
        for value, label, tip in choices:
            action = QAction(label, w, checkable=True)
            action.setToolTip(tip)
            action.setData(value)
            group.addAction(action)
            menu.addAction(action)
            actions[value] = action
        group.triggered.connect(lambda a: on_choose(a.data()))
        return actions

    def set_decode_weights(self, value: str) -> None:
        actions = self.w.decode_weight_actions
        if value not in actions:
            raise ValueError(f"decode weights must be one of {list(actions)}")
        if value == (self.w.source.options.decode_weights or "dense"):
            self.sync_option_menus()
            return
        self.change_options("the decode weights", {"decode_weights": value},
                            {"engine/decode_weights": value})

    def set_decode_activations(self, value: str) -> None:
        if value not in self.activation_actions:
            raise ValueError(f"decode activations must be one of {list(self.activation_actions)}")
        if value == (self.w.source.options.decode_activations or "exact"):
            self.sync_option_menus()
            return
        self.change_options("the decode arithmetic", {"decode_activations": value},
                            {"engine/decode_activations": value})

    # --- KV cache --------------------------------------------------------------------------------
    def add_kv_cache_menu(self, menu: QMenu) -> tuple[QMenu, dict[str, dict[object, QAction]]]:
        """*KV cache* with three exclusive groups (submenus): element type, host memory tier,
        disk tier. Returns the menu and {"dtype" | "host" | "disk": {value: action}}."""
        w = self.w
        kv = menu.addMenu("&KV cache")
        kv.setToolTipsVisible(True)
        current = self.kv_choice()
        groups: dict[str, dict[object, QAction]] = {}
        for key, title, tip, choices, setter in (
            ("dtype", "&Element type", "", KV_DTYPE_CHOICES, w.set_kv_cache_dtype),
            ("host", "&Host memory tier", KV_HOST_TIP, KV_HOST_CHOICES, w.set_kv_host_memory),
            ("disk", "&Disk tier (survives restarts)", KV_DISK_TIP, KV_DISK_CHOICES,
             w.set_kv_disk_bytes),
        ):
            sub = kv.addMenu(title)
            sub.menuAction().setToolTip(tip)
            value = current[key]
            if isinstance(value, int) and value not in {c[0] for c in choices}:
                choices = (*choices, (value, short_bytes(value), "from settings"))
            groups[key] = self._radio_group(sub, choices, setter)
        self.kv_menu = kv
        self.kv_actions = groups
        self.sync_option_menus()
        return kv, groups

    def kv_choice(self) -> dict[str, object]:
        """What the next spawned engine gets: {"dtype": str, "host": bytes, "disk": bytes}."""
        o = self.w.source.options
        return {
            "dtype": o.kv_cache_dtype or "auto",
            "host": o.kv_host_memory or 0,
            "disk": (o.kv_disk_bytes or 0) if o.kv_disk_dir else 0,
        }

    def set_kv_cache_dtype(self, value: str) -> None:
        if value not in KV_CACHE_DTYPES:
            raise ValueError(f"KV cache element type must be one of {list(KV_CACHE_DTYPES)}")
        now = self.kv_choice()
        if value == now["dtype"]:
            self.sync_option_menus()
            return
        self.change_options("the KV cache element type", {"kv_cache_dtype": value},
                            {"engine/kv_cache_dtype": value})

    def set_kv_host_memory(self, nbytes: int) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"host memory tier must be an integer >= 0 (bytes), got {nbytes!r}")
        self.change_options("the host memory tier", {"kv_host_memory": nbytes or None},
                            {"engine/kv_host_memory": nbytes})

    def set_kv_disk_bytes(self, nbytes: int) -> None:
        w = self.w
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"disk tier must be an integer >= 0 (bytes), got {nbytes!r}")
        directory = w.source.options.kv_disk_dir
        if nbytes and directory is None:
            if w.data_dir is None:
                raise ValueError("the disk tier needs the app's data directory; this window has "
                                 "none")
            directory = str(w.data_dir / KV_DISK_SUBDIR)
        self.change_options("the disk tier",
                            {"kv_disk_bytes": nbytes or None,
                             "kv_disk_dir": directory if nbytes else None},
                            {"engine/kv_disk_bytes": nbytes})

    # --- speculative decoding -------------------------------------------------------------------
    def add_speculative_menu(self, menu: QMenu) -> tuple[QMenu, dict[object, QAction]]:
        """*Speculative decoding*: off or n-gram proposals of 2, 4 or 8 tokens (the engine's
        --speculative-config); the status bar's counters line shows how many were accepted."""
        spec = menu.addMenu("&Speculative decoding")
        actions = self._radio_group(spec, SPEC_CHOICES, self.w.set_speculative_tokens)
        actions[self.w.source.options.speculative_tokens or 0].setChecked(True)
        self.spec_actions = actions
        self._add_proposer_actions(spec)
        return spec, actions

    def _add_proposer_actions(self, spec: QMenu) -> None:
        w = self.w
        spec.addSeparator()
        group = QActionGroup(w)
        ngram = self.ngram_action = QAction("Prompt lookup (n-gram)", w, checkable=True)
        ngram.setToolTip("drafts are the tokens that followed the last match of the reply's "
                         "recent tokens in its prompt or output: no second model")
        draft = self.draft_action = QAction("Draft model…", w, checkable=True)
        draft.setToolTip("a smaller model with the same tokenizer proposes the drafts "
                         "(e.g. a 135M model of the chat model's family)")
        for action in (ngram, draft):
            group.addAction(action)
            spec.addAction(action)
        ngram.triggered.connect(lambda: self.set_draft_model(None))
        draft.triggered.connect(self.choose_draft_model)
        self.draft_dialog = None
        self._sync_proposer()

    def choose_draft_model(self) -> None:
        """The Models dialog, its button a choice of draft model instead of a load."""
        from ui.models.dialog import ModelsDialog

        w = self.w
        o = w.source.options
        dialog = self.draft_dialog = ModelsDialog(w.settings, w, o.kv_cache_dtype or "auto",
                                                  o.dtype or "float32", o.draft_model)  # fmt: skip
        dialog.setWindowTitle("Draft model")
        dialog.load_button.setText("Use as draft model")
        dialog.load_requested.connect(self.set_draft_model)
        dialog.rejected.connect(self.sync_option_menus)
        dialog.show()
        dialog.refresh()

    def set_draft_model(self, chosen: str | None) -> None:
        """Propose with the model at `chosen` (a .gguf or an HF folder), or by prompt lookup
        (None); speculation that was off turns on at 4 draft tokens."""
        from ui.window.models_menu import model_path

        path = None if chosen is None else model_path(chosen)  # ValueError: not a model
        changes: dict[str, object] = {"draft_model": path}
        persist: dict[str, object] = {"engine/draft_model": path or ""}
        note = ""
        if path is not None and not self.w.source.options.speculative_tokens:
            changes["speculative_tokens"] = 4
            persist["engine/speculative_tokens"] = 4
            note = "speculative decoding turned on with up to 4 draft tokens"
        self.change_options("the draft model", changes, persist, note)

    def _sync_proposer(self) -> None:
        if not hasattr(self, "draft_action"):
            return
        path = self.w.source.options.draft_model
        self.draft_action.setText(f"Draft model: {Path(path).name}…" if path
                                  else "Draft model…")  # fmt: skip
        (self.draft_action if path else self.ngram_action).setChecked(True)

    def set_speculative_tokens(self, k: int) -> None:
        if k not in SPECULATIVE_TOKEN_CHOICES:
            raise ValueError(f"speculative tokens must be one of {list(SPECULATIVE_TOKEN_CHOICES)}"
                             f", got {k!r}")
        self.change_options("speculative decoding", {"speculative_tokens": k},
                            {"engine/speculative_tokens": k})

    # --- options the engine starts with ----------------------------------------------------------
    def change_options(self, what: str, changes: dict[str, object], persist: dict[str, object],
                       note: str = "") -> bool:
        """Set EngineOptions fields (`changes`) and settings (`persist`), then restart a spawned
        engine with them, asking first when replies are in flight; an attached engine is left
        as it is (the choice applies to engines this app starts). `note` (why another choice
        changed too) goes to the status bar. Returns whether anything changed."""
        w = self.w
        opts = w.source.options
        if all(getattr(opts, k) == v for k, v in changes.items()):
            self.sync_option_menus()
            return False
        in_flight = len(w.chat.active)
        if in_flight and not w.source.connect and not w.confirm_restart(in_flight, what):
            self.sync_option_menus()
            return False
        for k, v in changes.items():
            setattr(opts, k, v)
        for k, v in persist.items():
            w.settings.setValue(k, v)
        self.sync_option_menus()
        if w.source.connect:
            w.statusBar().showMessage(
                f"Changed {what}: this applies to engines this app starts; the attached one is "
                "unchanged" + (f" ({note})" if note else ""), 10000)
            return True
        if note:
            w.statusBar().showMessage(note, 10000)
        w.lifecycle.restart()
        return True

    def sync_option_menus(self) -> None:
        """Check the menu entries that match the options the next engine starts with."""
        w = self.w
        actions = getattr(w, "decode_weight_actions", None)
        if actions:
            current = w.source.options.decode_weights or "dense"
            actions.get(current, actions["dense"]).setChecked(True)
        choice = w.source.options.decode_activations or "exact"
        activation = self.activation_actions.get(choice)
        if activation is not None:
            activation.setChecked(True)
        spec = getattr(self, "spec_actions", {}).get(w.source.options.speculative_tokens or 0)
        if spec is not None:
            spec.setChecked(True)
        self._sync_proposer()
        for key, value in self.kv_choice().items():
            action = self.kv_actions.get(key, {}).get(value)
            if action is not None:
                action.setChecked(True)
