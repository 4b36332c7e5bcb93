"""Tool calls in generated text: the formats models write them in, their parsers, forced-call grammars."""
