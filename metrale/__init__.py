"""Metrale: serve hybrid recurrent LLMs with exact recurrent state."""
