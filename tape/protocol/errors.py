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
