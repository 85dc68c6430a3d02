"""KV memory: the host block pool (block_pool.py), the manager of slots, prefix cache, loads and
swap (manager.py), and the tiers below RAM (tiers/)."""
