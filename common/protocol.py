"""Every message that crosses a process boundary, typed, in one module.

Wire format (a ZeroMQ multipart message, after any routing identity frames):
  frame 0  one byte: the MessageType
  frame 1  the message body, msgpack (a msgspec Struct, encoded as a map)
  frame 2… payloads: token id arrays as raw little-endian uint32, zero-copy
Decoding checks the type byte, the body's fields and types, the payload count and the
sizes, and raises ProtocolError naming what is wrong. Nothing is ever pickled.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from common.sampling_params import SamplingParams

PROTOCOL_VERSION = 7
MAX_BODY_BYTES = 1 << 20
MAX_TOKENS_PER_FRAME = 1 << 20
MAX_KV_FRAMES = 1024  # raw KV pieces in one KvData message


class ProtocolError(ValueError):
    """A frame that is not a valid message; the text says what is wrong."""


class MessageType(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    HEARTBEAT = 3
    GENERATE = 4
    ABORT = 5
    TOKENS = 6
    ERROR = 7
    STATUS_REQUEST = 8
    STATUS = 9
    KV_EVENTS = 10
    SUBMIT = 11
    CHUNK = 12
    TOKENS_BATCH = 13
    CHUNK_BATCH = 14
    PLACED = 15
    KV_HELLO = 16
    KV_WELCOME = 17
    KV_PULL = 18
    KV_DATA = 19
    KV_END = 20
    KV_READY = 21
    KV_LEASE = 22
    STORE_EVENTS = 23
    STORE_REQUEST = 24
    STORE_REPLY = 25
    REQUESTS_FINISHED = 26
    KV_PULL_FAILED = 27
    KV_PULL_VERDICT = 28
    KV_PART = 29
    KV_MORE = 30


# Not StrEnum (UP042): that changes str() and format() of a member from "ErrorCode.X" to its value.
class ErrorCode(str, enum.Enum):  # noqa: UP042
    INVALID_REQUEST = "invalid_request"
    OVERLOADED = "overloaded"
    UNAVAILABLE = "unavailable"
    WORKER_LOST = "worker_lost"
    TIMEOUT = "timeout"
    REFUSED = "refused"
    INTERNAL = "internal"
    KV_TRANSFER_FAILED = "kv_transfer_failed"


class Sampling(msgspec.Struct, forbid_unknown_fields=True):
    """SamplingParams on the wire (the engine validates ranges)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    stop: list[str] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None


class RunningRequest(msgspec.Struct, forbid_unknown_fields=True):
    """A request a worker is still serving, as it reports it when it (re)joins a router."""

    request_id: str
    origin: str  # the tokenizer that sent it (Generate.origin)
    num_prompt_tokens: int
    output_tokens: int
    max_tokens: int


class Hello(msgspec.Struct, forbid_unknown_fields=True):
    """A worker announcing itself to the router; a worker that rejoins (the router
    restarted, or dropped it) lists what it is still serving in `running`, then sends its
    whole prefix cache as KvEvents on the same socket."""

    protocol_version: int
    worker_id: str
    role: str
    model_fingerprint: str
    tokenizer_fingerprint: str
    kv_blocks: int
    block_size: int
    max_model_len: int
    events_address: str
    metrics_address: str
    instance_id: str = ""  # new per process: a hello from a new instance means a restart
    kv_dtype: str = ""  # with the fingerprints and block size, what roots its block hashes
    adapter_id: str = ""
    running: list[RunningRequest] = []
    kv_address: str = ""  # prefill role: where its KV transport serves the leased blocks
    session: str = ""  # a rejoin from a new connection: its registration's secret (Welcome.session)


class Welcome(msgspec.Struct, forbid_unknown_fields=True):
    """The router's answer to Hello: accepted, or refused with the reason."""

    accepted: bool
    reason: str = ""
    protocol_version: int = PROTOCOL_VERSION
    rehello: bool = False  # the router does not know this worker (any more): say hello again
    beat_seq: int = 0  # with rehello: the heartbeat it answers
    abort: list[str] = []  # of the hello's running requests, those the router already failed over
    # accepted: the secret the worker's heartbeats carry, which binds its heartbeat
    # connection to this registration (docs/architecture.md §3)
    session: str = ""
    retry_after_s: float = 0.0  # refused for now (another live connection holds the id): retry after this


