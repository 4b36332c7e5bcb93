"""Layers shared by the model families: recurrences, attentions, MLPs, norms, the linear product."""
