"""Served over HTTP: embeddings against Infinity and a FastAPI app (`bench served`), token-level
formats (`bench token`), rerank (`bench rerank`), several models in one server (`bench models`).
"""
