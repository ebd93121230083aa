"""The host half of the sampler controls: each request's allowed next tokens as a bitmask (bitmask.py,
the words the device unpacks), made from allowed_token_ids, bad_words, min_tokens
(token_masks.py) and structured output's grammars (grammar.py, llguidance: JSON schema, regex,
choice, EBNF; imported only where a grammar is compiled, so an engine that serves none starts
without the grammar library). Host only: numpy.

Imports config, request and text, never jax. Must never import the runner or the engine: they
import it.
"""
