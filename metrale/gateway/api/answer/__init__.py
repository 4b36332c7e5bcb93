"""From generated text to OpenAI's answer objects: a choice read as reasoning, content and tool calls
(``answer_parser.py``), tool calls as OpenAI writes them (``tool_call_output.py``), ``text_completion``
objects whole and as stream chunks (``completion_renderer.py``).
"""
