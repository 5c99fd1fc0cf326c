"""The main window's status bar: engine state, loading progress, the model and its KV pool (with
the `2 · L · H_kv · D · bytes` formula, int8's scales, the lower KV tiers' sizes) and a line with
the tiers' blocks and hits, the OpenAI API's URL and load, and in orange what a server watched
over HTTP does not report."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QProgressBar, QStatusBar

from app.remote.probe import METRIC_LABELS, ServerInfo
from app.remote.samples import MetricSample
from ui import theme
from ui.units import human_bytes, short_bytes
from ui.window.api_server import OFF, SERVING, WAITING, ApiServer
from ui.window.decode_status import decode_status_text, decode_status_tip

STATE_COLOURS = {
    "starting": "#8a909c", "loading": "#f5a623", "ready": "#3cb44b", "busy": "#42d4f4",
    "not answering": "#f58231", "disconnected": "#e6194b", "stopped": "#8a909c",
}
# An int8 KV cache keeps a float16 scale per token, layer, K/V and KV head beside the int8 values
# (engine_proc/attention/kv_quant.py kv_int8_bytes_per_token).
INT8_SCALE_BYTES = 2
KV_DTYPE_TIPS = {
    "int8": "int8 K/V: 1 byte per value plus a float16 scale per token, layer, K/V and KV head",
    "fp8": "fp8 (e4m3) K/V: 1 byte per value; one float32 scale per layer for K and for V",
    "fp16": "float16 K/V: 2 bytes per value (the model computes in its own type)",
    "fp32": "float32 K/V: 4 bytes per value (the model computes in its own type)",
}


def kv_formula(model: object) -> str:
    """'KV/token 2·L·H_kv·D·bytes = 2·30·3·64·4 = 46,080 B'; with an int8 KV cache
    'KV/token int8 2·L·H_kv·(D·1 + 2 scale) = 2·30·3·(64·1 + 2) = 11,880 B', with fp8
    'KV/token fp8 2·L·H_kv·D·1 = 2·30·3·64·1 = 11,520 B'."""
    L, H, D = model.num_layers, model.num_kv_heads, model.head_dim  # noqa: N806
    if getattr(model, "kv_cache_dtype", "auto") == "int8":
        s = INT8_SCALE_BYTES
        if 2 * L * H * (D + s) != model.kv_bytes_per_token:  # another layout: just the total
            return f"KV/token int8 {model.kv_bytes_per_token:,} B"
        return (f"KV/token int8 2·L·H_kv·(D·1 + {s} scale) = 2·{L}·{H}·({D}·1 + {s}) = "
                f"{model.kv_bytes_per_token:,} B")
    if getattr(model, "kv_cache_dtype", "auto") == "fp8":  # per-layer scales: not per token
        return f"KV/token fp8 2·L·H_kv·D·1 = 2·{L}·{H}·{D}·1 = {model.kv_bytes_per_token:,} B"
    # bytes per value of the pool (the model's dtype, or a float pool of another type)
    b, rest = divmod(model.kv_bytes_per_token, 2 * L * H * D) if L * H * D else (0, 1)
    if rest or not b:
        return f"KV/token {model.kv_bytes_per_token:,} B"
    return f"KV/token 2·L·H_kv·D·bytes = 2·{L}·{H}·{D}·{b} = {model.kv_bytes_per_token:,} B"


def _group_fields(group: object) -> tuple[int | None, int]:
    """(window, number of layers) of a KVGroup (or its dict form)."""
    if isinstance(group, dict):
        return group.get("window"), len(group.get("layers") or [])
    return group.window, len(group.layers)


def _hybrid_split(model: object) -> tuple[int, int, int, int] | None:
    """(full layers, sliding layers, bytes per layer and token, window) of a hybrid KV cache
    (`ModelInfo.kv_groups` with sliding groups), or None."""
    groups = [_group_fields(g) for g in getattr(model, "kv_groups", None) or []]
    window = max((w or 0 for w, _ in groups), default=0)
    if not window or not model.num_layers:  # no sliding group (every block kept)
        return None
    per_layer, rest = divmod(model.kv_bytes_per_token, model.num_layers)
    if rest or not per_layer:
        return None
    full = sum(n for w, n in groups if w is None)
    return full, sum(n for w, n in groups if w is not None), per_layer, window


def hybrid_kv_formula(model: object) -> str:
    """'KV/token 2·L_full·H_kv·D·b + 2·L_sliding·H_kv·D·b = 2·3·1·256·4 + 2·15·1·256·4 =
    6,144 + 30,720 B (sliding: last 512 tokens)'; '' for a model with one group."""
    split = _hybrid_split(model)
    if split is None:
        return ""
    full_layers, sliding_layers, per_layer, window = split
    H, D = model.num_kv_heads, model.head_dim  # noqa: N806
    b, rest = divmod(per_layer, 2 * H * D) if H * D else (0, 1)
    values = (f"2·{full_layers}·{H}·{D}·{b} + 2·{sliding_layers}·{H}·{D}·{b} = "
              if b and not rest else "")  # fmt: skip
    return (f"KV/token 2·L_full·H_kv·D·b + 2·L_sliding·H_kv·D·b = {values}"
            f"{full_layers * per_layer:,} + {sliding_layers * per_layer:,} B "
            f"(sliding: last {window:,} tokens)")  # fmt: skip


