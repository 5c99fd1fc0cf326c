"""LLMEngine's tokenization: prompts (text, token ids or chat messages) to token ids, and back.
A mixin of LLMEngine (engine_proc/engine/llm_engine.py), which owns the tokenizer and the model
config."""

from __future__ import annotations

from typing import Any

from engine_proc.engine.chat_render import ChatPrompt, render
from engine_proc.engine.parts import EngineParts

Prompt = str | list[int] | list[dict[str, str]] | ChatPrompt
_CHAT_ROLES = ("system", "user", "assistant", "tool")


class Tokenization(EngineParts):
    """Validates what it is given: a ValueError names what is wrong (the server sends it back
    as invalid_request)."""

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = self.tokenize_text(prompt)
        elif isinstance(prompt, ChatPrompt):
            ids = self.tokenize_chat(
                prompt.messages,
                tools=prompt.tools,
                chat_template_kwargs=prompt.chat_template_kwargs,
            )
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self.tokenize_chat(prompt)
        elif isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        else:
            raise ValueError(
                "prompt must be a non-empty string, a list of token ids, or a list of chat "
                "messages {'role', 'content'}"
            )
        if not ids:
            raise ValueError("prompt must not be empty (it has no tokens)")
        return ids

    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of plain text (with BOS, as a text prompt is tokenized, by default)."""
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a string, got {type(text).__name__}")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def detokenize(self, token_ids: list[int]) -> str:
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"token ids must be integers in [0, {vocab}); got {bad[:5]}")
        return self.tokenizer.decode(token_ids)

    def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a conversation under the model's chat template, with the tools and the
        template arguments (engine_proc/engine/chat_render.py; its fallback for templates
        without tool support)."""
        for i, m in enumerate(messages):
            if m.get("role") not in _CHAT_ROLES:
                raise ValueError(
                    f"messages[{i}].role must be one of {_CHAT_ROLES}, got {m.get('role')!r}"
                )
            if not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}].content must be a string")
        if not messages:
            raise ValueError("messages must not be empty")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"the model {self.checkpoint_name!r} has no chat template: send a plain prompt "
                "(/v1/completions) instead of chat messages"
            )
        prompt = ChatPrompt(messages, tools, chat_template_kwargs)
        text = render(self.tokenizer, prompt, add_generation_prompt)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
