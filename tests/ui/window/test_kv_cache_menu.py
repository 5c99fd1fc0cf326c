"""*Engine → KV cache* (issue 14): the KV element type and the lower KV tiers from the window,
remembered in the settings and passed to the engine's command line; int8 and the tiers go
together; the status bar says what runs. No engine: the restart is replaced by a recorder of the
command line it would start."""

from __future__ import annotations

import msgspec
import pytest

from app import __main__ as app_main
from app.conversations import ConversationStore
from app.settings import open_settings
from app.supervisor import EngineOptions
from ipc import protocol as P
from tests.ui.conftest import DictSettings
from ui.window.main_window import EngineSource, MainWindow
from ui.window.status_bar import kv_formula, tier_counters_text

MIB, GIB = 1 << 20, 1 << 30


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_engine_options_pass_the_kv_flags():
    assert EngineOptions().to_args() == ["--client-timeout", "120.0"]  # all engine defaults
    args = EngineOptions(kv_cache_dtype="int8").to_args()
    assert _flag(args, "--kv-cache-dtype") == "int8" and "--kv-host-memory" not in args
    args = EngineOptions(kv_host_memory=GIB, kv_disk_dir="/d/kv-cache",
                         kv_disk_bytes=8 * GIB).to_args()
    assert _flag(args, "--kv-host-memory") == str(GIB)
    assert _flag(args, "--kv-disk-dir") == "/d/kv-cache"
    assert _flag(args, "--kv-disk-bytes") == str(8 * GIB)
    assert "--kv-cache-dtype" not in args


def test_engine_options_take_the_kv_choices_from_the_settings(tmp_path):
    parse = app_main.build_parser().parse_args
    opts = app_main._engine_options(parse([]), DictSettings({}), tmp_path)
    assert (opts.kv_cache_dtype, opts.kv_host_memory, opts.kv_disk_dir, opts.kv_disk_bytes) == (
        None, None, None, None)
    good = DictSettings({"engine/kv_cache_dtype": "int8"})
    assert app_main._engine_options(parse([]), good, tmp_path).kv_cache_dtype == "int8"
    # QSettings' INI files give strings back
    tiers = DictSettings({"engine/kv_host_memory": str(GIB), "engine/kv_disk_bytes": str(8 * GIB)})
    opts = app_main._engine_options(parse([]), tiers, tmp_path)
    assert opts.kv_host_memory == GIB and opts.kv_disk_bytes == 8 * GIB
    assert opts.kv_disk_dir == str(tmp_path / "kv-cache")
    # no data directory: no disk tier (there is nowhere to put it)
    opts = app_main._engine_options(parse([]), tiers)
    assert opts.kv_host_memory == GIB and opts.kv_disk_dir is None and opts.kv_disk_bytes is None


@pytest.mark.parametrize(
    "values",
    [
        {"engine/kv_cache_dtype": "fp4", "engine/kv_host_memory": "lots",
         "engine/kv_disk_bytes": "-5"},
        {"engine/kv_cache_dtype": 3, "engine/kv_host_memory": "1.5",
         "engine/kv_disk_bytes": ["x"]},
        {"engine/kv_cache_dtype": "", "engine/kv_host_memory": str(1 << 60),
         "engine/kv_disk_bytes": True},
    ],
    ids=["words", "types", "huge"],
)
def test_garbage_kv_settings_start_the_engine_default(tmp_path, values):
    opts = app_main._engine_options(app_main.build_parser().parse_args([]),
                                    DictSettings(values), tmp_path)
    assert (opts.kv_cache_dtype, opts.kv_host_memory, opts.kv_disk_dir, opts.kv_disk_bytes) == (
        None, None, None, None)
    args = opts.to_args()
    assert not any(a.startswith("--kv-") for a in args)


