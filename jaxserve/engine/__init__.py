"""The engine: the loop run once per iteration (loop.py: schedule -> dispatch -> read -> outputs
-> update, over any Runner: the model runner, the simulator's device, the tests' fake), the way
out (outputs.py: stops, text deltas, RequestOutputs), LLMEngine (llm_engine.py: one engine over
one runner or one per data-parallel replica), AsyncEngine and its per-request streams
(async_engine.py, request_stream.py: the server's engine thread) and a follower process of a
multi-process deployment (follower.py).

Imports every layer below it: config, request, text, core, structured, the runner (lazily, when
a model runs here), parallel, demo. loop.py and outputs.py are host only. Must never import the
server, the simulator, the benchmarks or the tools: they stand on it.
"""
