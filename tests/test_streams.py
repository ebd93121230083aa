"""Request streams on the event loop, without an engine: a reader that stops reading holds one
output per choice however long the engine keeps producing (the newest cumulative output, or the
deltas added together), and it still gets everything and the end."""

import asyncio
from types import SimpleNamespace

from jaxserve.engine.request_stream import RequestStream
from jaxserve.request import CompletionOutput, RequestOutput
from jaxserve.server.streams import merge


def _output(rid: str, n: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2], [CompletionOutput(0, "x" * n, list(range(n)))],
                         finished=finished)


def _stream(rid: str, loop) -> RequestStream:
    return RequestStream(rid, SimpleNamespace(abort=lambda request_id: None,
                                              _forget=lambda stream: None), loop)


def test_a_stalled_reader_holds_only_the_newest_output():
    async def main():
        loop = asyncio.get_running_loop()
        stream = _stream("a", loop)
        for n in range(1, 1001):  # the engine runs on; nobody reads
            stream._push(_output("a", n, finished=n == 1000), float(n))
        assert len(stream._items) == 1
        outs = [out async for out in stream]
        assert [len(o.outputs[0].token_ids) for o in outs] == [1000] and stream.finished
        assert len(stream.inter_token_latencies) == 999  # timing is kept for every token

    asyncio.run(main())


def test_merged_streams_hold_one_output_per_choice():
    async def main():
        loop = asyncio.get_running_loop()
        streams = [_stream(rid, loop) for rid in ("a", "b")]
        merged = merge(streams)
        streams[0]._push(_output("a", 1), 1.0)
        got = [await anext(merged)]  # the reader starts, then stalls while both run on
        for n in range(2, 501):
            for s in streams:
                s._push(_output(s.request_id, n, finished=n == 500), float(n))
            await asyncio.sleep(0)  # the merge's pumps read each output as it comes
        got += [item async for item in merged]
        sizes = [(i, len(out.outputs[0].token_ids)) for i, out in got]
        assert sizes[0] == (0, 1) and sorted(sizes[1:]) == [(0, 500), (1, 500)]

    asyncio.run(main())


def test_a_stalled_reader_of_deltas_gets_them_added_together():
    """Deltas (the server's outputs) are added to the one the reader has not taken: nothing
    is lost, and the reader still holds one output."""
    async def main():
        loop = asyncio.get_running_loop()
        stream = RequestStream("a", SimpleNamespace(abort=lambda request_id: None,
                                                    _forget=lambda stream: None), loop,
                               delta=True)
        for n in range(1, 501):
            out = RequestOutput("a", None, [1, 2], [CompletionOutput(0, chr(64 + n % 26), [n])],
                                finished=n == 500)
            stream._push(out, float(n))
        assert len(stream._items) == 1
        outs = [out async for out in stream]
        assert len(outs) == 1 and outs[0].finished and stream.finished
        assert outs[0].outputs[0].token_ids == list(range(1, 501))
        assert outs[0].outputs[0].text == "".join(chr(64 + n % 26) for n in range(1, 501))
        assert len(stream.inter_token_latencies) == 499

    asyncio.run(main())
