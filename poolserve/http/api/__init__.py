"""The native routes (OpenAI, vLLM, admin) and their request bodies: thin translators into jobs."""
