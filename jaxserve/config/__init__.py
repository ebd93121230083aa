"""Settings, frozen and validated when built: the engine's options (engine.py: EngineConfig and
its config files), the model's (model.py: ModelConfig from a checkpoint's config.json, with
family.py's family-by-family reading and quant.py's quantization_config), and the checks they
and the request's parameters share (checks.py).

Imports nothing of jaxserve but itself: the bottom layer. Everything above may import it; it must
never import anything above it (a setting that needs the engine to be read is in the wrong place).
"""
