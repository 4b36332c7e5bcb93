"""Qwen3.5's chat format as a Jinja chat template (written after the release's format, described in
``shared/reference/qwen3.5-qwen3-next/README.md``), for release-shaped test folders.

ChatML: ``<|im_start|>ROLE\\n…<|im_end|>\\n``. With ``tools``, the first system turn lists them as JSON
lines inside ``<tools>…</tools>`` with the instructions for Qwen3-Coder XML calls, then the user's own
system prompt. An assistant turn's calls follow its text as ``<tool_call>\\n<function=NAME>\\n
<parameter=ARG>\\nVALUE\\n</parameter>\\n…</function>\\n</tool_call>`` blocks (the template iterates
``arguments|items``: strings raw, mappings and lists as JSON); consecutive ``tool`` messages become
one user turn, each result in ``<tool_response>\\n…\\n</tool_response>``. An assistant turn after the
last user query keeps its reasoning (``reasoning_content``, or a ``<think>`` block in its content) as
``<think>\\n…\\n</think>\\n\\n``; earlier ones lose it. The generation prompt opens the assistant's turn
and a think block (``<think>\\n``), or an empty one (``<think>\\n\\n</think>\\n\\n``) when
``enable_thinking`` is false.
"""

from __future__ import annotations

TOOLS_INSTRUCTIONS = (
    "\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n"
    "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n"
    "</function>\\n</tool_call>"
)

QWEN3_5_CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is not none -%}"
    "{%- for part in content if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set system = messages[0]['role'] == 'system' if messages else false -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '" + TOOLS_INSTRUCTIONS + "' -}}"
    "{%- if system -%}{{- '\\n\\n' + render_content(messages[0]['content']) -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif system -%}"
    "{{- '<|im_start|>system\\n' + render_content(messages[0]['content']) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- set last = namespace(query=-1) -%}"
    "{%- for message in messages if message['role'] == 'user' -%}{%- set last.query = loop.index0 -%}{%- endfor -%}"
    "{%- set users = namespace(seen=-1) -%}"
    "{%- for message in messages -%}"
    "{%- set role = message['role'] -%}"
    "{%- if role == 'user' -%}{%- set users.seen = users.seen + 1 -%}{%- endif -%}"
    "{%- if role == 'system' and loop.first -%}"
    "{%- elif role in ['user', 'system'] -%}"
    "{{- '<|im_start|>' + role + '\\n' + render_content(message['content']) + '<|im_end|>\\n' -}}"
    "{%- elif role == 'assistant' -%}"
    "{%- set content = render_content(message['content']) -%}"
    "{%- set reasoning = message.get('reasoning_content') or '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if users.seen == last.query -%}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- content -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set function = call['function'] if call['function'] is defined else call -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- elif content -%}{{- '\\n\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n<function=' + function['name'] + '>\\n' -}}"
    "{%- for name, value in (function['arguments'] or {}) | items -%}"
    "{{- '<parameter=' + name + '>\\n' -}}"
    "{%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson -}}{%- endif -%}"
    "{{- '\\n</parameter>\\n' -}}"
    "{%- endfor -%}"
    "{{- '</function>\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + render_content(message['content']) + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- raise_exception('Unexpected message role: ' + role) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
"""The template a Qwen3.5-shaped folder's ``chat_template.jinja`` holds."""
