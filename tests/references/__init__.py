"""Stored answers of transformers on the two real models (SmolLM2-135M-Instruct, the
default, and Gemma 3 270M), so that the fast tier checks the real default model without
loading transformers. `python -m tests.references.regenerate` writes them, with
transformers alone (see README.md in this folder).
"""
