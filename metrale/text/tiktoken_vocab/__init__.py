"""Tokenizers shipped as tiktoken vocabularies (Kimi's): the ``tiktoken.model`` file (``ranks.py``), which
family a folder holds and its split pattern (``families.py``), the conversion to a ``tokenizers`` backend
as ``transformers`` converts one (``backend.py``), loading such a folder (``folder.py``); and writing one
without downloads: a small BPE learned from text (``bpe_training.py``) in a Kimi release's files
(``kimi_writer.py``).
"""