class FinishedRequest(msgspec.Struct, forbid_unknown_fields=True):
    """A request a worker ended, with what the router learns from it."""

    request_id: str
    ttft_s: float = -1.0  # arrival at the worker to first token; -1 if none was produced
    output_tokens: int = 0


class Heartbeat(msgspec.Struct, forbid_unknown_fields=True):
    worker_id: str
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_blocks_total: int
    prefix_hit_tokens: int = 0
    computed_tokens: int = 0
    seq: int = 0  # numbers the heartbeats of one worker process
    session: str = ""  # the registration's secret from its Welcome; a beat without it is refused


class RequestsFinished(msgspec.Struct, forbid_unknown_fields=True):
    """Requests a worker ended in one turn of its loop, sent on its own socket as soon as
    the turn ends, so the router's count of what runs where is never a heartbeat late."""

    finished: list[FinishedRequest]


class KvHandle(msgspec.Struct, forbid_unknown_fields=True):
    """What a decode worker needs to pull a prefilled request's prompt KV: the prefill
    worker's lease (docs/architecture.md §7) and where to pull it from."""

    prefill_worker_id: str
    kv_address: str
    lease_id: str
    prefill_instance_id: str  # the prefill process (Hello.instance_id): a restart there needs a new handshake
    block_ids: list[int]  # block_ids[i] holds the prompt's tokens [i·block_size, (i+1)·block_size)
    block_hashes: list[int]  # the names of the full blocks
    num_tokens: int
    first_token_id: int
    queue_s: float = 0.0  # on the prefill worker: arrival to first step
    prefill_s: float = 0.0  # on the prefill worker: first step to first token
    first_logprob: dict[str, Any] | None = None  # the first token's, when the request asked for logprobs
    failed_on: list[str] = []  # decode workers whose pull of this lease failed: the router re-placed it since
    # A part (docs/disaggregation.md §2.1): the lease holds prompt blocks [first_block,
    # first_block + len(block_ids)) of a prompt still being prefilled, and first_token_id
    # is not known yet; the handle of the whole prompt comes later (KvMore).
    part: bool = False
    first_block: int = 0


class Generate(msgspec.Struct, forbid_unknown_fields=True):
    """A tokenised request; the prompt's token ids travel as payload frame 0. With
    `kv_handle` (router to a decode worker) the prompt is already computed: pull its KV."""

    request_id: str
    sampling: Sampling
    stream_address: str  # where the worker PUSHes this request's tokens
    tenant: str = ""
    arrival_time: float = 0.0
    deadline: float = 0.0  # wall-clock seconds; 0 = none
    slo_class: str = ""  # names a configured SLO class; "" = the tenant's or the default
    origin: str = ""  # the sending tokenizer's identity, set by the router whatever the sender put
    kv_handle: KvHandle | None = None
    # Router to an engine, with a KV store, as the router's index knows them: the engine's
    # cache holds the prompt's first `store_from` blocks, and the store the next
    # len(store_tiers) blocks (in these tiers) but not the one after. None: unknown.
    store_from: int = 0
    store_tiers: list[int] | None = None


class Placed(msgspec.Struct, forbid_unknown_fields=True):
    """Router to tokenizer: the request is on a worker. What is sent and never placed is
    failed as unavailable when the router is lost."""

    request_id: str
    worker_id: str


class Abort(msgspec.Struct, forbid_unknown_fields=True):
    request_id: str
    reason: str = "abort"


