"""The tokenizer of Metrale's built-in tiny model, trained at build time from a text in this module.

A byte-level BPE (GPT-2 style ``ByteLevel`` pre-tokenizer and decoder, no normalizer, no prefix space, so
every string round-trips): 256 byte tokens, 256 merges learned by ``tokenizers``' ``BpeTrainer`` on
``TRAINING_TEXT`` (ids 0..511), then five special tokens (ids 512..516). Training is deterministic, so
``write_builtin_tokenizer`` writes the same bytes on every machine and nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BPE_VOCAB_SIZE = 512
"""Byte tokens plus learned merges; the special tokens come after."""

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

BOS_ID = BPE_VOCAB_SIZE
EOS_ID = BPE_VOCAB_SIZE + 1
PAD_ID = BPE_VOCAB_SIZE + 2
IM_START_ID = BPE_VOCAB_SIZE + 3
IM_END_ID = BPE_VOCAB_SIZE + 4
BUILTIN_VOCAB_SIZE = BPE_VOCAB_SIZE + len(SPECIAL_TOKENS)
"""517: the size of the built-in model's embedding table."""

STOP_TOKEN_IDS = (EOS_ID, IM_END_ID)
"""What ends a generation: the document end, or the end of an assistant turn. A model config that uses
this tokenizer lists both as ``eos_token_id``."""

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call>"
)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' + '" + TOOLS_PREAMBLE.replace("\n", "\\n") + "' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '" + TOOLS_INSTRUCTIONS.replace("\n", "\\n") + "' + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] if part['type'] == 'text' %}{{ part['text'] }}{% endfor %}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{% if not loop.first or (message['content'] is string and message['content']) %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' }}{{ call['function']['name'] | tojson }}{{ ', \"arguments\": ' }}"
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message after one BOS. With ``tools``, a system
turn declaring them (one JSON object a line, Hermes/Qwen style) comes first; an assistant's earlier
calls follow its text as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` blocks (one a
line) and a tool's result is a ``tool`` turn. Every message renders on its own, so the rendering of a
chat prefix is a prefix of the rendering of the chat."""

TRAINING_TEXT = """\
The lighthouse keeper woke before dawn, as she had every morning for eleven years. She climbed the
ninety-two steps of the tower, wound the clockwork that turned the great lens, and wrote the time,
the wind and the state of the sea in a small blue notebook. On calm days the entries were short:
"Wind light from the west. Sea smooth. Two fishing boats out at six." On stormy days they filled a page.

People in the village below often asked her whether the work was lonely. She would smile and say that
a lighthouse is never lonely, because it is always talking to someone. Every ship that passes in the
night reads its signal, and every signal is a promise: here are the rocks, keep to the left, you are
nearly home. She liked to think that her light had answered thousands of questions that nobody had
asked out loud.

In the afternoons she repaired things. There was always something to mend: a window latch, a leaking
pipe, the handle of a kettle, a radio that would only pick up one station. She kept her tools in a
wooden box that had belonged to her father, and she knew each of them by the sound it made when she
set it down on the bench. A good tool, her father used to say, is one you forget you are holding.

When the weather turned cold, the children from the school came up the hill to visit. They asked how
far the light could be seen (about twenty miles on a clear night), how many bulbs she had replaced
(she had lost count), and whether she had ever seen a whale (three times, and once a whole family of
them). She showed them how the lens bent the light into a narrow beam, and how a small flame could be
made to shine across the whole bay. "It is not the size of the lamp," she told them, "it is the care
you take in pointing it."

Numbers mattered in her work. The light flashed every 7.5 seconds; the tower stood 38 metres above the
water; the supply boat came on the 1st and the 15th of each month, unless the swell was higher than 2
metres. She recorded the barometer at 06:00, 12:00 and 18:00, and she could tell from the way the
needle moved whether a storm would arrive by morning or pass to the north.

One winter a storm did arrive, stronger than any she had seen. The wind tore a shutter from its hinges
and the rain came sideways through the gap. The power failed at midnight. She lit the old oil lamp,
the one that had not been used for twenty years, and she turned the lens by hand, counting the seconds
aloud so that the rhythm would not change. At four in the morning a cargo ship radioed the harbour to
say that it had seen the light and found its way around the point. She did not stop turning until the
sun came up.

Afterwards, the village held a small dinner in her honour. She was embarrassed by the speeches and
left early, because someone had to check the clockwork before dark. Walking back up the hill, she
thought about how strange it was that the most important thing she had ever done was simply to keep
doing the same thing, carefully, one more time. Then she climbed the steps, wound the clock, and
wrote in the notebook: "Wind easing from the south. Sea still rough. All ships accounted for."

Questions and answers: What is a model? A model is a set of numbers that turns text into more text.
What is a token? A token is a small piece of text, such as a word, part of a word, or a single byte.
Why do we count tokens? Because every step of the model reads one token and writes the next one.
Can a model remember? It can, if we keep its state, and that is what a recurrent layer is for.
"""


def build_builtin_tokenizer() -> Tokenizer:
    """Train the byte-level BPE on ``TRAINING_TEXT`` and append the special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    if tokenizer.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(f"BPE training gave {tokenizer.get_vocab_size()} tokens, not {BPE_VOCAB_SIZE}")
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return tokenizer


def builtin_tokenizer_config() -> dict[str, object]:
    """The ``tokenizer_config.json`` that goes with the built-in tokenizer (HF field names)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
    }


def write_builtin_tokenizer(directory: Path) -> int:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory`` (created if needed).

    The files are byte-for-byte the same on every call. Returns the vocab size (``BUILTIN_VOCAB_SIZE``).
    """
    tokenizer = build_builtin_tokenizer()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    config_text = json.dumps(builtin_tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
    (directory / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
    return tokenizer.get_vocab_size(with_added_tokens=True)
