"""Engines that are just enough of an LLMEngine for AsyncEngine and the app, for the failures a
real model cannot be made to show: a step that raises, a step that never returns."""

import threading
import time
from types import SimpleNamespace


class FakeEngine:
    """No model, no tokenizer: requests are taken and never advance; `step` is the subclass's."""

    tokenizer = None
    max_model_len = 64
    model_path = "fake"
    num_steps = 0
    last_step_tokens = 0
    config = SimpleNamespace(enable_prompt_logprobs=False, enable_prefix_caching=False,
                             page_size=4, num_pages=17,
                             kv_cache_dtype="auto", max_num_seqs=4, max_num_batched_tokens=64,
                             max_model_len=64)
    runner = SimpleNamespace(num_pages=17, kv_dtype_name="float32")
    max_num_seqs = 4  # every replica's slots
    num_kv_pages = 16  # every replica's usable pages

    def __init__(self):
        self.pending: set[str] = set()
        self.sampling_defaults = {}

    def stats(self):
        return dict(num_requests_running=len(self.pending), num_requests_waiting=0,
                    kv_cache_usage=0.0, num_preemptions=0, num_compilations_after_warmup=0,
                    kv_pages_total=16, kv_pages_free=16)

    def add_request(self, request_id, *args):
        self.pending.add(request_id)

    def abort(self, request_id):
        return self.pending.discard(request_id)

    def has_unfinished_requests(self):
        return bool(self.pending)

    def num_waiting_for_a_slot(self):
        return 0


class BrokenEngine(FakeEngine):
    """Its first step raises."""

    def step(self):
        raise RuntimeError("device lost")


class StuckEngine(FakeEngine):
    """Its step blocks until `release` is set (a hung device call), then makes no progress."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()
        self.stepping = threading.Event()

    def step(self):
        self.stepping.set()
        self.release.wait()
        return []


class SilentEngine(FakeEngine):
    """Steps that never produce a token: its requests stay open until aborted."""

    def step(self):
        time.sleep(0.005)
        return []