def hybrid_chat_bytes(model: object, tokens: int) -> tuple[int, int] | None:
    """(bytes a chat of `tokens` holds in the hybrid cache, bytes it would hold contiguous), or
    None for a model with one group. Every full-attention block; the sliding layers' window,
    which may straddle one more block (engine_proc/core/kv_groups.py max_sliding_blocks)."""
    split = _hybrid_split(model)
    if split is None:
        return None
    full_layers, sliding_layers, per_layer, window = split
    bs = model.block_size
    blocks = -(-tokens // bs)
    held = (blocks * full_layers + min(blocks, -(-window // bs) + 1) * sliding_layers) * bs
    return held * per_layer, tokens * (full_layers + sliding_layers) * per_layer


def kv_tiers_text(model: object) -> str:
    """'host 1 GiB · disk 8 GiB' (the lower KV tiers that are on), or ''."""
    parts = []
    for name, field in (("host", "kv_host_bytes"), ("disk", "kv_disk_bytes")):
        n = getattr(model, field, 0) or 0
        if n:
            parts.append(f"{name} {short_bytes(n)}")
    return " · ".join(parts)


def tier_counters_text(c: dict[str, float]) -> str:
    """'host tier 12/4,096 blocks · 3 hits │ disk tier …' from telemetry counters
    (engine_proc/kv_store/tiers.py counters()), or '' when the engine has no lower tier."""
    parts = []
    for name in ("host", "disk"):
        total = c.get(f"kv_{name}_blocks_total")
        if total is None:
            continue
        text = (f"{name} tier {c.get(f'kv_{name}_blocks', 0):,.0f}/{total:,.0f} blocks · "
                f"{c.get(f'kv_{name}_hits', 0):,.0f} hits")
        if name == "disk" and not c.get("kv_disk_writable", 1):
            text += " (read-only)"
        parts.append(text)
    if parts and c.get("external_prefix_cache_queries"):
        parts.append(f"{c.get('external_prefix_cache_hits', 0):,.0f}/"
                     f"{c['external_prefix_cache_queries']:,.0f} looked-up tokens found")
    return " │ ".join(parts)


def spec_counters_text(c: dict[str, float]) -> str:
    """'speculation: 38/40 draft tokens accepted (95%) · by position 10 10 9 9' from vLLM's
    spec_decode counters in telemetry, or '' before the first draft."""
    drafted = c.get("spec_decode_num_draft_tokens", 0)
    if not drafted:
        return ""
    accepted = c.get("spec_decode_num_accepted_tokens", 0)
    text = f"speculation: {accepted:,.0f}/{drafted:,.0f} draft tokens accepted " \
           f"({100 * accepted / drafted:.0f}%)"
    prefix = "spec_decode_num_accepted_tokens_per_pos:"
    per_pos = sorted((int(k[len(prefix):]), v) for k, v in c.items() if k.startswith(prefix))
    if per_pos:
        text += " · by position " + " ".join(f"{v:,.0f}" for _, v in per_pos)
    return text


def missing_labels(missing: list[str]) -> list[str]:
    """Canonical metric names -> what the status bar says (hits and queries as one)."""
    out = []
    for name in missing:
        label = METRIC_LABELS.get(name, name)
        if name in ("prefix_queries", "prefix_hits"):
            label = "prefix-cache hit rate"
        if label not in out:
            out.append(label)
    return out


class StatusBarView:
    """The labels of a window's status bar and what they say; the window decides when."""

    def __init__(self, bar: QStatusBar) -> None:
        self.state_label = QLabel()
        self.progress = QProgressBar()
        self.progress.setMaximumWidth(180)
        self.progress.setRange(0, 100)
        self.progress.setVisible(False)
        self.progress_text = QLabel()
        self.model_label = QLabel()
        self.kv_label = QLabel()
        self.kv_label.setStyleSheet(f"color: {theme.MUTED};")
        self.tiers_label = QLabel()
        self.tiers_label.setStyleSheet(f"color: {theme.MUTED}; margin-right: 8px;")
        self.tiers_label.setToolTip(
            "the KV tiers below the pool (Engine → KV cache): blocks held / capacity and "
            "blocks loaded back instead of recomputed; then the prompt tokens looked up below "
            "the pool and how many were found")
        self.tiers_label.setVisible(False)
        self.decode_label = QLabel()
        self.decode_label.setStyleSheet(f"color: {theme.MUTED}; margin-right: 8px;")
        self.decode_label.setVisible(False)
        self.api_label = QLabel()
        self.api_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.api_label.setStyleSheet(f"color: {theme.ACCENT}; margin-left: 8px;")
        self.api_label.setToolTip("the OpenAI-compatible API (Engine → Serve OpenAI API…) and "
                                  "how many of the engine's requests came through it")
        self.api_label.setVisible(False)
        self.remote_label = QLabel()
        self.remote_label.setStyleSheet("color: #f5a623; margin-left: 8px;")
        self.remote_label.setWordWrap(False)
        self.remote_label.setToolTip("what this server's /metrics does not export: those charts "
                                     "say \"not reported by this server\" instead of showing 0")
        self.remote_label.setVisible(False)
        bar.addWidget(self.state_label)
        bar.addWidget(self.progress)
        bar.addWidget(self.progress_text)
        bar.addWidget(self.model_label)
        bar.addWidget(self.api_label)
        bar.addWidget(self.remote_label)
        bar.addPermanentWidget(self.decode_label)
        bar.addPermanentWidget(self.tiers_label)
        bar.addPermanentWidget(self.kv_label)

    def show_state(self, state: str, detail: str = "") -> None:
        col = STATE_COLOURS.get(state, theme.TEXT)
        self.state_label.setText(f'<b style="color:{col}">● {state}</b>'
                                 + (f" {detail}" if detail else ""))

    def start_progress(self) -> None:
        self.progress.setVisible(True)
        self.progress.setValue(0)

    def show_progress(self, frac: float, msg: str) -> None:
        self.progress.setVisible(True)
        self.progress.setValue(int(frac * 100))
        self.progress_text.setText(msg)

    def hide_progress(self) -> None:
        self.progress.setVisible(False)
        self.progress_text.setText("")

    def show_engine(self, m) -> None:
        """An engine's model_info (`Welcome.model`): what runs where, and its KV pool."""
        engine_bits = [m.name, m.architecture, m.device, m.dtype]
        if m.attention_backend:
            engine_bits.append(f"{m.attention_backend} attention")
        if m.decode_weights == "int4":
            engine_bits.append("int4 decode weights")
        if m.cuda_graph_sizes:
            engine_bits.append(f"CUDA graphs ≤{m.cuda_graph_sizes[-1]} seqs")
        self.model_label.setText(" · ".join(engine_bits))
        # a hybrid KV cache's page holds a group's layers, not all of them: the engine's figure
        total = (getattr(m, "kv_pool_bytes", 0)
                 or m.num_blocks * m.block_size * m.kv_bytes_per_token)  # fmt: skip
        tiers = kv_tiers_text(m)
        self.kv_label.setText(
            f"{m.num_blocks:,} blocks × {m.block_size} tokens · "
            f"{hybrid_kv_formula(m) or kv_formula(m)} · "
            f"KV pool {human_bytes(total)}" + (f" · KV tiers {tiers}" if tiers else "")
            + f" · max len {m.max_model_len:,}")
        tip = KV_DTYPE_TIPS.get(getattr(m, "kv_cache_dtype", "auto"), "")
        chat = hybrid_chat_bytes(m, m.max_model_len)
        if chat is not None:  # what releasing the sliding layers' blocks saves on a long chat
            tip = (f"hybrid KV cache: a {m.max_model_len:,}-token chat holds "
                   f"{human_bytes(chat[0])}, not {human_bytes(chat[1])} contiguous"
                   + (f"; {tip}" if tip else ""))  # fmt: skip
        self.kv_label.setToolTip(tip)

    def show_tiers(self, counters: dict[str, float]) -> None:
        """The lower KV tiers' line from the latest telemetry counters (hidden without tiers).
        Called with every frame batch: the label changes only when its text does."""
        text = " │ ".join(t for t in (tier_counters_text(counters),
                                       spec_counters_text(counters)) if t)
        if text != self.tiers_label.text():
            self.tiers_label.setText(text)
        if self.tiers_label.isHidden() == bool(text):
            self.tiers_label.setVisible(bool(text))

    def show_decode_step(self, step: str, detail: str) -> None:
        """Which CPU decode step runs and why (hidden for engines without one); called with
        every frame batch: the label changes only when its text does."""
        text = decode_status_text(step, detail)
        if text != self.decode_label.text():
            self.decode_label.setText(text)
            self.decode_label.setToolTip(decode_status_tip(step))
        if self.decode_label.isHidden() == bool(text):
            self.decode_label.setVisible(bool(text))

    def show_server(self, info: ServerInfo, s: MetricSample | None) -> None:
        """A server without per-block telemetry: its kind, model, URL, ranks and pool size
        (the last two from its latest /metrics sample `s`, when there is one)."""
        bits = [info.name]
        if info.model:
            bits.append(info.model)
        bits.append(info.url)
        ranks = [r for r in s.ranks if r] if s is not None else []
        if len(ranks) > 1:
            bits.append(f"{len(ranks)} ranks")
        self.model_label.setText(" · ".join(bits))
        if s is not None and s.num_blocks:
            bs = f" × {s.block_size} tokens" if s.block_size else ""
            kv = f"{s.num_blocks:,} blocks{bs} per rank · KV usage only (no per-block telemetry)"
        elif s is not None and s.capacity_tokens:
            kv = f"{s.capacity_tokens:,.0f} KV tokens per rank · usage only"
        else:
            kv = "KV pool size not reported"
        self.kv_label.setText(kv)

    def show_server_notes(self, info: ServerInfo | None, metrics_problem: str) -> None:
        """What the server does not report, and why /metrics could not be read (if so)."""
        if info is None:
            self.remote_label.setVisible(False)
            return
        parts = []
        if metrics_problem:
            parts.append(f"metrics: {metrics_problem}")
        if not info.per_block:
            missing = missing_labels(info.missing)
            if missing:
                parts.append("not reported by this server: " + ", ".join(missing))
        text = " · ".join(parts)
        if text != self.remote_label.text():
            self.remote_label.setText(text)
        self.remote_label.setVisible(bool(text))

    def show_api(self, api: ApiServer, http_in_flight: int) -> None:
        state = api.state
        if state == SERVING:
            text = f"API {api.url}/v1 · {http_in_flight} HTTP in flight"
        elif state == WAITING:
            text = "API: waiting for the engine"
        elif api.restarting:
            moved = api.endpoint != api.served_endpoint
            text = "API restarting for the new engine…" if moved else "API restarting…"
        else:
            text = f"API {state}…"
        self.api_label.setText(text)
        self.api_label.setVisible(state != OFF)
