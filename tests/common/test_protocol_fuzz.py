"""Property-based fuzzing of the one decoder every socket uses: whatever arrives, `decode`
returns a message or raises ProtocolError, and `peek_request_id` returns a str."""
from __future__ import annotations

import msgspec
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from common.protocol import (
    MAX_BODY_BYTES,
    MESSAGE_CLASSES,
    RAW_PAYLOAD_TYPES,
    Abort,
    Chunk,
    ChunkBatch,
    Error,
    ErrorCode,
    FinishedRequest,
    Generate,
    Heartbeat,
    Hello,
    KvCompat,
    KvData,
    KvEnd,
    KvEvents,
    KvHandle,
    KvHello,
    KvLeaseUpdate,
    KvMore,
    KvPart,
    KvPull,
    KvPullFailed,
    KvPullVerdict,
    KvReady,
    KvWelcome,
    MessageType,
    Placed,
    ProtocolError,
    RequestsFinished,
    RunningRequest,
    Sampling,
    Status,
    StatusRequest,
    StoreEvents,
    StoreReply,
    StoreRequest,
    Submit,
    Tokens,
    TokensBatch,
    Welcome,
    WorkerStatus,
    decode,
    encode,
    peek_request_id,
)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TOKENS = Tokens(request_id="r-1", token_ids=[1, 2, 3], finished=True, finish_reason="eos", worker_id="w-0",
                num_prompt_tokens=4, logprobs=[{"token_id": 1, "logprob": -0.5, "top": [[1, -0.5]]}])
