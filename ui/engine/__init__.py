"""The window's link to its engine: the ZeroMQ worker thread, and the demo's synthetic engine."""
