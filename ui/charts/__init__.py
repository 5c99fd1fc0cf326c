"""Live charts of the engine's telemetry (and the plotting helpers the other charts share)."""