CHUNK = Chunk(request_id="r-1", token_ids=[7], text="hé", finished=True, finish_reason="stop")
VALID: dict[MessageType, tuple[msgspec.Struct, list]] = {
    MessageType.HELLO: (Hello(1, "w-0", "worker", "m", "t", 64, 16, 1024, "tcp://127.0.0.1:1",
                              "http://127.0.0.1:2", instance_id="i",
                              running=[RunningRequest("r-1", "tokenizer-1", 12, 3, 16)]), []),
    MessageType.WELCOME: (Welcome(accepted=True, abort=["r-1"]), []),
    MessageType.HEARTBEAT: (Heartbeat("w-0", 1, 2, 3, 4, 64, seq=7), []),
    MessageType.GENERATE: (Generate(request_id="r-1", sampling=Sampling(max_tokens=4, stop=["x"], seed=3),
                                    stream_address="tcp://127.0.0.1:9", deadline=1.5),
                           [np.array([5, 6, 7], dtype=np.uint32)]),
    MessageType.ABORT: (Abort(request_id="r-1"), []),
    MessageType.TOKENS: (TOKENS, []),
    MessageType.ERROR: (Error(request_id="r-1", code=ErrorCode.TIMEOUT, message="late"), []),
    MessageType.STATUS_REQUEST: (StatusRequest(), []),
    MessageType.STATUS: (Status("round_robin", [WorkerStatus("w-0", True, 0.1, 1, 0, 1, 2, 3, 64, "x")], 5, 6), []),
    MessageType.KV_EVENTS: (KvEvents("w-0", stored=[1, 2**63], removed=[3]), []),
    MessageType.SUBMIT: (Submit(request_id="c-1", sampling=Sampling(), prompt="hello"), []),
    MessageType.CHUNK: (CHUNK, []),
    MessageType.TOKENS_BATCH: (TokensBatch(items=[TOKENS, TOKENS]), []),
    MessageType.CHUNK_BATCH: (ChunkBatch(items=[CHUNK]), []),
    MessageType.PLACED: (Placed(request_id="r-1", worker_id="w-0"), []),
    MessageType.KV_HELLO: (KvHello(2, "decode-0", "ucx", KvCompat("m", "bfloat16", 4, 2, 64, 16), "00ff", 128,
                                   ucx_address=b"\x01\x02"), []),
    MessageType.KV_WELCOME: (KvWelcome(accepted=False, reason="block_size: 16 here, 32 there", field="block_size"),
                             []),
    MessageType.KV_PULL: (KvPull("r-1", 5, [1, 2, 3], [7, 8, 9], 2.5, 1 << 20), []),
    MessageType.KV_DATA: (KvData("r-1", 5, 0), [np.arange(8, dtype=np.uint8), np.zeros(3, dtype=np.uint8)]),
    MessageType.KV_END: (KvEnd("r-1", 5, "failed", "timeout", "deadline passed"), []),
    MessageType.KV_READY: (KvReady("r-1", "ab" * 16, [4, 5, 6], [2**63, 7], 40, 9, queue_s=0.01, prefill_s=0.2), []),
    MessageType.KV_LEASE: (KvLeaseUpdate("r-1", "ab" * 16, "prefill-1", "renew"), []),
    MessageType.STORE_EVENTS: (StoreEvents("kvstore-0", stored=[3, 4], stored_tiers=[0, 1], moved=[5],
                                           moved_tiers=[1], evicted=[6]), []),
    MessageType.STORE_REQUEST: (StoreRequest("put", 7, namespace=2**64 - 1, keys=[3, 4], parents=[2**64 - 1, 3],
                                             checksums=[1, 2]), [np.arange(8, dtype=np.uint8)] * 2),
    MessageType.STORE_REPLY: (StoreReply(7, True, "i-1", shm_path="/dev/shm/x", block_bytes=8, tiers=[0, 1],
                                         slots=[4, -1], lease_id=9, stats={"blocks": 2.0}),
                              [np.zeros(8, dtype=np.uint8)]),
    MessageType.REQUESTS_FINISHED: (RequestsFinished([FinishedRequest("r-1", 0.1, 3), FinishedRequest("r-2")]), []),
    MessageType.KV_PULL_FAILED: (KvPullFailed(Generate(
        request_id="r-2", sampling=Sampling(max_tokens=8), stream_address="tcp://127.0.0.1:9",
        kv_handle=KvHandle("prefill-1", "tcp://127.0.0.1:7141", "ab" * 16, "i-1", [4, 5, 6], [1, 2], 40, 9,
                           failed_on=["decode-2"])), "timeout", "deadline passed", reply_by=1.5),
        [np.array([5, 6, 7], dtype=np.uint32)]),
    MessageType.KV_PULL_VERDICT: (KvPullVerdict("r-2", "ab" * 16, "moved", worker_id="decode-3"), []),
    MessageType.KV_PART: (KvPart("r-3", "cd" * 16, 4, [8, 9], [2**63, 7], 400), []),
    MessageType.KV_MORE: (KvMore("r-3", KvHandle("prefill-1", "tcp://127.0.0.1:7141", "cd" * 16, "i-1", [8, 9],
                                                 [2**63, 7], 400, -1, part=True, first_block=4)), []),
}
# A decode worker's Generate: the prompt is computed elsewhere; pull its KV.
HANDED_OFF = Generate(request_id="r-2", sampling=Sampling(max_tokens=8), stream_address="tcp://127.0.0.1:9",
                      kv_handle=KvHandle("prefill-1", "tcp://127.0.0.1:7141", "ab" * 16, "i-1", [4, 5, 6], [1, 2],
                                         40, 9))


def frames_of(kind: MessageType) -> list[bytes]:
    message, payloads = VALID[kind]
    return [bytes(frame) for frame in encode(message, payloads)]


def assert_decodes_or_refuses(frames: list[bytes]) -> None:
    try:
        message, payloads = decode(frames)
    except ProtocolError:
        pass
    else:  # anything else escaping is the failure hypothesis reports
        assert type(message) in MESSAGE_CLASSES.values()
        raw = type(message) in {MESSAGE_CLASSES[kind] for kind in RAW_PAYLOAD_TYPES}
        assert all(array.dtype == np.dtype("u1" if raw else "<u4") for array in payloads)
    assert isinstance(peek_request_id(frames), str)