class Tokens(msgspec.Struct, forbid_unknown_fields=True):
    """New tokens of one request from a worker; `finished` ends the stream."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    worker_id: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[dict[str, Any]] = []
    timings: dict[str, float] = {}  # a disaggregated request's split: queue_s, prefill_s, decode_wait_s, transfer_s
    # The output index of token_ids[0], where two workers send the same tokens: a
    # disaggregated request's first token comes from its prefill worker and again from
    # its decode worker, on two connections, in either order. -1: append.
    position: int = -1
    # Prompt logprobs (Sampling.prompt_logprobs): the records of prompt tokens
    # prompt_logprobs_start, prompt_logprobs_start + 1, ... (None for token 0), sent as
    # the prefill computes them, before the first token (docs/wire.md §3).
    prompt_logprobs: list[dict[str, Any] | None] = []
    prompt_logprobs_start: int = 0


class Error(msgspec.Struct, forbid_unknown_fields=True):
    """A failed request (or, with an empty request_id, a refused message)."""

    request_id: str
    code: ErrorCode
    message: str
    retry_after_s: float = 0.0
    worker_id: str = ""  # the worker that failed it, when one did


class KvReady(msgspec.Struct, forbid_unknown_fields=True):
    """Prefill worker to router: the prompt is computed, its first token streamed, and
    its KV held under this lease for the decode worker the router picks."""

    request_id: str
    lease_id: str
    block_ids: list[int]
    block_hashes: list[int]
    num_tokens: int
    first_token_id: int
    queue_s: float = 0.0
    prefill_s: float = 0.0
    first_logprob: dict[str, Any] | None = None
    # The request as the router sent it, with its prompt as payload frame 0, when this
    # router may not hold the hand-off: the worker rejoined a router (it restarted) since
    # the request came (docs/disaggregation.md §2).
    request: Generate | None = None


class KvPart(msgspec.Struct, forbid_unknown_fields=True):
    """Prefill worker to router: a prompt still being prefilled has its prompt blocks
    [first_block, first_block + len(block_ids)) computed, and holds them under this lease
    for the decode worker the router picks now (docs/disaggregation.md §2.1)."""

    request_id: str
    lease_id: str
    first_block: int
    block_ids: list[int]
    block_hashes: list[int]  # their names (every block of a part is full)
    num_tokens: int  # the whole prompt's


class KvMore(msgspec.Struct, forbid_unknown_fields=True):
    """Router to the decode worker importing a request from its parts: another part, or
    (`kv_handle.part` false) the lease on the whole prompt with its first token."""

    request_id: str
    kv_handle: KvHandle


class KvLeaseUpdate(msgspec.Struct, forbid_unknown_fields=True):
    """Decode worker to prefill worker, through the router: `renew` a lease while the
    request waits for room, or `release` it unpulled (the decode worker holds every block
    by hash, or gave the request up)."""

    request_id: str
    lease_id: str
    prefill_worker_id: str
    action: str  # renew | release


class StatusRequest(msgspec.Struct, forbid_unknown_fields=True):
    pass


class WorkerStatus(msgspec.Struct, forbid_unknown_fields=True):
    worker_id: str
    healthy: bool
    last_seen_s: float
    running: int
    waiting: int
    in_flight: int
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_blocks_total: int
    metrics_address: str
    role: str = "worker"


class Status(msgspec.Struct, forbid_unknown_fields=True):
    policy: str
    workers: list[WorkerStatus]
    requests_routed: int
    kv_events_received: int
    instance_id: str = ""  # the router process's own: another one means the router restarted


class KvEvents(msgspec.Struct, forbid_unknown_fields=True):
    """Blocks (by the hash of docs/kv-identity.md §1) that entered or left a worker's prefix cache."""

    worker_id: str
    stored: list[int] = []
    removed: list[int] = []


class Submit(msgspec.Struct, forbid_unknown_fields=True):
    """A client's request to the tokenizer: text in `prompt`, or token ids as payload 0."""

    request_id: str
    sampling: Sampling
    prompt: str | None = None
    api_key: str = ""
    timeout_s: float = 0.0  # 0 = the server's default
    slo_class: str = ""  # names a configured SLO class; "" = the tenant's or the default


