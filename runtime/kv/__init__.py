"""KV memory: the packed rows of the runner's slots (rows.py), the host block pool
(block_pool.py) and the prefix cache over it (prefix_cache.py), loads from the tiers below RAM
(loads.py, tiers/), and the manager joining them for the scheduler (manager.py)."""
