"""Hand-written, not from a notebook: OpenAI's API as data, which chapter 08 uses but does not teach.

The OpenAI request and response bodies the server speaks, as pydantic models: they validate each
request at the door (params.py) and describe the API in /openapi.json (openapi.py). Hand-written
module (chapter 08)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator


def _integral(value):
    """JSON Schema calls 2.0 an integer, and so does OpenAI's API: take it as 2 (in lists too)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return [_integral(v) for v in value] if isinstance(value, list) else value


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
MAX_STOPS, MAX_STOP_CHARS = 16, 512  # a stop string is searched for at every token: bounded
Stop = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
MAX_PROMPTS = 2048  # prompts in one completions request (OpenAI's limit on array inputs)


class Strict(BaseModel):
    # Strict: a JSON true is no number and "3" no int. Unknown fields are ignored, as OpenAI's
    # clients send some (user, metadata) that change nothing here. Python's JSON reads Infinity and
    # NaN, which JSON itself has not: refused (a temperature of Infinity made masked logits NaN).
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats(cls, data):
        return {k: _integral(v) for k, v in data.items()} if isinstance(data, dict) else data


class StreamOptions(Strict):
    include_usage: bool = False


class JSONSchema(Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the schema (none: any JSON object)")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None


class SamplingFields(Strict):
    """What both endpoints take besides the prompt."""
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="-1 or 0: off; above the vocabulary: all of it")
    n: int = Field(1, ge=1, description="prompts x n: at most the server's --max-seqs-per-request")
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOPS)] | None = None
    seed: int | None = Field(None, ge=-2 ** 63, lt=2 ** 64, description="what torch.Generator takes")
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Penalties and filters (chapter 12): OpenAI's, and vLLM's extensions
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, description="transformers': a seen token's logit divided by it")
    min_p: float = Field(0.0, ge=0, le=1)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="token id (a string of digits) -> added to its logit")
    min_tokens: int = Field(0, ge=0, description="no end-of-sequence or stop token before this many")
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOPS)] | None = None
    # Structured output (chapter 12): OpenAI's response_format, or one of vLLM's guided_* fields
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = Field(None, description="a JSON schema the output follows")
    guided_regex: str | None = Field(None, description="a regular expression the output matches")
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = Field(
        None, description="the output is one of these")


class CompletionRequest(SamplingFields):
    logprobs: int | None = Field(None, ge=0, le=20, description="each token's log-probability and the top n")
    echo: bool = Field(False, description="the prompt before the completion, in the text and the logprobs")
    prompt: Annotated[str, Field(min_length=1)] | TokenIds | \
        Annotated[list[Annotated[str, Field(min_length=1)] | TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: str
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    # OpenAI's rule, which the server keeps and the schema says: top_logprobs only with logprobs: true.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False, json_schema_extra={
        "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
        "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}})
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20, description="with logprobs: the top n of each token")


# ----- responses -----

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length", "abort"] | None


class CompletionLogprobs(BaseModel):
    """OpenAI's (legacy) completions form: per token, its text, log-probability, top n and offset."""
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason


class CompletionResponse(BaseModel):
    """A whole completion, or (stream=true) each Server-Sent Event's chunk of one."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    vocab_size: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: str
