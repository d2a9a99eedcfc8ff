"""HTTP edge: app factory, routes, schemas, tokenization, errors, auth, CLI, metrics."""