class Chunk(msgspec.Struct, forbid_unknown_fields=True):
    """Tokenizer to client: new tokens and their text; the last one has `finished`."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[dict[str, Any]] = []
    timings: dict[str, float] = {}  # as Tokens.timings, gathered over the request's stream
    prompt_logprobs: list[dict[str, Any] | None] = []  # the next prompt tokens' records, in order (Tokens')


class TokensBatch(msgspec.Struct, forbid_unknown_fields=True):
    """One engine step's Tokens for every request that streams to the same tokenizer."""

    items: list[Tokens]


class ChunkBatch(msgspec.Struct, forbid_unknown_fields=True):
    """The Chunks ready for one client at once (one message instead of one per request)."""

    items: list[Chunk]


class KvCompat(msgspec.Struct, forbid_unknown_fields=True):
    """What two engines must agree on before KV moves between their pools."""

    model_fingerprint: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int


class KvHello(msgspec.Struct, forbid_unknown_fields=True):
    """KV puller to KV server, once per peer pair: the pool's compatibility fields and
    their hash (docs/kv-transfer.md §3), and for UCX the puller's worker address."""

    protocol_version: int
    peer_id: str
    transport: str
    compat: KvCompat
    compat_hash: str
    pool_blocks: int  # blocks in the puller's pool: the server plans against it
    ucx_address: bytes = b""
    block_major: bool = False  # the puller's pool is the KV store's (common/kv_transfer/plan.py)


class KvWelcome(msgspec.Struct, forbid_unknown_fields=True):
    """The KV server's answer to KvHello; a refusal names the first field that differs."""

    accepted: bool
    reason: str = ""
    field: str = ""
    transport: str = ""
    pool_blocks: int = 0  # blocks in the server's pool
    block_major: bool = False  # the server's pool is the KV store's (common/kv_transfer/plan.py)


class KvPull(msgspec.Struct, forbid_unknown_fields=True):
    """Puller to server: send these exposed source blocks into these destination blocks
    (receives already posted). `nonce` tells this attempt from any other of the same id."""

    transfer_id: str
    nonce: int
    src_block_ids: list[int]
    dst_block_ids: list[int]
    timeout_s: float
    max_piece_bytes: int


class KvData(msgspec.Struct, forbid_unknown_fields=True):
    """Server to puller (ZeroMQ transport): pieces first_piece… of the transfer's plan,
    one raw payload frame each."""

    transfer_id: str
    nonce: int
    first_piece: int


class KvEnd(msgspec.Struct, forbid_unknown_fields=True):
    """Either side: the transfer ended. status is done (server: all sent; puller: all
    landed, release the blocks), failed (with code and reason) or cancelled."""

    transfer_id: str
    nonce: int
    status: str
    code: str = ""
    reason: str = ""


class KvPullFailed(msgspec.Struct, forbid_unknown_fields=True):
    """Decode worker to router: the pull of a handed-off request failed in a way another
    decode worker could avoid (`code`, docs/disaggregation.md §3); its blocks are freed
    and the lease may still be held. `request` is the Generate it was sent (with its
    `kv_handle`); the prompt's token ids travel as payload 0. The worker waits for a
    KvPullVerdict until `reply_by` (wall clock, time.time()); past that the router places
    the request nowhere else, and the worker falls back on kv_load_failure_policy."""

    request: Generate
    code: str
    reason: str = ""
    reply_by: float = 0.0


class KvPullVerdict(msgspec.Struct, forbid_unknown_fields=True):
    """Router to the decode worker of a KvPullFailed: `moved` (the request went to
    `worker_id`, another decode worker, with the same lease: drop it without a word) or
    `local` (no other can take it: fall back on kv_load_failure_policy here; `reason`
    says why)."""

    request_id: str
    lease_id: str
    action: str
    worker_id: str = ""
    reason: str = ""