@st.composite
def mutated(draw, frames: list[bytes]) -> list[bytes]:
    """`frames` with a few byte-level edits: flips, insertions, deletions, truncation,
    another type byte, frames added or dropped."""
    frames = list(frames)
    for _ in range(draw(st.integers(1, 4))):
        index = draw(st.integers(0, len(frames) - 1))
        data = bytearray(frames[index])
        edit = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "type", "frame"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if edit == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif edit == "set" and data:
            data[at] = draw(st.integers(0, 255))
        elif edit == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif edit == "delete" and data:
            del data[at:at + draw(st.integers(1, 8))]
        elif edit == "truncate":
            del data[at:]
        elif edit == "type":
            frames[0] = bytes([draw(st.integers(0, 255))])
            continue
        elif edit == "frame":
            if draw(st.booleans()) and len(frames) > 1:
                frames.pop(index)
            else:
                frames.append(draw(st.binary(max_size=64)))
            continue
        frames[index] = bytes(data)
    return frames


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12)


@st.composite
def reshaped(draw, kind: MessageType) -> list[bytes]:
    """A valid message's body with some fields given values of any msgpack type (and
    sometimes unknown fields), re-encoded: well-formed msgpack, wrong shapes."""
    message, payloads = VALID[kind]
    body = msgspec.to_builtins(message)
    names = list(body) + ["request_id", "unknown"]
    for _ in range(draw(st.integers(1, 3))):
        body[draw(st.sampled_from(names))] = draw(msgpack_values)
    frames = frames_of(kind)
    frames[1] = msgspec.msgpack.encode(body)
    return frames


@FUZZ
@given(st.lists(st.binary(max_size=256), max_size=5))
def test_arbitrary_frames_decode_or_raise_protocol_error(frames):
    assert_decodes_or_refuses(frames)


@FUZZ
@given(st.integers(0, 255), msgpack_values, st.lists(st.binary(max_size=64), max_size=2))
def test_any_msgpack_body_under_any_type_byte(type_byte, value, payloads):
    assert_decodes_or_refuses([bytes([type_byte]), msgspec.msgpack.encode(value), *payloads])


@FUZZ
@given(st.sampled_from(sorted(VALID)).flatmap(lambda kind: mutated(frames_of(kind))))
def test_mutated_valid_encodings_decode_or_raise_protocol_error(frames):
    assert_decodes_or_refuses(frames)


@FUZZ
@given(st.sampled_from(sorted(VALID)).flatmap(reshaped))
def test_valid_messages_with_fields_of_any_type_decode_or_raise_protocol_error(frames):
    assert_decodes_or_refuses(frames)


def test_every_message_type_has_a_valid_example_that_round_trips():
    assert set(VALID) == set(MessageType)
    for kind in MessageType:
        message, payloads = decode(frames_of(kind))
        assert message == VALID[kind][0]
        assert [p.tolist() for p in payloads] == [p.tolist() for p in VALID[kind][1]]
    message, payloads = decode([bytes(frame) for frame in encode(HANDED_OFF, [[5, 6, 7]])])
    assert message == HANDED_OFF and payloads[0].tolist() == [5, 6, 7]


def test_oversized_and_deeply_nested_bodies_are_protocol_errors():
    body = msgspec.msgpack.encode({"request_id": "r-9", "stop": ["x" * (MAX_BODY_BYTES // 2)] * 2})
    for frames in ([bytes([MessageType.SUBMIT]), body], [bytes([MessageType.TOKENS]), b"\x91" * 100_000]):
        try:
            decode(frames)
        except ProtocolError:
            continue
        raise AssertionError("decoded a message that breaks the limits")


def test_peek_recovers_the_request_id_of_a_refused_body():
    oversized = msgspec.msgpack.encode({"request_id": "r-9", "stop": ["x" * 600_000] * 2})
    assert peek_request_id([bytes([MessageType.GENERATE]), oversized]) == "r-9"
    assert peek_request_id([bytes([MessageType.SUBMIT]), msgspec.msgpack.encode({"request_id": 5})]) == ""
    assert peek_request_id([bytes([MessageType.SUBMIT]), b"\xc1"]) == ""
    assert peek_request_id([bytes([MessageType.SUBMIT])]) == ""
    assert peek_request_id([b"\x0b", msgspec.msgpack.encode({"request_id": "x" * 1000})]) == ""
