"""Conversations: the chat history the GUI shows, as trees of messages (edits and regenerated
replies are branches), saved one JSON file per conversation; plus Markdown / OpenAI-format
export and import, search across every branch, and system-prompt presets. No Qt here.

model.py     Message, Conversation (the tree and the branch on screen)
store.py     ConversationStore and the file format (version 2; version 1 still opens)
exchange.py  to_markdown, to_openai_messages, from_openai_messages
search.py    search -> SearchHit
presets.py   Preset, PresetStore (presets.json)
"""

from app.conversations.exchange import from_openai_messages, to_markdown, to_openai_messages
from app.conversations.model import DEFAULT_SYSTEM_PROMPT, ROLES, Conversation, Message
from app.conversations.presets import PRESETS_FILE, Preset, PresetStore
from app.conversations.search import SearchHit, search
from app.conversations.store import FORMAT_VERSION, ConversationStore

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "FORMAT_VERSION",
    "PRESETS_FILE",
    "ROLES",
    "Conversation",
    "ConversationStore",
    "Message",
    "Preset",
    "PresetStore",
    "SearchHit",
    "from_openai_messages",
    "search",
    "to_markdown",
    "to_openai_messages",
]