def test_int8_next_to_tiers_in_the_settings_starts_with_both(tmp_path):
    both = DictSettings({"engine/kv_cache_dtype": "int8", "engine/kv_host_memory": str(GIB),
                         "engine/kv_disk_bytes": str(GIB)})
    args = app_main._engine_options(app_main.build_parser().parse_args([]), both,
                                    tmp_path).to_args()
    assert _flag(args, "--kv-cache-dtype") == "int8"
    assert _flag(args, "--kv-host-memory") == str(GIB)
    assert _flag(args, "--kv-disk-bytes") == str(GIB)
    assert _flag(args, "--kv-disk-dir") == str(tmp_path / "kv-cache")


@pytest.fixture
def spawned(qtbot, tmp_path, monkeypatch):
    """A window that would spawn its engine; restarts are recorded, not run."""
    d = tmp_path / "data"
    w = MainWindow(open_settings(d), ConversationStore(d / "conversations"),
                   EngineSource(command=["/bin/false"]), data_dir=d)
    qtbot.addWidget(w)
    w.restarts = []
    monkeypatch.setattr(w.lifecycle, "restart",
                        lambda: w.restarts.append(w.source.options.to_args()))
    yield w
    w.shutdown()


def test_choosing_int8_restarts_the_engine_with_it(spawned):
    w = spawned
    acts = w.kv_cache_actions
    assert acts["dtype"]["auto"].isChecked() and acts["host"][0].isChecked()
    assert acts["disk"][0].isChecked() and w.kv_cache_menu.isEnabled()
    acts["dtype"]["int8"].trigger()
    assert len(w.restarts) == 1 and _flag(w.restarts[0], "--kv-cache-dtype") == "int8"
    assert acts["dtype"]["int8"].isChecked()
    assert w.settings.value("engine/kv_cache_dtype") == "int8"
    acts["dtype"]["int8"].trigger()  # the same again: nothing to restart for
    assert len(w.restarts) == 1


def test_tiers_and_int8_combine(spawned):
    w = spawned
    acts = w.kv_cache_actions
    w.set_kv_cache_dtype("int8")
    acts["host"][GIB].trigger()
    args = w.restarts[-1]
    assert _flag(args, "--kv-host-memory") == str(GIB)
    assert _flag(args, "--kv-cache-dtype") == "int8"  # the element type stays
    assert acts["dtype"]["int8"].isChecked() and acts["host"][GIB].isChecked()
    assert w.settings.value("engine/kv_cache_dtype") == "int8"
    assert int(w.settings.value("engine/kv_host_memory")) == GIB
    # The disk tier goes into the data directory.
    acts["disk"][8 * GIB].trigger()
    args = w.restarts[-1]
    assert _flag(args, "--kv-disk-dir") == str(w.data_dir / "kv-cache")
    assert _flag(args, "--kv-disk-bytes") == str(8 * GIB)
    assert _flag(args, "--kv-cache-dtype") == "int8"
    # Back to the model's dtype: the tiers stay.
    acts["dtype"]["auto"].trigger()
    args = w.restarts[-1]
    assert _flag(args, "--kv-cache-dtype") == "auto"
    assert _flag(args, "--kv-host-memory") == str(GIB)
    assert _flag(args, "--kv-disk-bytes") == str(8 * GIB)
    assert acts["host"][GIB].isChecked() and acts["disk"][8 * GIB].isChecked()
    assert int(w.settings.value("engine/kv_host_memory")) == GIB
    assert len(w.restarts) == 4


def test_replies_in_flight_are_asked_about_first(spawned, monkeypatch):
    w = spawned
    w.chat.active["r1"] = ("c", None, {})  # a reply in progress
    asked: list[tuple[int, str]] = []
    monkeypatch.setattr(w, "confirm_restart", lambda n, what: asked.append((n, what)) or False)
    w.kv_cache_actions["host"][256 * MIB].trigger()
    assert asked == [(1, "the host memory tier")] and not w.restarts
    assert w.kv_cache_actions["host"][0].isChecked()  # the menu shows what still runs
    assert w.source.options.kv_host_memory is None
    assert w.settings.value("engine/kv_host_memory") is None
    monkeypatch.setattr(w, "confirm_restart", lambda n, what: True)
    w.kv_cache_actions["host"][256 * MIB].trigger()
    assert _flag(w.restarts[-1], "--kv-host-memory") == str(256 * MIB)
    del w.chat.active["r1"]


