"""Hand-written, not from a notebook: the server's /openapi.json, with this engine's limits in it.

FastAPI describes the routes; the endpoints read their bodies themselves (a size limit, the nesting
check, a worker thread for large ones), so their request and response bodies are written in here from
schema.py, with the limits of the engine being served. Hand-written module (chapter 08)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from miniinfer.serving.openai import schema
from miniinfer.serving.openai.completions import Completions
from miniinfer.serving.openai.door import Bounds


def _json_schema(model: type[BaseModel] | None, event_stream: bool = False) -> dict:
    content: dict[str, dict] = {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}} \
        if model else {}
    if event_stream:  # stream=true: Server-Sent Events, each carrying a chunk of the response
        data = {"type": "string", "description": "a chunk of the response as JSON, or [DONE] at the end"}
        content["text/event-stream"] = {"schema": {"type": "object", "required": ["data"],
                                                   "properties": {"data": data}}}
    return {"content": content}


def _token_ids_below(schema, vocab_size: int) -> None:
    """Give every token id (an integer >= 0) in a prompt's schema this vocabulary's bound."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer" and schema.get("minimum") == 0:
            schema["maximum"] = vocab_size - 1
        for value in schema.values():
            _token_ids_below(value, vocab_size)
    elif isinstance(schema, list):
        for value in schema:
            _token_ids_below(value, vocab_size)


def openapi_schema(app: FastAPI, limits: Bounds, endpoints: list[Completions]) -> dict:
    """FastAPI's schema of the routes, with the request bodies and responses of schema.py and
    this engine's limits: the endpoints read their bodies themselves (size limit, nesting, a
    worker thread). One limit is left out, as JSON Schema cannot relate two fields: the prompt's
    tokens and max_tokens together must fit the context."""
    api = get_openapi(title=app.title, version=app.version, routes=app.routes)
    models: list[type[BaseModel]] = [schema.CompletionRequest, schema.ChatCompletionRequest,
                                     schema.CompletionResponse, schema.ChatCompletionResponse,
                                     schema.ErrorResponse, schema.ModelList, schema.Health]
    components = api.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        s = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(s.pop("$defs", {}))
        components[model.__name__] = s
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        fields = components[name]["properties"]
        fields["n"]["maximum"] = limits.max_seqs
        for key in ("max_tokens", "max_completion_tokens"):
            if key in fields:
                fields[key]["anyOf"][0]["maximum"] = limits.max_model_len
    prompt = components["CompletionRequest"]["properties"]["prompt"]
    _token_ids_below(prompt, limits.vocab_size)
    for form in prompt["anyOf"]:  # a list of prompts: one sequence each at least
        if form.get("type") == "array" and form.get("maxItems", 0) > limits.max_seqs:
            form["maxItems"] = limits.max_seqs
    errors = {str(code): {"description": why, **_json_schema(schema.ErrorResponse)} for code, why in [
        (400, "a bad request"), (404, "no such model"), (413, "the body is too large"),
        (429, "too many slow grammars are compiling"), (500, "the server failed"),
        (503, "the server is shutting down (Retry-After says when to try again)")]}
    for endpoint in endpoints:
        op = api["paths"][endpoint.path]["post"]
        op["requestBody"] = {"required": True, **_json_schema(endpoint.request)}
        op["responses"] = {"200": {"description": "the response, or with stream=true its events",
                                   **_json_schema(endpoint.response, event_stream=True)}, **errors}
    gets: list[tuple[str, type[BaseModel], dict]] = [
        ("/v1/models", schema.ModelList, {}),
        ("/health", schema.Health,
         {"503": {"description": "the engine has stopped, or is shutting down", **_json_schema(schema.Health)}})]
    for path, model, extra in gets:
        api["paths"][path]["get"]["responses"] = {"200": {"description": "OK", **_json_schema(model)}, **extra}
    return api
