"""Metrale: serve hybrid recurrent LLMs with exact recurrent state."""

import os

# MKL's strict Conditional Numerical Reproducibility: every element of a CPU float32 product is summed in
# one order whatever the number of rows and threads, so a prompt's rows give the same bits in any chunk
# of any batch (without it MKL picks its kernels and thread split by the product's size: on an AVX-512
# Xeon a row's bits differ between products of 1, 2–15 and 16+ rows, and with two threads up to 175).
# Read at MKL's first call, so set at import, before any product runs; a value the user set is kept.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
