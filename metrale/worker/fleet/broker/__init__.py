"""The worker's side of the fleet protocol on Redis, behind ``transport.WorkerTransport``: the transport
(``redis_transport.py``), its transactions packed by hand (``resp.py``) and, on a Redis Cluster, sent to
the primary of their slot (``cluster_router.py``); taking requests from every shard fairly
(``shard_intake.py``), reclaiming lost workers' requests (``reclaim.py``), letting go only of entries still
owned (``owned_entries.py``).
"""
