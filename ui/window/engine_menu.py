"""The window's *Engine* menu (`window.restart_action`, `connect_action`, `fleet_action`,
`local_action`, `api_action` and the option submenus): built once, then enabled and labelled by
what the window is attached to (a spawned engine, an attached one, a server over HTTP)."""

from __future__ import annotations

from PySide6.QtGui import QAction, QKeySequence


def build_engine_menu(w) -> None:
    """*Engine*: restart, connect to a server or a fleet, back to the local engine, the options
    the engine starts with (ui/window/options.py), and *Serve OpenAI API…*."""
    menu = w.menuBar().addMenu("&Engine")
    restart = w.restart_action = QAction("&Restart engine", w)
    restart.setShortcut(QKeySequence("Ctrl+Alt+R"))  # Ctrl+Shift+R regenerates a reply
    restart.triggered.connect(w.restart_engine)
    menu.addAction(restart)
    connect = w.connect_action = QAction("&Connect to server…", w)
    connect.setToolTip("watch a vLLM, SGLang, llama.cpp or KVScope server over HTTP")
    connect.triggered.connect(w.open_connect_dialog)
    menu.addAction(connect)
    fleet = w.fleet_action = QAction("Connect to a &fleet…", w)
    fleet.setToolTip("watch several vLLM, SGLang or KVScope servers at once: their figures, "
                     "one prefix tree, where a KV-aware router would send a prompt")
    fleet.triggered.connect(w.fleet.open_dialog)
    menu.addAction(fleet)
    local = w.local_action = QAction("Back to the &local engine", w)
    local.setToolTip("stop watching the server and use this window's own engine again")
    local.triggered.connect(w.use_local_engine)
    local.setVisible(w.source.is_remote)
    menu.addAction(local)
    menu.addSeparator()
    w.decode_weights_menu, w.decode_weight_actions = (
        w.option_menus.add_decode_weights_menu(menu))
    w.kv_cache_menu, w.kv_cache_actions = w.option_menus.add_kv_cache_menu(menu)
    w.spec_menu, w.spec_actions = w.option_menus.add_speculative_menu(menu)
    menu.addSeparator()
    api = w.api_action = QAction("Serve &OpenAI API…", w, checkable=True)
    api.triggered.connect(w.api_toggle.on_triggered)
    menu.addAction(api)
    menu.setToolTipsVisible(True)

def update_engine_menu(w) -> None:
    """What the Engine menu offers depends on what the window is attached to."""
    remote = w.source.is_remote
    weights, api = w.decode_weights_menu, w.api_action
    attached_tip = (
        "" if not w.source.connect else
        "set when the engine starts; this window watches a server over HTTP" if remote else
        "set when the engine starts; this window attached to a running one")
    for sub, tip in ((weights, ""), (w.kv_cache_menu, "the KV pool's element type and "
                      "the tiers below it; a change restarts the engine"),
                     (w.spec_menu, "draft tokens verified in one forward pass; a change "
                      "restarts the engine")):
        sub.setEnabled(not w.source.connect)
        sub.setToolTip(attached_tip)
        sub.menuAction().setToolTip(attached_tip or tip)
    disk = w.kv_cache_actions["disk"]
    for value, action in disk.items():  # the tier's files live in the data directory
        action.setEnabled(not value or w.data_dir is not None)
    api.setEnabled(not remote and not w.source.is_demo)
    api.setToolTip("the window is watching a server over HTTP; it has an API of its own"
                   if remote else
                   "an OpenAI-compatible HTTP API on 127.0.0.1 for this window's engine")
    w.restart_action.setText("&Reconnect" if remote else "&Restart engine")
    w.local_action.setVisible(remote)
