"""The step channel's frames: typed messages, authenticated and numbered; never pickle.

After `multiprocessing.connection`'s handshake (a challenge and answer under the shared
secret, both ways) each end sends a fresh random nonce, so every connection has its own
session id. A frame is then

  MAC (32 bytes) | sequence number (8, big-endian) | payload

with MAC = HMAC-SHA256(secret, channel id | sequence number | payload), where the channel
id names the direction (leader->follower or follower->leader) and the session. Each
direction numbers its frames from 0. A receiver checks the MAC (hmac.compare_digest), then
that the number is the next one it expects, and only then parses the payload: a forged or
altered frame, one sent under another key, one replayed or reordered, or one recorded on
another connection raises FrameRefused before any of its bytes are interpreted.

A payload is a 4-byte header length, a JSON header, then the raw bytes of the arrays the
header lists:

  {"kind": "run", "arrays": [["<i4", [40]], ...], "body": {"model": ..., "batch": ...}}

A header value is JSON (null, bool, int, float, str, lists, objects with string keys);
{"$array": i} stands for the i-th listed array (a dtype from ALLOWED_DTYPES, a shape).
Decoding builds only numpy arrays from bytes and each kind's own value (an EngineConfig
through its constructor, so `__post_init__` validates it; a StepBatch; a string): an
unknown kind, type tag, dtype or field is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import hmac
import json
import math
import secrets
import struct

import numpy as np

from engine.batch import StepBatch
from engine.config import EngineConfig

MAC_BYTES = 32
NONCE_BYTES = 16
# A step's inputs are a few KiB to a few MiB (a grammar's token mask is [S, V / 32] int32);
# this only bounds what one frame can make a receiver hold.
MAX_FRAME_BYTES = 1 << 30
ALLOWED_DTYPES = frozenset({"|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8",
                            "<f2", "<f4", "<f8"})
ARRAY_TAG = "$array"
_SEQ = struct.Struct(">Q")
_LEN = struct.Struct(">I")


class FrameRefused(ValueError):
    """A frame that failed authentication, came out of order or does not decode."""


class Channel:
    """One end of an authenticated connection: numbers and MACs what it sends, checks what
    it receives. `accepts`: the kinds the other end may send."""

    def __init__(self, conn, key: bytes, session: bytes, leader: bool):
        self.conn = conn
        ours, theirs = b"leader->follower", b"follower->leader"
        if not leader:
            ours, theirs = theirs, ours
        self._send_mac = hmac.new(key, b"xlaserve-step-channel/" + ours + session, "sha256")
        self._recv_mac = hmac.new(key, b"xlaserve-step-channel/" + theirs + session, "sha256")
        self.accepts = frozenset({"failed"} if leader else {"runner", "run"})
        self.sent = self.received = 0

    def send(self, kind: str, value) -> None:
        self.send_payload(encode_message(kind, value))

    def send_payload(self, payload: bytes) -> None:
        seq = _SEQ.pack(self.sent)
        mac = self._send_mac.copy()
        mac.update(seq)
        mac.update(payload)
        self.conn.send_bytes(b"".join((mac.digest(), seq, payload)))
        self.sent += 1

    def recv(self) -> tuple[str, object]:
        """The next message; EOFError when the other end closed, FrameRefused if it is
        not authentic, not the next one or not well formed."""
        frame = memoryview(self.conn.recv_bytes(MAX_FRAME_BYTES))
        if len(frame) < MAC_BYTES + _SEQ.size:
            raise FrameRefused(f"a {len(frame)}-byte frame is too short to carry a MAC")
        seq, payload = frame[MAC_BYTES:MAC_BYTES + _SEQ.size], frame[MAC_BYTES + _SEQ.size:]
        mac = self._recv_mac.copy()
        mac.update(seq)
        mac.update(payload)
        if not hmac.compare_digest(frame[:MAC_BYTES], mac.digest()):
            raise FrameRefused("bad MAC: a forged or altered frame, another connection's "
                               "frame, or a different shared secret")
        number = _SEQ.unpack(seq)[0]
        if number != self.received:
            raise FrameRefused(f"sequence number {number}, expected {self.received}: a "
                               f"replayed or reordered frame")
        self.received += 1
        kind, value = decode_message(payload)
        if kind not in self.accepts:
            raise FrameRefused(f"this end takes no {kind!r} message")
        return kind, value

    def close(self) -> None:
        self.conn.close()


def open_leader_end(conn, key: bytes, timeout: float = 30.0) -> Channel:
    """After the handshake: the follower's nonce in, the leader's out."""
    if not conn.poll(timeout):
        raise FrameRefused(f"no nonce from the follower within {timeout:.0f}s")
    theirs = conn.recv_bytes(NONCE_BYTES)
    if len(theirs) != NONCE_BYTES:
        raise FrameRefused(f"a {len(theirs)}-byte nonce, not {NONCE_BYTES}")
    ours = secrets.token_bytes(NONCE_BYTES)
    conn.send_bytes(ours)
    return Channel(conn, key, ours + theirs, leader=True)


def open_follower_end(conn, key: bytes, timeout: float = 30.0) -> Channel:
    ours = secrets.token_bytes(NONCE_BYTES)
    conn.send_bytes(ours)
    if not conn.poll(timeout):
        raise FrameRefused(f"no nonce from the leader within {timeout:.0f}s")
    theirs = conn.recv_bytes(NONCE_BYTES)
    if len(theirs) != NONCE_BYTES:
        raise FrameRefused(f"a {len(theirs)}-byte nonce, not {NONCE_BYTES}")
    return Channel(conn, key, theirs + ours, leader=False)


# ---- messages ------------------------------------------------------------------------

def encode_message(kind: str, value) -> bytes:
    """("runner", EngineConfig), ("run", (model, StepBatch, fused)) or ("failed", text)
    -> a payload."""
    if kind == "runner":
        body = {f.name: getattr(value, f.name) for f in dataclasses.fields(EngineConfig)}
        body["speculative"] = None  # drafting is the leader's: followers only run steps
    elif kind == "run":
        model, batch, fused = value
        body = {"model": model, "batch": _batch_fields(batch), "fused": fused}
    elif kind == "failed":
        body = {"message": str(value)[:4096]}
    else:
        raise ValueError(f"unknown step channel message {kind!r}")
    return encode(kind, body)


def decode_message(payload) -> tuple[str, object]:
    kind, body = decode(payload)
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise FrameRefused(f"unknown message kind {kind!r}")
    if not isinstance(body, dict):
        raise FrameRefused(f"a {kind!r} message must be an object")
    try:
        return kind, decoder(body)
    except (KeyError, TypeError, ValueError) as e:  # FrameRefused is a ValueError too
        raise FrameRefused(f"a malformed {kind!r} message: {e}") from None


def _decode_config(body: dict) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    if set(body) != names:
        raise ValueError(f"fields {sorted(set(body) ^ names)} differ from this EngineConfig's")
    for name, value in body.items():
        if value is not None and type(value) not in (bool, int, float, str):
            raise ValueError(f"{name} is a {type(value).__name__}")
    return EngineConfig(**body)  # __post_init__ validates


def _decode_run(body: dict) -> tuple[str, StepBatch, bool]:
    _fields(body, {"model", "batch", "fused"})
    return _typed(body["model"], str), _decode_batch(body["batch"]), _typed(body["fused"], bool)


def _decode_failed(body: dict) -> str:
    _fields(body, {"message"})
    return _typed(body["message"], str)


_DECODERS = {"runner": _decode_config, "run": _decode_run, "failed": _decode_failed}

# ---- StepBatch ---------------------------------------------------------------------------

_BATCH_FIELDS = {"bucket", "num_rows", "body", "sampling_ints", "sampling_floats", "resets",
                 "token_mask", "views"}


def _batch_fields(batch: StepBatch) -> dict:
    # Views go as windows of the body (offset, shape), so they arrive as views of it again.
    views = {}
    for name, view in batch.views.items():
        offset = _offset_in(batch.body, view)
        views[name] = view if offset is None else [offset, list(view.shape)]
    return {"bucket": list(batch.bucket), "num_rows": batch.num_rows, "body": batch.body,
            "sampling_ints": batch.sampling_ints, "sampling_floats": batch.sampling_floats,
            "resets": [list(r) for r in batch.resets],
            # the mask itself, not its maker (the leader has computed it already)
            "token_mask": None if batch.token_mask is None else np.asarray(batch.token_mask()),
            "views": views}


def _offset_in(body: np.ndarray, view: np.ndarray) -> int | None:
    """Where `view` starts in `body` (in elements), if it is a contiguous window of it."""
    if (view.base is not body or view.dtype != body.dtype or body.ndim != 1
            or not (view.flags.c_contiguous and body.flags.c_contiguous)):
        return None
    offset, rest = divmod(view.ctypes.data - body.ctypes.data, body.itemsize)
    return offset if not rest and 0 <= offset and offset + view.size <= body.size else None


def _decode_batch(b) -> StepBatch:
    _fields(b, _BATCH_FIELDS)
    body = _array(b["body"], "<i4", 1)
    bucket = _typed(b["bucket"], list)
    if len(bucket) != 2:
        raise ValueError("bucket must be (tokens, sequences)")
    resets = []
    for reset in _typed(b["resets"], list):
        slot, prompt, output = _typed(reset, list)
        resets.append((_typed(slot, int), _array(prompt, "<i4", 1), _array(output, "<i4", 1)))
    mask = b["token_mask"]
    views = {}
    for name, view in _typed(b["views"], dict).items():
        if not isinstance(view, np.ndarray):
            offset, shape = _typed(view, list)
            offset, shape = _typed(offset, int), [_typed(d, int) for d in _typed(shape, list)]
            if offset < 0 or min(shape, default=0) < 0 or offset + math.prod(shape) > body.size:
                raise ValueError(f"view {name!r} lies outside the body")
            view = body[offset:offset + math.prod(shape)].reshape(shape)
        views[name] = view
    return StepBatch(
        bucket=(_typed(bucket[0], int), _typed(bucket[1], int)),
        num_rows=_typed(b["num_rows"], int), body=body,
        sampling_ints=_array(b["sampling_ints"], "<i4", 2),
        sampling_floats=_array(b["sampling_floats"], "<f4", 2), resets=resets,
        token_mask=None if mask is None else functools.partial(np.asarray,
                                                               _array(mask, "<i4", 2)),
        views=views)


def _fields(value, names: set[str]) -> None:
    if not isinstance(value, dict) or set(value) != names:
        raise ValueError(f"expected the fields {sorted(names)}")


def _typed(value, kind: type):
    if type(value) is not kind:  # exact: a bool is no int here
        raise ValueError(f"expected {kind.__name__}, got {type(value).__name__}")
    return value


def _array(value, dtype: str, ndim: int) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.dtype.str != dtype or value.ndim != ndim:
        raise ValueError(f"expected a {ndim}-d {dtype} array")
    return value

# ---- values: JSON with arrays beside it --------------------------------------------------


def encode(kind: str, body) -> bytes:
    arrays: list[np.ndarray] = []
    value = _encode_value(body, arrays)
    header = json.dumps({"kind": kind, "arrays": [[a.dtype.str, list(a.shape)] for a in arrays],
                         "body": value}, separators=(",", ":")).encode()
    return b"".join([_LEN.pack(len(header)), header, *(a.data for a in arrays)])


def _encode_value(x, arrays: list):
    kind = type(x)
    if x is None or kind in (bool, int, float, str):
        return x
    if kind is np.ndarray:
        a = np.ascontiguousarray(x, x.dtype.newbyteorder("<"))
        if a.dtype.str not in ALLOWED_DTYPES:
            raise TypeError(f"the step channel carries no {x.dtype} arrays")
        arrays.append(a)
        return {ARRAY_TAG: len(arrays) - 1}
    if kind is dict:
        if not all(type(k) is str and not k.startswith("$") for k in x):
            raise TypeError("the step channel's object keys are strings without a leading $")
        return {k: _encode_value(v, arrays) for k, v in x.items()}
    if kind in (list, tuple):
        return [_encode_value(v, arrays) for v in x]
    if isinstance(x, (np.bool_, np.integer, np.floating)):
        return x.item()
    for plain in (int, float, str):  # enums and other subclasses
        if isinstance(x, plain):
            return plain(x)
    raise TypeError(f"the step channel carries no {kind.__name__}")


def decode(payload) -> tuple[str, object]:
    """A payload -> (kind, body): JSON values and numpy arrays, nothing else."""
    payload = memoryview(payload)
    if len(payload) < _LEN.size:
        raise FrameRefused("a payload too short to carry a header")
    end = _LEN.size + _LEN.unpack_from(payload)[0]
    try:
        header = json.loads(bytes(payload[_LEN.size:end]))
        _fields(header, {"kind", "arrays", "body"})
        kind = _typed(header["kind"], str)
        specs = _typed(header["arrays"], list)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise FrameRefused(f"not a step channel header: {e}") from None
    data = bytearray(payload[end:])  # one copy, so the arrays are writable
    arrays, at = [], 0
    for spec in specs:
        if not (isinstance(spec, list) and len(spec) == 2 and spec[0] in ALLOWED_DTYPES
                and isinstance(spec[1], list)
                and all(type(d) is int and d >= 0 for d in spec[1])):
            raise FrameRefused(f"not an array of an allowed dtype: {str(spec)[:100]}")
        dtype, count = np.dtype(spec[0]), math.prod(spec[1])
        if at + count * dtype.itemsize > len(data):
            raise FrameRefused("the arrays overrun the frame")
        arrays.append(np.frombuffer(data, dtype, count, at).reshape(spec[1]))
        at += count * dtype.itemsize
    if at != len(data):
        raise FrameRefused(f"{len(data) - at} bytes after the arrays")
    try:
        return kind, _decode_value(header["body"], arrays)
    except RecursionError:
        raise FrameRefused("a header nested too deeply") from None


def _decode_value(x, arrays: list):
    if isinstance(x, list):
        return [_decode_value(v, arrays) for v in x]
    if isinstance(x, dict):
        if any(k.startswith("$") for k in x):
            index = x.get(ARRAY_TAG)
            if len(x) == 1 and type(index) is int and 0 <= index < len(arrays):
                return arrays[index]
            raise FrameRefused(f"unknown type tag in {sorted(x)[:5]}")
        return {k: _decode_value(v, arrays) for k, v in x.items()}
    return x  # JSON's null, bool, int, float, str
