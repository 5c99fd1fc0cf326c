"""Prefill/decode disaggregation, the engine's half: leases on a finished prompt's blocks,
adopting blocks pulled from another engine, and the transfer service that moves them over
ZeroMQ (docs/PROTOCOL.md section 10)."""
