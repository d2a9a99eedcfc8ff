"""The HTTP edge: middleware, the server process and its drain, error handlers; only the app
factory and the CLI import it."""
