"""A reasoning model's thinking apart from its answer, as vLLM's `--reasoning-parser` splits it:
`<think>...</think>` becomes `reasoning_content`, what follows `content`.

    qwen3        Qwen3: thinking when the answer opens with <think>, up to </think>; an answer
                 without it is all content (enable_thinking off: the template wrote an empty
                 <think></think> into the prompt)
    deepseek_r1  DeepSeek-R1 and its distillations: the template opens <think> (an answer
                 may open it again), so all is thinking up to </think> (an answer cut short is
                 thinking only)

`split(name, text)` for a finished answer, `ReasoningStream` for its deltas. Host only.
"""

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def check_parser(name: str) -> str:
    if name not in PARSERS:
        raise ValueError(f"reasoning_parser {name!r}: one of {list(PARSERS)}")
    return name


def split(name: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a finished answer, each None when empty."""
    stream = ReasoningStream(name)
    events = stream.feed(text) + stream.finish()
    reasoning = "".join(t for kind, t in events if kind == "reasoning")
    content = "".join(t for kind, t in events if kind == "content")
    return reasoning or None, content or None


class ReasoningStream:
    """`feed(delta)` and `finish()` return ("reasoning" | "content", text) events; text that
    may be the start of a tag is held back until the next delta says."""

    def __init__(self, name: str):
        self.name = check_parser(name)
        self._text = ""  # held: not yet given out
        # "open": the answer's start, undecided; "thinking"; "answer"
        self._phase = "open"
        self._unopened = "thinking" if name == "deepseek_r1" else "answer"  # no <think> first

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self._text += delta
        events: list[tuple[str, str]] = []
        while True:
            if self._phase == "open":  # does the answer open with <think>?
                stripped = self._text.lstrip()
                if stripped.startswith(START):
                    self._text, self._phase = stripped[len(START):], "thinking"
                    continue
                if START.startswith(stripped):  # (empty, or a part of the tag): wait
                    return events
                self._phase = self._unopened
                continue
            if self._phase == "thinking":
                i = self._text.find(END)
                if i >= 0:
                    if self._text[:i]:
                        events.append(("reasoning", self._text[:i]))
                    self._text, self._phase = self._text[i + len(END):], "answer"
                    continue
                keep = tag_tail(self._text, END)
                if len(self._text) > keep:
                    events.append(("reasoning", self._text[:len(self._text) - keep]))
                    self._text = self._text[len(self._text) - keep:]
                return events
            if self._text:  # the answer
                events.append(("content", self._text))
                self._text = ""
            return events

    def finish(self) -> list[tuple[str, str]]:
        if not self._text:
            return []
        # an answer cut short while thinking is thinking; an undecided start is content
        phase = self._unopened if self._phase == "open" else self._phase
        kind = "reasoning" if phase == "thinking" else "content"
        text, self._text = self._text, ""
        return [(kind, text)]


def tag_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
