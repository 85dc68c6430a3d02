"""Code only Triton python-backend stubs import (as vllm_backend keeps src/utils/): request parsing,
the llm model's protocol, forwarding from the aliases. Triton loads every folder inside
model_repository/ as a model, so shared stub code lives here."""
