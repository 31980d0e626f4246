"""OpenAI's HTTP API over the engine, one concern per module, in the order a request meets them.

Hand-written module (chapter 08): `schema` (the request and response bodies), `params` (a body becomes
`SamplingParams`, or an `APIError` naming its field), `completions` and `chat` (each endpoint's prompts
and response shapes), `openapi` (the published schema with this engine's limits), `metrics`
(Prometheus text). `miniinfer.serving.server` runs them behind FastAPI. Submodules load when named."""

from miniinfer import submodules

__getattr__ = submodules(__name__)
