"""Hand-written, not from a notebook: the /v1/chat/completions endpoint's shapes (chapter 08 runs it).

A conversation becomes one prompt through the tokenizer's chat template; its choices are assistant
messages, streamed as deltas that open with the role. Hand-written module (chapter 08)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from miniinfer.serving.openai.completions import Completions, Piece, TextOffsets
from miniinfer.serving.openai.door import Door
from miniinfer.serving.openai.params import UNSUPPORTED, APIError
from miniinfer.serving.openai.schema import ChatCompletionRequest, ChatCompletionResponse, SamplingFields

# A chat request without max_tokens gets at most this many (and the rest of the context): OpenAI's
# "up to the context" let one request of the course model run 40 s on a 2-core CPU; 512 tokens hold
# a long answer.
CHAT_MAX_TOKENS = 512


def chat_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation: the tokenizer's chat template, or for a model without one (the
    course model) one "role: content" line per message and then "assistant:" as the cue."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:").input_ids


class Chat(Completions):
    """POST /v1/chat/completions: one conversation, n assistant messages."""
    path = "/v1/chat/completions"
    request: type[SamplingFields] = ChatCompletionRequest
    response: type[BaseModel] = ChatCompletionResponse
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"
    unsupported = (*UNSUPPORTED, "echo")

    def prompts(self, door: Door, req: Any) -> list[list[int]]:
        if door.tokenizer is None:
            raise APIError("this model has no tokenizer: use /v1/completions with token ids")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        door.check_chars(sum(len(m["role"]) + len(m["content"]) for m in messages), "messages")
        try:
            return [chat_prompt(door.tokenizer, messages)]
        except Exception as err:  # a template may refuse a conversation (e.g. roles out of order)
            raise APIError(f"the chat template failed: {err}", param="messages") from None

    def max_tokens(self, door: Door, req: Any, prompts: list[list[int]]) -> int:
        default = max(min(door.chat_max_tokens, door.max_model_len - len(prompts[0])), 1)
        return req.max_tokens or req.max_completion_tokens or default

    def logprobs(self, req: Any) -> tuple[int | None, int | None]:
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None, None

    def echo(self, req: Any) -> bool:
        return False

    def choice(self, index: int, text: str, reason: str | None, logprobs: dict | None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": reason}

    def delta(self, index: int, text: str | None, reason: str | None, logprobs: dict | None) -> dict:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                "finish_reason": reason}

    def opening(self, index: int) -> dict | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def logprobs_json(self, items: list, piece: Piece, offsets: TextOffsets) -> dict:
        """Chapter 12's TokenLogprobs as chat's `content` list (no offsets)."""
        def entry(token: int, logprob: float) -> dict:
            text, data = piece(token)
            return {"token": text, "logprob": logprob, "bytes": list(data)}

        return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]}
                            for lp in items]}
