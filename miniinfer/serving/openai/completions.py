"""Hand-written, not from a notebook: the /v1/completions endpoint's shapes (chapter 08 runs it).

What an endpoint decides, the rest of a request's path being shared (server.py): its prompts' token
ids, its default max_tokens, the log-probabilities its fields ask for, and the JSON of its choices,
whole or streamed. `Chat` (chat.py) is this class with the differences. Hand-written module (chapter 08)."""

from __future__ import annotations

import codecs
from typing import Any, Callable

from pydantic import BaseModel

from miniinfer.serving.openai.door import Door
from miniinfer.serving.openai.params import UNSUPPORTED
from miniinfer.serving.openai.schema import CompletionRequest, CompletionResponse, SamplingFields

# fn(token id) -> its text as the API shows it, and its own bytes (the server's token_piece)
Piece = Callable[[int], tuple[str, bytes]]


class TextOffsets:
    """Where each token's text starts in a choice's text, in characters: the tokens' bytes decoded as
    one stream, so that a token whose bytes continue a character begun by the token before gets the
    offset of that character, as OpenAI's API gives it."""

    def __init__(self):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.chars = 0

    def next(self, data: bytes) -> int:
        at = self.chars
        self.chars += len(self.decoder.decode(data))
        return at


class Completions:
    """POST /v1/completions: one prompt or many (text or token ids), n choices each, echo."""
    path = "/v1/completions"
    request: type[SamplingFields] = CompletionRequest
    response: type[BaseModel] = CompletionResponse
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"
    unsupported: tuple[str, ...] = UNSUPPORTED

    def prompts(self, door: Door, req: Any) -> list[list[int]]:
        prompt = req.prompt
        prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
        return [door.tokenize(p) if isinstance(p, str) else p for p in prompts]

    def max_tokens(self, door: Door, req: Any, prompts: list[list[int]]) -> int:
        return req.max_tokens or 16  # OpenAI's default for this endpoint

    def logprobs(self, req: Any) -> tuple[int | None, int | None]:
        """Top tokens asked with each generated token, and with each prompt token: echo with
        logprobs scores the prompt too, as evaluation harnesses ask."""
        return req.logprobs, req.logprobs if req.echo else None

    def echo(self, req: Any) -> bool:
        return req.echo

    def choice(self, index: int, text: str, reason: str | None, logprobs: dict | None) -> dict:
        """One choice of a whole response."""
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def delta(self, index: int, text: str | None, reason: str | None, logprobs: dict | None) -> dict:
        """One choice's part of a streamed chunk."""
        return self.choice(index, text or "", reason, logprobs)

    def opening(self, index: int) -> dict | None:
        """The chunk a choice's stream starts with, before any text (None: none)."""
        return None

    def logprobs_json(self, items: list, piece: Piece, offsets: TextOffsets) -> dict:
        """Chapter 12's TokenLogprobs as this endpoint's parallel lists (offsets: the choice's, advanced
        by these tokens; a bare token id: an echoed prompt's first token, which has no log-probability)."""
        pieces = [piece(lp if isinstance(lp, int) else lp.token) for lp in items]
        scored = [None if isinstance(lp, int) else lp for lp in items]
        return {"tokens": [text for text, _ in pieces],
                "token_logprobs": [None if lp is None else lp.logprob for lp in scored],
                "top_logprobs": [None if lp is None else {piece(t)[0]: p for t, p in lp.top} for lp in scored],
                "text_offset": [offsets.next(data) for _, data in pieces]}
