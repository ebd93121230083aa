"""Text: tokenizers (tokenizer.py: Hugging Face `tokenizers`, SentencePiece-style and byte-level
vocabularies, the byte tokenizer), chat templates (chat_template.py) and streaming detokenization
(detokenizer.py), tool calls and reasoning in model text (tool_parsers.py, reasoning.py). Host
only.

Imports jaxserve.config and jaxserve.request, never jax. Must never import the engine, the runner
or the model: the server, the engine's output processor and the grammars use it.
"""
