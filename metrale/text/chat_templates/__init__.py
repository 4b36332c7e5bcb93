"""Chat templates: rendering a chat with a Hugging Face Jinja template as ``transformers`` does
(``render.py``), and the families' formats written as such templates (``kimi.py``, ``qwen.py``).
"""
