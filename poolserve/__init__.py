"""poolserve: a pooling microservice for language models (embed, classify, token-level, reward)."""
