"""kvforge's service process: the bundled tritonserver under a supervisor, behind the HTTP front.

    python -m launcher --repo model_repository [--host H --http-port P ...] [-- COMMAND...]

tritonserver.py (the bundled binary as a process), supervisor.py (restarts it), keys.py (the
control key), __main__.py (the command line), redis_server.py (a local Redis for the KV tier),
harness.py (the launcher as a child process, for tests and benchmarks).
"""