class StoreEvents(msgspec.Struct, forbid_unknown_fields=True):
    """The KV store to the router (PUB): blocks it can now serve, blocks that moved between
    its tiers, blocks it no longer holds. Keys are chained block hashes
    (docs/kv-identity.md §1), so they already carry their model and tenant; tiers count
    0 = DRAM, 1 = SSD."""

    store_id: str
    stored: list[int] = []
    stored_tiers: list[int] = []  # the tier of each of `stored`
    moved: list[int] = []
    moved_tiers: list[int] = []  # the tier each of `moved` is in now
    evicted: list[int] = []


STORE_OPS = ("lookup", "get", "release", "put_start", "put_commit", "put_abort", "put", "remove", "pin",
             "unpin", "stats")
MAX_STORE_KEYS = 4096  # blocks named in one store request


class StoreRequest(msgspec.Struct, forbid_unknown_fields=True):
    """An engine to the KV store (docs/kvstore.md §5). `op` is one of STORE_OPS; the fields
    it reads are listed there. Keys and parents are chained block hashes under `namespace`
    (the chain's root hash); `inline` asks get for the bytes as raw frames (remote engines);
    a `put` carries one raw frame per key, its value."""

    op: str
    request_id: int
    namespace: int = 0
    keys: list[int] = []
    parents: list[int] = []  # put_start, put: each key's parent (the namespace itself: none)
    checksums: list[int] = []  # put_commit, put: CRC32C of each value
    tickets: list[int] = []  # put_commit, put_abort: from put_start's reply
    lease_id: int = 0  # release
    inline: bool = False
    transfer: bool = False  # get: expose the DRAM blocks for a pull over the store's KV transport


class StoreReply(msgspec.Struct, forbid_unknown_fields=True):
    """The store's answer to the StoreRequest of `request_id`. ok false: `code` (an
    ErrorCode value) and `reason` say what was refused. `instance_id` is new per store
    process (a change means it restarted); `shm_path` names its DRAM pool. get answers
    `tiers` and `slots` per block (slot -1: that block's bytes follow as a raw frame, in
    order); put_start answers `tickets` and `slots` per key (ticket 0: already stored)."""

    request_id: int
    ok: bool
    instance_id: str
    code: str = ""
    reason: str = ""
    shm_path: str = ""
    block_bytes: int = 0
    tiers: list[int] = []
    slots: list[int] = []
    tickets: list[int] = []
    checksums: list[int] = []  # get: CRC32C of each block's value, for the reader to verify its copy
    lease_id: int = 0
    count: int = 0  # put_commit, put: blocks newly stored; remove: blocks removed
    stats: dict[str, float] = {}
    kv_address: str = ""  # get with transfer: where to pull the slots from (transfer id "<instance_id>:<lease_id>")


MESSAGE_CLASSES: dict[MessageType, type[msgspec.Struct]] = {
    MessageType.HELLO: Hello,
    MessageType.WELCOME: Welcome,
    MessageType.HEARTBEAT: Heartbeat,
    MessageType.GENERATE: Generate,
    MessageType.ABORT: Abort,
    MessageType.TOKENS: Tokens,
    MessageType.ERROR: Error,
    MessageType.STATUS_REQUEST: StatusRequest,
    MessageType.STATUS: Status,
    MessageType.KV_EVENTS: KvEvents,
    MessageType.SUBMIT: Submit,
    MessageType.CHUNK: Chunk,
    MessageType.TOKENS_BATCH: TokensBatch,
    MessageType.CHUNK_BATCH: ChunkBatch,
    MessageType.PLACED: Placed,
    MessageType.KV_HELLO: KvHello,
    MessageType.KV_WELCOME: KvWelcome,
    MessageType.KV_PULL: KvPull,
    MessageType.KV_DATA: KvData,
    MessageType.KV_END: KvEnd,
    MessageType.KV_READY: KvReady,
    MessageType.KV_LEASE: KvLeaseUpdate,
    MessageType.STORE_EVENTS: StoreEvents,
    MessageType.STORE_REQUEST: StoreRequest,
    MessageType.STORE_REPLY: StoreReply,
    MessageType.REQUESTS_FINISHED: RequestsFinished,
    MessageType.KV_PULL_FAILED: KvPullFailed,
    MessageType.KV_PULL_VERDICT: KvPullVerdict,
    MessageType.KV_PART: KvPart,
    MessageType.KV_MORE: KvMore,
}
MESSAGE_TYPES = {cls: kind for kind, cls in MESSAGE_CLASSES.items()}
PAYLOAD_COUNTS = {MessageType.GENERATE: (1,), MessageType.KV_PULL_FAILED: (1,), MessageType.SUBMIT: (0, 1),
                  MessageType.KV_READY: (0, 1),
                  MessageType.KV_DATA: range(1, MAX_KV_FRAMES + 1),
                  MessageType.STORE_REQUEST: range(MAX_STORE_KEYS + 1),
                  MessageType.STORE_REPLY: range(MAX_STORE_KEYS + 1)}
