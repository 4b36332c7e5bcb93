"""One module per model family: its decoder, built from ``worker/model/layers``."""
