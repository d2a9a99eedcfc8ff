"""The hand-written peer: FastAPI + sentence-transformers, one OpenAI-style embeddings route.

Run: `python -m bench.peers.fastapi_app --model DIR --port P`. This is what people write by hand:
load a SentenceTransformer, call `model.encode(texts)` in the threadpool per request, return the
OpenAI response shape. No batching across requests.
"""

from __future__ import annotations

import argparse

import uvicorn
from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel
from sentence_transformers import SentenceTransformer


class EmbeddingRequest(BaseModel):
    """OpenAI embeddings request (the fields this app reads)."""

    input: str | list[str]
    model: str | None = None


def create_app(model_dir: str) -> FastAPI:
    """An app serving one SentenceTransformer on CPU."""
    model = SentenceTransformer(model_dir, device="cpu")
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict[str, object]:
        texts = [body.input] if isinstance(body.input, str) else body.input
        vectors = await run_in_threadpool(model.encode, texts)
        return {
            "object": "list",
            "model": body.model or model_dir,
            "data": [
                {"object": "embedding", "index": i, "embedding": v.tolist()}
                for i, v in enumerate(vectors)
            ],
            # Not counted: a second tokenization would charge this peer work the others skip.
            "usage": {"prompt_tokens": 0, "total_tokens": 0},
        }

    return app


def main() -> None:
    """Parse flags and serve on loopback."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(create_app(args.model), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
