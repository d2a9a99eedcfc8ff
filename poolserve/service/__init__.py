"""The HTTP service: the app factory and CLI; layers edge, api, compat, frontend, observability."""
