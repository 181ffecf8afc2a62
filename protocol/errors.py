"""The one exception type every decoder raises."""


class ProtocolError(ValueError):
    """Bytes that do not follow a Tape wire format.

    `reason` is a short machine-friendly tag (used as a metrics label),
    `offset` the byte offset in the input where the problem was found.
    """

    def __init__(self, reason: str, detail: str, offset: int = 0):
        self.reason = reason
        self.detail = detail
        self.offset = offset
        super().__init__(f"{reason}: {detail} (at offset {offset})")


class InvariantViolation(RuntimeError):
    """A core found its own state impossible (two leaders in a term, a seq
    applied out of order, a journal ahead of what was stamped). The one
    class for every role: the process stops with exit 4 and a CRITICAL line
    rather than guess (tape.runtime.process). What the network sends is never
    this: it is input to count and drop."""
