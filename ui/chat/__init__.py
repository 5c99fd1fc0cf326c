"""The chat panel: conversations, streamed replies, Stop, Regenerate, sampling controls."""
