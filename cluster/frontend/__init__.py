"""The OpenAI/HTTP front: routes, request models, admission, API keys, metrics and the replica pool."""