RAW_PAYLOAD_TYPES = frozenset({MessageType.KV_DATA, MessageType.STORE_REQUEST, MessageType.STORE_REPLY})

_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in MESSAGE_CLASSES.items()}


def encode(message: msgspec.Struct, payloads: Sequence[npt.ArrayLike] | None = None) -> list[bytes | memoryview]:
    """Frames for `message`: type byte, body, then each payload's raw buffer (a payload is
    anything np.ascontiguousarray takes: an array, a list of token ids; for KvData the
    caller's contiguous byte views themselves, never copied)."""
    kind = MESSAGE_TYPES[type(message)]
    frames: list[bytes | memoryview] = [bytes([kind]), _ENCODER.encode(message)]
    for array in payloads or ():
        if kind in RAW_PAYLOAD_TYPES:
            frames.append(memoryview(array).cast("B"))  # type: ignore[arg-type]  # a buffer, as KvData's callers give
        else:
            frames.append(np.ascontiguousarray(array, dtype="<u4").data)
    return frames


def decode(frames: list[bytes]) -> tuple[msgspec.Struct, list[np.ndarray]]:
    """The message and its payload arrays; ProtocolError for anything malformed."""
    if len(frames) < 2:
        raise ProtocolError(f"expected at least 2 frames (type, body), got {len(frames)}")
    type_frame, body = bytes(frames[0]), frames[1]
    if len(type_frame) != 1:
        raise ProtocolError(f"type frame must be 1 byte, got {len(type_frame)}")
    try:
        kind = MessageType(type_frame[0])
    except ValueError:
        raise ProtocolError(f"unknown message type {type_frame[0]}") from None
    if len(body) > MAX_BODY_BYTES:
        raise ProtocolError(f"{kind.name} body is {len(body)} bytes, over the {MAX_BODY_BYTES} limit")
    try:
        message = _DECODERS[kind].decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise ProtocolError(f"bad {kind.name} body: {error}") from None
    allowed = PAYLOAD_COUNTS.get(kind, (0,))
    payload_frames = frames[2:]
    if len(payload_frames) not in allowed:
        counts = (f"{allowed.start}..{allowed.stop - 1}" if isinstance(allowed, range)
                  else " or ".join(map(str, allowed)))
        raise ProtocolError(f"{kind.name} carries {counts} payload frame(s), got {len(payload_frames)}")
    if kind in RAW_PAYLOAD_TYPES:
        return message, [np.frombuffer(frame, dtype=np.uint8) for frame in payload_frames]
    return message, [_token_array(kind, frame) for frame in payload_frames]


class _RequestIdOnly(msgspec.Struct):
    request_id: str = ""


_PEEK_DECODER = msgspec.msgpack.Decoder(_RequestIdOnly)
MAX_PEEKED_ID_CHARS = 256  # a longer id is not worth echoing in the refusal


def peek_request_id(frames: list[bytes]) -> str:
    """The str `request_id` of a body `decode` refused, when a loose look finds one ("" if
    not), so that the refusal reaches the request it is about."""
    if len(frames) < 2:
        return ""
    try:
        request_id = _PEEK_DECODER.decode(frames[1]).request_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""
    return request_id if len(request_id) <= MAX_PEEKED_ID_CHARS else ""


