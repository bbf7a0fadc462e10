"""What the WebSocket stream reads of wsproto's frame and message decoders beyond
their published events (transport/_stream_read.py): whether a message was begun, how
many of its bytes are still to come, and whether the bytes already read hold a
close frame. wsproto does not publish that state; each reading falls back to the
answer that leaves the stream's behaviour as it was, were its shape to change.
"""

from __future__ import annotations

from typing import Any


def _begun(frames: Any, partial: bytearray | None, size: int) -> bool:
    """Whether the client has sent part of a message (or of a frame) and not the rest:
    a fragment or part of a frame's payload handed over, or bytes wsproto's frame
    decoder (``frames``) holds (a header, a control frame's payload). Without that
    private state, only what was handed over counts."""
    if partial is not None or size:
        return True
    try:
        return frames.header is not None or len(frames.buffer) > 0
    except (AttributeError, TypeError):
        return False


def _unread(frames: Any, texts: Any) -> int:
    """The bytes of the message being received that wsproto holds but has not handed
    over: the rest its pending frame header announced (payload not yet read) and the
    end of a UTF-8 character cut by a read. wsproto does not publish its decoders'
    state, so this reads them (``frames``: its FrameDecoder, ``texts``: its
    MessageDecoder); were that to change, 0, and a message over the limit is refused
    as its bytes arrive, as before."""
    try:
        header = frames.header
        if header is None or header.opcode.iscontrol():
            return 0
        left = header.payload_len - frames.payload_consumed
        decoder = texts.decoder
        if decoder is not None:
            left += len(decoder.getstate()[0])
    except (AttributeError, TypeError, IndexError):
        return 0
    return left if type(left) is int else 0


#: the opcodes of RFC 6455 (continuation, text, binary, close, ping, pong)
_OPCODES = frozenset((0x0, 0x1, 0x2, 0x8, 0x9, 0xA))


def _holds_close(frames: Any) -> bool:
    """Whether the bytes wsproto's frame decoder (``frames``) holds and has not parsed
    yet (read from the socket, so no read is needed) end a close frame: its frame
    headers are walked from where the decoder stands (past the rest of the frame it
    is in), payloads skipped, and the walk stops at anything wsproto would refuse
    (an unmasked frame, an opcode RFC 6455 does not define). wsproto does not publish
    its decoder's state, so this reads it; were that to change, False (the close is
    then seen when the loop reaches it, as before). It only says where to look: the
    close itself is what wsproto's events report."""
    return _close_in(frames, _ALL)[0]


#: an ``unwalked`` count that walks all :func:`_close_in` may
_ALL = 1 << 62


def _close_in(frames: Any, unwalked: int) -> tuple[bool, int]:
    """:func:`_holds_close`, walking only the last ``unwalked`` bytes of the decoder's
    buffer (or from where the decoder stands, if that is further on): what an
    earlier walk left unwalked plus the bytes fed since. The buffer only grows at
    its end and drops parsed bytes at its front, so a count from its end stays true
    between walks. Returns whether a close frame was found, and the bytes this walk
    leaves unwalked (from the first frame not whole yet, or one wsproto would refuse,
    to the end), for the next walk to add the bytes fed since to: so bytes fed a few
    at a time are walked once, not once a read. ``unwalked`` as it was when the
    decoder's state cannot be read."""
    try:
        header = frames.header
        buffer = frames.buffer
        data = buffer.buffer
        at = buffer.bytes_used
        if header is not None:
            at += header.payload_len - frames.payload_consumed
        if type(data) is not bytearray or type(at) is not int:
            return False, unwalked
    except (AttributeError, TypeError):
        return False, unwalked
    end = len(data)
    at = max(at, end - unwalked)
    while at + 2 <= end:
        first, second = data[at], data[at + 1]
        opcode, size = first & 0x0F, second & 0x7F
        if opcode not in _OPCODES or not second & 0x80:  # wsproto fails the stream here
            return False, end - at
        start = at
        at += 2
        if size == 126:
            size = int.from_bytes(data[at:at + 2], "big")
            at += 2
        elif size == 127:
            size = int.from_bytes(data[at:at + 8], "big")
            at += 8
        at += 4 + size  # the mask (a client's frames are masked) and the payload
        if at > end:  # cut by the read: what follows is not read yet
            return False, end - start
        if opcode == 0x8:
            return True, end - at
    return False, end - at


def _unparsed(frames: Any) -> int | None:
    """The bytes fed to wsproto's frame decoder (``frames``) and not parsed yet;
    None where its state cannot be read (see :func:`_holds_close`)."""
    try:
        left = len(frames.buffer.buffer) - frames.buffer.bytes_used
    except (AttributeError, TypeError):
        return None
    return left if type(left) is int else None
