"""TEI's gRPC API (package tei.v1) on the front end's pipeline, beside the HTTP server."""
