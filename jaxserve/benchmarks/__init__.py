"""Benchmarks that answer users' questions, as vLLM's `vllm bench` does.

    throughput  offline: every request at once through `LLM`, requests/s and tokens/s
    serve       a client of any OpenAI-compatible server: TTFT, TPOT, ITL, E2EL, goodput
    sweep       concurrency and window sweeps (offline engine or a server), the batching-mode
                table, plots, the knee, and a recommended config under a latency SLO

Results carry vLLM's key names (`vllm bench serve --save-result`, `vllm bench throughput
--output-json`), so they compare directly. Imports the public engine API (LLM, LLMEngine) and
the simulator's metrics, never the runner or the model; only the CLI and the tools import it.
"""
