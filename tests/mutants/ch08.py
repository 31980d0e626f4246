"""Wrong answers to problem set 08 that its checks must reject: each named (or documented) for its mistake."""



from miniinfer.course import checks as testing


def sse_on_one_line(data):
    """Writes the data on a single 'data:' line: a newline in it ends the field, and the lines after it are lost."""
    return f"data: {data}\n\n"


def sse_without_the_blank_line(data):
    """Ends the event without a blank line: the client never dispatches it."""
    return "".join(f"data: {line}\n" for line in data.split("\n"))


def sse_escaping_newlines(data):
    """Writes newlines as the two characters backslash-n: the client gets them literally, not as newlines."""
    return "data: " + data.replace("\n", "\\n") + "\n\n"


class DecodeEachToken:
    """Decodes each add's ids on their own: a character split across adds comes out as replacement characters."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def add(self, ids):
        return self.tok.decode(ids)

    def finish(self):
        return ""


class EverythingSoFar(DecodeEachToken):
    """Hands out the whole text each time, not what is new."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.ids = []

    def add(self, ids):
        self.ids += ids
        return self.tok.decode(self.ids).replace("\ufffd", "")


class HoldEverything(DecodeEachToken):
    """Hands out nothing until finish: no text streams while it is generated."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.ids = []

    def add(self, ids):
        self.ids += ids
        return ""

    def finish(self):
        return self.tok.decode(self.ids)


async def stream_without_abort(outputs, abort):
    """Never calls abort: a client that leaves early leaves its request running."""
    while True:
        out = await outputs.get()
        yield out
        if out.finished:
            return


async def stream_stopping_before_the_finished_one(outputs, abort):
    """Returns before yielding the finished output: the last output is lost."""
    while True:
        out = await outputs.get()
        if out.finished:
            return
        yield out


async def stream_that_always_aborts(outputs, abort):
    """Calls abort in finally: also when the stream ended normally with the finished output."""
    try:
        while True:
            out = await outputs.get()
            yield out
            if out.finished:
                return
    finally:
        abort()


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_sse_event, sse_on_one_line),
    (testing.check_sse_event, sse_without_the_blank_line),
    (testing.check_sse_event, sse_escaping_newlines),
    (testing.check_detokenizer, DecodeEachToken),
    (testing.check_detokenizer, HoldEverything),
    (testing.check_detokenizer, EverythingSoFar),
    (testing.check_stream_request, stream_without_abort),
    (testing.check_stream_request, stream_that_always_aborts),
    (testing.check_stream_request, stream_stopping_before_the_finished_one),
]
