"""Moved to launcher/redis_server.py; this name keeps `python -m runtime.redis_server` working."""
import sys

from launcher.redis_server import RedisServer, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
