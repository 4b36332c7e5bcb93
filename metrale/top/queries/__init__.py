"""Plain functions reading Redis into small frozen dataclasses, one per panel of ``met top``.

Each costs Redis O(what it shows): index reads (sorted sets) and pipelines, no ``KEYS``, no ``SCAN``.
Clients are binary (``decode_responses=False``), as everywhere in Metrale; times are unix seconds and
``now`` is passed in, so a test pins it.
"""