def test_decode_weights_share_the_restart_flow(spawned):
    w = spawned
    w.decode_weight_actions["int4"].trigger()
    assert _flag(w.restarts[-1], "--decode-weights") == "int4"
    assert w.settings.value("engine/decode_weights") == "int4"


def test_decode_activations_share_it_and_are_remembered(spawned, tmp_path):
    w = spawned
    actions = w.option_menus.activation_actions
    # a source without the flag runs the engine's default (the app always passes one)
    assert actions["exact"].isChecked() and not actions["auto"].isChecked()
    restarts = len(w.restarts)
    actions["exact"].trigger()  # what runs already: no restart
    assert len(w.restarts) == restarts
    actions["int8"].trigger()
    assert _flag(w.restarts[-1], "--decode-activations") == "int8"
    assert w.settings.value("engine/decode_activations") == "int8"
    assert actions["int8"].isChecked()
    with pytest.raises(ValueError, match=r"decode activations must be one of \['auto', 'exact', "
                                         r"'int8'\]"):  # fmt: skip
        w.option_menus.set_decode_activations("int4")
    # the next start takes the remembered choice; the command line wins; a stale value is dropped
    parse = app_main.build_parser().parse_args
    settings = DictSettings({"engine/decode_activations": "int8"})
    assert app_main._engine_options(parse([]), settings, tmp_path).decode_activations == "int8"
    opts = app_main._engine_options(parse(["--decode-activations", "exact"]), settings, tmp_path)
    assert opts.decode_activations == "exact"
    stale = DictSettings({"engine/decode_activations": "fp4"})
    assert app_main._engine_options(parse([]), stale, tmp_path).decode_activations == "auto"
    fresh = app_main._engine_options(parse([]), DictSettings({}), tmp_path)
    assert fresh.to_args()[fresh.to_args().index("--decode-activations") + 1] == "auto"
    assert "--decode-activations" not in EngineOptions().to_args()


def test_remembered_choices_show_in_the_menu(qtbot, tmp_path):
    d = tmp_path / "data"
    # the options as the app builds them: the arithmetic is auto unless told otherwise
    opts = app_main._engine_options(app_main.build_parser().parse_args([]), DictSettings({}), d)
    opts.kv_host_memory, opts.kv_disk_dir, opts.kv_disk_bytes = 3 * GIB, str(d / "kv-cache"), GIB
    w = MainWindow(open_settings(d), ConversationStore(d / "conversations"),
                   EngineSource(command=["/bin/false"], options=opts), data_dir=d)
    qtbot.addWidget(w)
    acts = w.kv_cache_actions
    assert acts["host"][3 * GIB].isChecked() and acts["host"][3 * GIB].text() == "3 GiB"
    assert acts["disk"][GIB].isChecked() and acts["dtype"]["auto"].isChecked()
    arithmetic = w.option_menus.activation_actions
    assert arithmetic["auto"].isChecked() and not arithmetic["exact"].isChecked()
    w.shutdown()


def test_attached_engine_keeps_its_kv_cache(qtbot, tmp_path):
    d = tmp_path / "data"
    w = MainWindow(open_settings(d), ConversationStore(d / "conversations"),
                   EngineSource(connect="tcp://127.0.0.1:9"), data_dir=d)
    qtbot.addWidget(w)
    restarts: list[int] = []
    w.lifecycle.restart = lambda: restarts.append(1)
    assert not w.kv_cache_menu.isEnabled()
    w.set_kv_cache_dtype("int8")
    assert not restarts
    assert "applies to engines this app starts" in w.statusBar().currentMessage()
    assert w.settings.value("engine/kv_cache_dtype") == "int8"
    with pytest.raises(ValueError, match="element type must be one of"):
        w.set_kv_cache_dtype("fp4")
    w.shutdown()


