"""OpenAI-compatible aiohttp server (`hybridserve serve MODEL`).

Routes
- `POST /v1/completions`, `POST /v1/chat/completions`: non-streaming, or Server-Sent Events
  (`data: {chunk}` ... `data: [DONE]`; `stream_options.include_usage` adds a last chunk with
  `choices: []` and the usage). `n` > 1 runs n engine requests (seeded choices get distinct
  seeds, `sampling.seeds.choice_seed`, as in the offline `LLM`).
  Beyond OpenAI's fields: vLLM's `top_k`, `min_p`, `ignore_eos`, `min_tokens`,
  `repetition_penalty`, `stop_token_ids`, `skip_special_tokens`, `include_stop_str_in_output`, and
  `cache_salt` (a tenant's prefix-cache isolation). `usage.prompt_tokens_details.cached_tokens` is
  the engine's prefix-cache hit.
- `GET /v1/models`, `GET /v1/models/{id}`, `GET /health` (503 while the model loads or the server
  shuts down, 200 when ready), `GET /metrics` (Prometheus text, this app's own registry).
- vLLM's tokenizer routes `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.

Every request is validated (protocol.py) before anything reaches the engine; errors are
`{"error": {"message", "type", "param", "code"}}` with 400 (bad input), 401 (API key), 403 (a web
page of an origin not in --allowed-origins, a Host not the server's), 404 (model/route), 405, 408
(body not sent within --body-read-timeout), 413 (body size, refused before reading when the
declared length is over it), 415 (a body that does not say it is JSON), 503 + Retry-After (queue
full, loading, shutting down).
A connection whose request headers do not complete within --keep-alive-timeout is closed.
Unknown request fields are ignored with a logged warning (as vLLM), or refused with
--strict-request-fields.
Modules: app.py (routes, streaming, admission, shutdown), access.py (Host and Origin checks, CORS),
protocol.py (parsing and response shapes), sse.py (framing), metrics.py,
request_log.py (access, client-error and engine log lines), cli.py (`serve`).
"""
