from __future__ import annotations

import json
from typing import Any

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from metrale.text.builtin_tokenizer import CHAT_TEMPLATE as CHATML
from metrale.text.chat_templates.render import ChatTemplateError, compile_template, render_chat, turn_boundaries

SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": None}

TEMPLATES = {
    "chatml": CHATML,
    "llama2-style": (
        "{% if messages[0]['role'] == 'system' %}"
        "{% set system = messages[0]['content'] %}{% set rest = messages[1:] %}"
        "{% else %}{% set system = none %}{% set rest = messages %}{% endif %}"
        "{% for message in rest %}\n"
        "    {% if message['role'] == 'user' %}\n"
        "{{ bos_token }}[INST] {% if loop.first and system %}<<SYS>>{{ system }}<</SYS>> {% endif %}"
        "{{ message['content'] | trim }} [/INST]\n"
        "    {% else %}\n"
        " {{ message['content'] | trim }} {{ eos_token }}\n"
        "    {% endif %}\n"
        "{% endfor %}"
    ),
    "tools-tojson": (
        "{% if tools %}Tools:\n{% for tool in tools %}{{ tool | tojson(indent=2) }}\n{% endfor %}{% endif %}"
        "{% for message in messages %}{{ message['role'] }}: {{ message | tojson }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    ),
    "loop-controls-and-namespace": (
        "{% set ns = namespace(users=0) %}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{% continue %}{% endif %}"
        "{% set ns.users = ns.users + (1 if message['role'] == 'user' else 0) %}"
        "<{{ message['role'] }}>{{ message['content'] }}"
        "{% if ns.users > 1 %}{% break %}{% endif %}"
        "{% endfor %}|users={{ ns.users }}"
    ),
    "generation-block": (
        "{% for message in messages %}"
        "{% if message['role'] == 'assistant' %}"
        "{% generation %}A: {{ message['content'] }}{% endgeneration %}"
        "{% else %}U: {{ message['content'] }}{% endif %}\n"
        "{% endfor %}"
    ),
}

MESSAGES = [
    {"role": "system", "content": "Réponds en français <b>brièvement</b>."},
    {"role": "user", "content": "  Combien de marches ?  "},
    {"role": "assistant", "content": "Quatre-vingt-douze. 🗼"},
    {"role": "user", "content": 'Et le "feu" ?'},
]

TOOLS = [{"name": "barometer", "description": "Pressure in hPa — «now»", "parameters": {"type": "object"}}]


def hf_render(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """The rendering ``transformers``' ``apply_chat_template`` would produce."""
    special = {name: token for name, token in SPECIAL_TOKENS.items() if token is not None}
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template, **special, **kwargs)
    return str(rendered[0])


@pytest.mark.parametrize("add_generation_prompt", [False, True], ids=["no-prompt", "generation-prompt"])
@pytest.mark.parametrize("template", TEMPLATES.values(), ids=TEMPLATES.keys())
def test_renders_like_transformers(template: str, add_generation_prompt: bool) -> None:
    ours = render_chat(
        template,
        MESSAGES,
        add_generation_prompt=add_generation_prompt,
        special_tokens=SPECIAL_TOKENS,
        tools=TOOLS,
    )
    theirs = hf_render(template, MESSAGES, add_generation_prompt=add_generation_prompt, tools=TOOLS)
    assert ours == theirs


def test_tojson_keeps_unicode_and_markup_and_takes_an_indent() -> None:
    value = {"text": "<b>café</b> 🌙", "n": [1, 2]}
    rendered = render_chat(
        "{{ value | tojson(indent=2) }}|{{ value | tojson }}",
        [],
        add_generation_prompt=False,
        special_tokens={},
        value=value,
    )
    assert rendered == json.dumps(value, ensure_ascii=False, indent=2) + "|" + json.dumps(value, ensure_ascii=False)


def test_special_tokens_that_are_none_stay_undefined() -> None:
    template = "{{ bos_token }}|{{ pad_token is defined }}|{{ tools is none }}"
    rendered = render_chat(template, [], add_generation_prompt=False, special_tokens=SPECIAL_TOKENS)
    assert rendered == "<s>|False|True"


def test_strftime_now_formats_the_current_date() -> None:
    rendered = render_chat("{{ strftime_now('%Y') | int > 2000 }}", [], add_generation_prompt=False, special_tokens={})
    assert rendered == "True"


def test_raise_exception_becomes_a_chat_template_error_with_its_message() -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first turn must be user') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match=r"^first turn must be user$"):
        render_chat(template, MESSAGES, add_generation_prompt=True, special_tokens={})


@pytest.mark.parametrize(
    "template",
    [
        "{% for message in messages %}{{ message['content'] }",
        "{{ messages[0]['content'].no_such_method() }}",
        "{% set _ = messages.append({'role': 'user'}) %}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages[0]['content'] + 1 }}",
    ],
    ids=["syntax-error", "undefined-call", "mutation", "sandbox-escape", "type-error"],
)
def test_broken_or_hostile_templates_raise_chat_template_error(template: str) -> None:
    with pytest.raises(ChatTemplateError):
        render_chat(template, MESSAGES, add_generation_prompt=False, special_tokens={})


def test_each_template_is_compiled_once() -> None:
    template = "{{ messages | length }} messages (cache test)"
    assert compile_template(template) is compile_template(template)


def test_turn_boundaries_of_a_prefix_stable_template_end_every_turn() -> None:
    full = render_chat(CHATML, MESSAGES, add_generation_prompt=True, special_tokens=SPECIAL_TOKENS)
    turn_end = "<|im_end|>\n"
    expected, position = [], 0
    for _ in MESSAGES:
        position = full.index(turn_end, position) + len(turn_end)
        expected.append(position)
    assert turn_boundaries(CHATML, MESSAGES, special_tokens=SPECIAL_TOKENS) == expected


def test_turn_boundaries_skip_prefixes_that_render_differently() -> None:
    marks_last_turn = (
        "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}"
        "{% if loop.last %} [last]{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    whole_chat = render_chat(marks_last_turn, MESSAGES, add_generation_prompt=False, special_tokens={})
    assert turn_boundaries(marks_last_turn, MESSAGES, special_tokens={}) == [len(whole_chat)]


def test_turn_boundaries_skip_prefixes_the_template_refuses() -> None:
    must_end_with_user = (
        "{% if messages[-1]['role'] != 'user' %}{{ raise_exception('last turn must be user') }}{% endif %}"
        "{% for message in messages %}{{ message['content'] }};{% endfor %}"
    )
    messages = MESSAGES[1:]  # user, assistant, user
    full = render_chat(must_end_with_user, messages, add_generation_prompt=True, special_tokens={})
    first_turn_end = full.index(";") + 1
    assert turn_boundaries(must_end_with_user, messages, special_tokens={}) == [first_turn_end, len(full)]


def test_a_developer_message_renders_as_system_where_the_template_has_no_developer_role() -> None:
    developer = [{"role": "developer", "content": "Be brief."}, *MESSAGES[1:]]
    as_system = [{"role": "system", "content": "Be brief."}, *MESSAGES[1:]]
    ours = render_chat(CHATML, developer, add_generation_prompt=True, special_tokens=SPECIAL_TOKENS)
    assert ours == hf_render(CHATML, as_system, add_generation_prompt=True)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in ours


def test_a_template_that_knows_the_developer_role_gets_it_as_sent() -> None:
    template = "{% for m in messages %}{% if m['role'] == 'developer' %}DEV:{% endif %}{{ m['content'] }}|{% endfor %}"
    ours = render_chat(
        template, [{"role": "developer", "content": "x"}], add_generation_prompt=False, special_tokens=SPECIAL_TOKENS
    )
    assert ours == "DEV:x|"
