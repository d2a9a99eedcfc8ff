"""The HTTP floor of `python -m bench frontend`: FastAPI + orjson, a constant embedding, no model.

Run: `python -m bench.frontend.floor --port P`. What any Python front end pays per request at
least: uvicorn (uvloop, httptools, one worker, as `poolserve serve` runs it), FastAPI's routing,
the body read and parsed, and an OpenAI-shaped answer encoded with orjson. No model, no
tokenizer, no engine: the gap between this and a server is that server's own per-request cost.
"""

from __future__ import annotations

import argparse

import orjson
import uvicorn
from fastapi import FastAPI, Request, Response

DIMENSIONS = 32  # the benchmark's tiny BERT's hidden size: the same answer size as the servers
EMBEDDING = [round(0.01 * (i + 1), 4) for i in range(DIMENSIONS)]


def create_app() -> FastAPI:
    """One embeddings route answering a constant vector, and the readiness routes."""
    app = FastAPI()

    @app.get("/ready")
    @app.get("/health")
    async def ready() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body = orjson.loads(await request.body())  # parsed, as every server must
        answer = {
            "object": "list",
            "model": body.get("model"),
            "data": [{"object": "embedding", "index": 0, "embedding": EMBEDDING}],
            "usage": {"prompt_tokens": 0, "total_tokens": 0},
        }
        return Response(orjson.dumps(answer), media_type="application/json")

    return app


def main() -> None:
    """Serve on loopback with poolserve's uvicorn settings (poolserve/http/edge/server.py)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(
        create_app(),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        ws="none",
        workers=1,
        log_level="warning",
        access_log=False,
        server_header=False,
    )


if __name__ == "__main__":
    main()
