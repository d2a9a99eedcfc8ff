"""The front end: jobs, the one pipeline to the engine (parameters, limits, tokenization,
prompts, chat, pairs), gathering outputs and encoding answers."""
