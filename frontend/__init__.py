"""kvforge's HTTP front: one process owning the public HTTP port(s) in front of Triton.

It bounds request bodies before they reach tritonserver, proxies Triton's /v2 HTTP API from a
private loopback port, and serves the OpenAI-compatible API (/v1) over Triton's gRPC streaming.
"""
