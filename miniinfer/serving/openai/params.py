"""Hand-written, not from a notebook: where an HTTP body becomes SamplingParams (chapter 08 runs it).

A body is parsed, checked for depth and text, validated against schema.py, and mapped onto chapter 12's
`SamplingParams` and `StructuredOutput`; whatever is refused is an `APIError` naming the field at fault,
as OpenAI's API names it. Hand-written module (chapter 08)."""

from __future__ import annotations

import json
import math
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from miniinfer.core.sampling_params import FieldError, SamplingParams, StructuredOutput
from miniinfer.serving.openai.schema import SamplingFields

MAX_DEPTH = 32  # OpenAI's request bodies nest a few levels; a deeper one is refused, not walked
# A grammar's schema is counted by the grammar's own limit (MAX_GRAMMAR_DEPTH, 64), not the body's:
# one 14 levels deep was refused for the body's 32 before that limit could say why.
GRAMMAR_FIELDS = {("guided_json",), ("response_format", "json_schema", "schema")}
# Accepted by OpenAI's API but not implemented here: refused unless left at their "off" value.
UNSUPPORTED = ("suffix", "tools", "functions")


class APIError(Exception):
    """A request the server refuses, answered as OpenAI does: {"error": {...}} with an HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.param, self.type, self.code, self.headers = status, param, type, code, headers

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


Body = TypeVar("Body", bound=BaseModel)


def validate(model: type[Body], body: dict) -> Body:
    """body as a request model, or an APIError naming the first field at fault."""
    try:
        return model.model_validate(body)
    except ValidationError as err:
        errors = err.errors(include_url=False)
        said = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors[:3])
        first = errors[0]
        got = repr(first.get("input"))
        raise APIError(f"{said} (got {got[:80] + '...' if len(got) > 80 else got})",
                       param=str(first["loc"][0]) if first["loc"] else None) from None


def param_of(err: ValueError) -> str | None:
    """The request's field that a refusal names (the engine's names are the API's, but one)."""
    if not isinstance(err, FieldError):
        return None
    return "logprobs" if err.field == "prompt_logprobs" else err.field  # echo's prompt logprobs: `logprobs`


def check_body(body: dict) -> None:
    """Refuse a body nested deeper than MAX_DEPTH (a grammar's schema aside), or holding a string that
    is not text (a lone UTF-16 surrogate, which JSON's \\u escapes can carry but no tokenizer can
    encode), naming where."""
    todo: list[tuple[object, tuple, float]] = [(body, (), 1)]  # a value, the keys to it, its depth
    while todo:
        value, path, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise APIError(f"the body nests more than {MAX_DEPTH} levels deep", param=path[0] if path else None)
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError as err:
                where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" if i else k for i, k in enumerate(path))
                raise APIError(f"{where} is not valid Unicode text: {err.reason} at index {err.start}",
                               param=where) from None
        elif isinstance(value, dict):
            todo += [(v, (*path, k), -math.inf if (*path, k) in GRAMMAR_FIELDS else depth + 1)
                     for k, v in value.items()]
        elif isinstance(value, list):  # numbers need no look (a prompt of token ids is a long list of them)
            todo += [(v, (*path, i), depth + 1) for i, v in enumerate(value) if isinstance(v, (str, list, dict))]


def load_body(raw: bytes, unsupported: tuple[str, ...] = UNSUPPORTED) -> dict:
    """A request body as a JSON object, checked (check_body), with no field this server does not serve."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(f"the body is not valid JSON: {err}") from None
    except RecursionError:
        raise APIError(f"the body nests more than {MAX_DEPTH} levels deep") from None
    if not isinstance(body, dict):
        raise APIError("the body must be a JSON object")
    check_body(body)
    for key in unsupported:
        if body.get(key) not in (None, False, 0, [], {}):
            raise APIError(f"'{key}' is not supported by this server", param=key)
    if body.get("best_of") not in (None, 1):
        raise APIError("'best_of' is not supported by this server", param="best_of")
    return body


def structure(req: SamplingFields) -> tuple[str, StructuredOutput] | None:
    """The grammar a request's output follows and the field it came from: response_format or a
    guided_* field (one at most)."""
    given: list[tuple[str, dict]] = []  # (field, what StructuredOutput takes)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError("response_format of type json_schema needs 'json_schema'", param="response_format")
        schema = fmt.json_schema.schema_
        given.append(("response_format", {"json_object": True} if schema is None else {"json": json.dumps(schema)}))
    if req.guided_json is not None:
        text = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
        given.append(("guided_json", {"json": text}))
    if req.guided_regex is not None:
        given.append(("guided_regex", {"regex": req.guided_regex}))
    if req.guided_choice is not None:
        given.append(("guided_choice", {"choice": tuple(req.guided_choice)}))
    if len(given) > 1:
        raise APIError(f"give one of {', '.join(name for name, _ in given)}, not several", param=given[1][0])
    if not given:
        return None
    field, kwargs = given[0]
    try:  # too large or too deep to compile in time
        return field, StructuredOutput(**kwargs)
    except ValueError as err:
        raise APIError(str(err), param=field) from None


def check_model(req: SamplingFields, model_name: str) -> None:
    if (req.model or model_name) != model_name:
        raise APIError(f"the model {req.model!r} does not exist; this server has {model_name!r}",
                       status=404, param="model", code="model_not_found")


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: tuple[int | None, int | None],
                    grammar: StructuredOutput | None = None) -> tuple[SamplingParams, int, list[str]]:
    """A request's sampling parameters, its number of choices and its stop strings. max_tokens: the
    request's own or its endpoint's default; logprobs: how many top tokens the endpoint's fields ask
    for with each generated token and with each prompt token (None: no log-probabilities)."""
    bias = None
    if req.logit_bias:
        if not all(k.isascii() and k.isdigit() for k in req.logit_bias):
            raise APIError("logit_bias keys must be token ids (strings of digits)", param="logit_bias")
        bias = {int(k): v for k, v in req.logit_bias.items()}
    try:
        params = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0),
                                max_tokens=max_tokens, ignore_eos=req.ignore_eos, seed=req.seed,
                                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                repetition_penalty=req.repetition_penalty, min_p=req.min_p, logit_bias=bias,
                                min_tokens=req.min_tokens, stop_token_ids=req.stop_token_ids, logprobs=logprobs[0],
                                prompt_logprobs=logprobs[1], structured_output=grammar)
    except ValueError as err:
        raise APIError(str(err), param=param_of(err)) from None
    return params, req.n, [req.stop] if isinstance(req.stop, str) else req.stop or []
