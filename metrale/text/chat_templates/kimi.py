"""Kimi's chat format as a Jinja chat template (written after the Kimi-Linear / Kimi-K2 releases' own).

Every turn is ``<|im_{kind}|>{role}<|im_middle|>{content}<|im_end|>`` with no newlines between turns:
``<|im_user|>user``, ``<|im_assistant|>assistant``, ``<|im_system|>system`` and ``<|im_system|>tool``.
Tools are declared first, in a ``<|im_system|>tool_declare<|im_middle|>`` turn holding the tools as compact
JSON. A chat that does not open with a system message gets a default one. An assistant turn's tool calls
follow its text inside ``<|tool_calls_section_begin|>…<|tool_calls_section_end|>``, each as
``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{arguments}<|tool_call_end|>``, where
IDX counts the calls of the whole chat from 0; a tool result reads ``## Return of functions.NAME:IDX``
then its content, naming the call whose ``id`` its ``tool_call_id`` is (or that id as it is, if no call
has it). A turn renders the same whatever follows it, so a chat prefix renders as a prefix.
"""

from __future__ import annotations

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant"

KIMI_CHAT_TEMPLATE = (
    "{%- macro render_content(message) -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro call_id(call, index) -%}"
    "{{- 'functions.' ~ call['function']['name'] ~ ':' ~ index -}}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "<|im_system|>tool_declare<|im_middle|>{{- tools | tojson(separators=(',', ':')) -}}<|im_end|>"
    "{%- endif -%}"
    "{%- if messages and messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>"
    "{%- endif -%}"
    "{%- set calls = namespace(count=0) -%}"
    "{%- for message in messages -%}"
    "{%- set role = message['role'] -%}"
    "{%- if role == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- elif role in ['system', 'tool'] -%}<|im_system|>{{- role -}}<|im_middle|>"
    "{%- else -%}{{- raise_exception('Unknown role: ' ~ role) -}}"
    "{%- endif -%}"
    "{%- if role == 'tool' -%}"
    "{%- set found = namespace(id=message.get('tool_call_id'), count=0) -%}"
    "{%- for earlier in messages[:loop.index0] if earlier['role'] == 'assistant' -%}"
    "{%- for call in earlier.get('tool_calls') or [] -%}"
    "{%- if call.get('id') is not none and call.get('id') == message.get('tool_call_id') -%}"
    "{%- set found.id = call_id(call, found.count) -%}"
    "{%- endif -%}"
    "{%- set found.count = found.count + 1 -%}"
    "{%- endfor -%}"
    "{%- endfor -%}"
    "## Return of {{ found.id }}\n{{ render_content(message) }}"
    "{%- else -%}"
    "{{- render_content(message) -}}"
    "{%- endif -%}"
    "{%- if role == 'assistant' and message.get('tool_calls') -%}"
    "<|tool_calls_section_begin|>"
    "{%- for call in message['tool_calls'] -%}"
    "<|tool_call_begin|>{{- call_id(call, calls.count) -}}<|tool_call_argument_begin|>"
    "{%- if call['function']['arguments'] is string -%}{{- call['function']['arguments'] -}}"
    "{%- else -%}{{- call['function']['arguments'] | tojson -}}"
    "{%- endif -%}"
    "<|tool_call_end|>"
    "{%- set calls.count = calls.count + 1 -%}"
    "{%- endfor -%}"
    "<|tool_calls_section_end|>"
    "{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
"""The template ``chat_template.jinja`` of a release-shaped folder holds."""
