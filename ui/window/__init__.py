"""The main window and its parts: the engine lifecycle, the option menus, watching a server
over HTTP, the OpenAI API toggle, the telemetry feed into the panels, the status bar, the
controls and dialogs. The parts see the window as `host.WindowHost`, never import it."""
