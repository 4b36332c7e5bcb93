"""What every generation route does before it submits, in order: the body, the model and the limits
(``intake.py``), the prompt's token ids (``prompts.py``), tool fields checked and planned (``tools.py``),
``response_format`` to a grammar (``structured_outputs.py``), the ``GenerateRequest`` with its sampling
values checked (``sampling.py``); work that grows with the request runs off the event loop (``off_loop.py``).
"""
