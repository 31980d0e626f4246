"""Hand-written, not from a notebook: what the API's modules read of the server they answer for, as
small protocols, so that they depend on these few names and not on the server (which imports them).

Hand-written module (chapter 08)."""

from __future__ import annotations

from typing import Any, Protocol


class Bounds(Protocol):
    """The engine's bounds a request is checked against, and that /openapi.json states."""
    max_model_len: int
    vocab_size: int
    max_seqs: int  # sequences (prompts x n) one request may ask for


class Door(Bounds, Protocol):
    """What an endpoint reads to turn a body into prompts and a token budget."""
    tokenizer: Any  # a transformers tokenizer, or None where the server was given token ids only
    chat_max_tokens: int

    def tokenize(self, text: str) -> list[int]: ...

    def check_chars(self, chars: int, param: str) -> None: ...


class Counted(Protocol):
    """What /metrics reports: the engine's state and the server's own count of prompt tokens."""
    engine: Any  # an AsyncLLMEngine (or a client of one): stats, totals, generated_tokens
    prompt_tokens: int