def _token_array(kind: MessageType, frame: bytes) -> np.ndarray:
    if len(frame) % 4:
        raise ProtocolError(f"{kind.name} token payload of {len(frame)} bytes is not a uint32 array")
    if len(frame) // 4 > MAX_TOKENS_PER_FRAME:
        raise ProtocolError(f"{kind.name} token payload has {len(frame) // 4} tokens, over the "
                            f"{MAX_TOKENS_PER_FRAME} limit")
    return np.frombuffer(frame, dtype="<u4")


def sampling_from_params(params: SamplingParams) -> Sampling:
    """Wire form of a SamplingParams."""
    return Sampling(max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k,
                    top_p=params.top_p, seed=params.seed, stop_token_ids=list(params.stop_token_ids),
                    stop=list(params.stop), ignore_eos=params.ignore_eos, logprobs=params.logprobs,
                    prompt_logprobs=params.prompt_logprobs)


def params_from_sampling(sampling: Sampling) -> SamplingParams:
    """SamplingParams from its wire form (unvalidated: call .validate())."""
    from common.sampling_params import SamplingParams

    return SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                          top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed,
                          stop_token_ids=tuple(sampling.stop_token_ids), stop=tuple(sampling.stop),
                          ignore_eos=sampling.ignore_eos, logprobs=sampling.logprobs,
                          prompt_logprobs=sampling.prompt_logprobs)


# Prompt logprobs are the one per-token payload that grows with the prompt (20 alternatives
# a token are ~340 bytes of msgpack): a message carries at most this many bytes of them, so
# that one with the rest of a step's items stays far below MAX_BODY_BYTES.
MAX_PROMPT_LOGPROB_BYTES = MAX_BODY_BYTES // 2


def prompt_logprob_bytes(records: Sequence[dict[str, Any] | None]) -> int:
    """An upper bound on the msgpack size of prompt logprob records: a map of token_id,
    logprob and top (39 bytes with its keys) and 15 bytes per alternative; None is 1."""
    return sum(1 if record is None else 39 + 15 * len(record.get("top") or ()) for record in records)


def split_prompt_logprobs(tokens: Tokens, max_bytes: int = MAX_PROMPT_LOGPROB_BYTES) -> list[Tokens]:
    """`tokens` as messages whose prompt logprobs fit `max_bytes` each: pieces without
    tokens first, in order, and the last piece with the message's tokens and fields."""
    records = tokens.prompt_logprobs
    if prompt_logprob_bytes(records) <= max_bytes:
        return [tokens]
    pieces: list[Tokens] = []
    start, size = 0, 0
    for index, record in enumerate(records):
        record_bytes = prompt_logprob_bytes([record])
        if size + record_bytes > max_bytes and index > start:
            pieces.append(Tokens(request_id=tokens.request_id, token_ids=[], worker_id=tokens.worker_id,
                                 num_prompt_tokens=tokens.num_prompt_tokens,
                                 num_cached_tokens=tokens.num_cached_tokens, prompt_logprobs=records[start:index],
                                 prompt_logprobs_start=tokens.prompt_logprobs_start + start))
            start, size = index, 0
        size += record_bytes
    pieces.append(msgspec.structs.replace(tokens, prompt_logprobs=records[start:],
                                          prompt_logprobs_start=tokens.prompt_logprobs_start + start))
    return pieces


def pack_by_prompt_logprobs(items: list[Any], max_bytes: int = MAX_PROMPT_LOGPROB_BYTES) -> list[list[Any]]:
    """`items` (Tokens or Chunks, in order) in consecutive groups, each of which carries
    at most `max_bytes` of prompt logprobs (an item over it alone: split it first), so
    that each group fits one TokensBatch or ChunkBatch."""
    groups: list[list[Any]] = [[]]
    size = 0
    for item in items:
        item_bytes = prompt_logprob_bytes(item.prompt_logprobs) if item.prompt_logprobs else 0
        if size + item_bytes > max_bytes and groups[-1]:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item_bytes
    return groups
