"""Conversations: the chat history the GUI shows, saved as one JSON file per conversation."""

from app.conversations.model import (
    DEFAULT_SYSTEM_PROMPT,
    FORMAT_VERSION,
    ROLES,
    Conversation,
    ConversationStore,
    Message,
)

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "FORMAT_VERSION",
    "ROLES",
    "Conversation",
    "ConversationStore",
    "Message",
]
