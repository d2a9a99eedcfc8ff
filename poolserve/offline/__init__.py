"""The Python API: a model served in this process, called from plain Python.

    from poolserve.offline import PoolingEngine

    with PoolingEngine("sentence-transformers/all-MiniLM-L6-v2") as engine:
        vectors = engine.embed_array(["a text", "another"])

`AsyncPoolingEngine` is the same for asyncio code. Both take the server's settings
(`ServerSettings`, the flags of `poolserve serve` as keyword arguments) and run the server's own
start-up, engine and request pipeline, so their outputs equal the server's.
"""

from poolserve.offline.blocking import PoolingEngine
from poolserve.offline.engine import AsyncPoolingEngine
from poolserve.offline.outputs import Classification, Pooled, Ranked, Reply

__all__ = [
    "AsyncPoolingEngine",
    "Classification",
    "Pooled",
    "PoolingEngine",
    "Ranked",
    "Reply",
]