def _model(**kw) -> P.ModelInfo:
    base = dict(name="m", architecture="Llama", num_layers=30, num_kv_heads=3, head_dim=64,
                dtype="bfloat16", device="cpu", block_size=16, num_blocks=100,
                kv_bytes_per_token=2 * 30 * 3 * 64 * 2, max_model_len=2048)
    return P.ModelInfo(**{**base, **kw})


def test_status_bar_shows_the_element_type_and_the_tiers(qtbot, tmp_path):
    assert kv_formula(_model()) == "KV/token 2·L·H_kv·D·bytes = 2·30·3·64·2 = 23,040 B"
    int8 = _model(kv_cache_dtype="int8", kv_bytes_per_token=2 * 30 * 3 * (64 + 2))
    assert kv_formula(int8) == ("KV/token int8 2·L·H_kv·(D·1 + 2 scale) = 2·30·3·(64·1 + 2) "
                                "= 11,880 B")
    fp8 = _model(kv_cache_dtype="fp8", kv_bytes_per_token=2 * 30 * 3 * 64)
    assert kv_formula(fp8) == "KV/token fp8 2·L·H_kv·D·1 = 2·30·3·64·1 = 11,520 B"
    # an old engine's ModelInfo (no such keys: defaults are left out of the map) decodes with
    # the defaults
    assert not {"kv_cache_dtype", "kv_host_bytes", "kv_disk_bytes"} & set(
        msgspec.msgpack.decode(P.encode(_model())))
    old = P.decode_engine(P.encode(P.Welcome(
        protocol_version=1, client_id="c", model=_model(), config=P.LiveConfig(
            max_num_seqs=1, max_num_batched_tokens=1, long_prefill_chunk=0,
            enable_prefix_caching=True), pub_endpoint="x", telemetry_hz=1.0,
        heartbeat_interval=1.0, client_timeout=1.0, max_message_bytes=1, server_time=0.0)))
    assert (old.model.kv_cache_dtype, old.model.kv_host_bytes, old.model.kv_disk_bytes) == (
        "auto", 0, 0)

    d = tmp_path / "data"
    w = MainWindow(open_settings(d), ConversationStore(d / "conversations"),
                   EngineSource(connect="tcp://127.0.0.1:9"), data_dir=d)
    qtbot.addWidget(w)
    w.status.show_engine(int8)
    text = w.kv_label.text()
    assert "int8 2·L·H_kv·(D·1 + 2 scale)" in text and "KV tiers" not in text
    w.status.show_engine(_model(kv_host_bytes=GIB, kv_disk_bytes=8 * GIB))
    assert "KV tiers host 1 GiB · disk 8 GiB" in w.kv_label.text()
    assert "2·30·3·64·2" in w.kv_label.text()

    # the per-tier line, from telemetry counters
    label = w.status.tiers_label
    w.status.show_tiers({"num_requests_running": 1.0})
    assert label.isHidden() and label.text() == ""
    counters = {"kv_host_blocks": 12.0, "kv_host_blocks_total": 4096.0, "kv_host_hits": 3.0,
                "kv_disk_blocks": 100.0, "kv_disk_blocks_total": 65536.0, "kv_disk_hits": 5.0,
                "kv_disk_writable": 1.0, "external_prefix_cache_queries": 320.0,
                "external_prefix_cache_hits": 128.0}
    w.status.show_tiers(counters)
    assert label.text() == ("host tier 12/4,096 blocks · 3 hits │ disk tier 100/65,536 blocks · "
                            "5 hits │ 128/320 looked-up tokens found")
    assert not label.isHidden()
    changed: list[str] = []
    label.setText = changed.append  # the same counters again: no setText
    w.status.show_tiers(dict(counters))
    assert not changed
    del label.setText
    assert "(read-only)" in tier_counters_text({**counters, "kv_disk_writable": 0.0})
    w.status.show_tiers({})
    assert label.isHidden()
    w.shutdown()
