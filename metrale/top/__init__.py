"""``met top``: the operator's live view of the fleet, read from Redis alone (no gateway needed).

``queries/`` reads Redis into small dataclasses, one function per panel; ``tables.py`` turns them into
rows of text, shared by the Textual app (``widgets.py``, ``screens.py``, ``app.py``) and the plain
printout of ``--once`` (``plain.py``); ``source.py`` binds the queries to a client and key space, and
``control.py`` sends a worker an order.
"""
