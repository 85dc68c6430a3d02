"""The KV-aware router: one front for N kvforge replicas, each prompt sent where its prefix is cached.

    python -m frontend.router --repo model_repository \\
        --replica http://127.0.0.1:8010,http://127.0.0.1:9010,http://127.0.0.1:8012 --replica ...

A replica is one kvforge launcher, named by three URLs: its front (/v2), its OpenAI API (/v1)
and its metrics port. The router serves on one port (127.0.0.1:8080 by default) the generate
endpoints (/v2/models/<m>/generate, /generate_stream), the OpenAI API (/v1), its own /metrics
and readiness (/v2/health/ready, /health: 503 while no replica is ready). Nothing else is
forwarded: Triton's control APIs (repository, logging, trace, shared memory) and metadata go
to a replica directly.

Each request's prompt is tokenized and named block by block as the replicas' engines will;
each replica has an approximate index of the blocks it holds; the policy (kv by default) picks
the ready replica with the least work: docs/fleet.md says why. One request, in module order:

    prompts.py    the request's prompts: tokens and block chain hashes, read as the replicas read them
    replicas.py   each replica's URLs, load and approximate index; health: polled, leaving, returning
    policies.py   which replica: kv (the cost of the uncached prompt + load), round-robin, affinity
    relay.py      forwarding, one retry before the first token, responses relayed and read on the way
    app.py        the endpoints and /metrics (Starlette)
    __main__.py   the command: flags, checks, every replica verified, then serve (uvicorn)
"""
