"""`dsv4 serve`: an OpenAI- and Anthropic-compatible HTTP server over the engine (FastAPI + uvicorn).

    app.py          the application (routes, error objects, API key and body-size guard) and its uvicorn server
    engine_loop.py  the thread that owns the engine: requests and aborts in through a queue, updates out
    state.py        what the routes share: sampling parameters, submission, streaming, collection
    openai.py       /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize
    anthropic.py    /v1/messages (Anthropic's Messages API), /v1/messages/count_tokens
    protocol.py     the request and response bodies (pydantic)
    metrics.py      Prometheus metrics at /metrics

Importing it needs fastapi, uvicorn, pydantic and prometheus_client; nothing else in dsv4 imports it.
"""
