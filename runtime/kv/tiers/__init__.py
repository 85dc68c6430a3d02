"""KV tiers below the host RAM pool: local disk and Redis, behind one interface (base.Tier).
Order: slot buffers -> RAM pool (runtime/kv/block_pool.py) -> disk -> Redis."""
