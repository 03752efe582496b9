"""The offline engine: requests in, tokens out, one `step()` at a time.

Engine wires the parts (checkpoint, model, KV pool, block manager, scheduler, runner)
and turns each step's samples into per-request outputs. The serving roles drive the same
object from their loops.
"""
from __future__ import annotations

import ctypes
import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field

import numpy as np
import torch

from common.detokenizer import IncrementalDetokenizer
from common.engine.block_manager import BlockManager, EvictedBlock, KVEventSink
from common.engine.checkpoint import fingerprints, load_model_config, load_state_dict, load_tokenizer
from common.engine.config import DEVICE_PATTERN, DTYPE_SETTINGS, EngineConfig, dtype_choice, resolve_dtype
from common.engine.gguf import checkpoint_dir, read_weight_blocks
from common.engine.kv_cache import KVCache, KVLayout
from common.engine.kv_connector import KvLoad, KvLoadError, KvSink, StoreHint
from common.engine.leases import KvLease, KvLeases
from common.engine.model import CausalLM
from common.engine.queue_policy import make_queue_policy
from common.engine.runner import ModelRunner, PromptLogprobs, StepResult
from common.engine.scheduler import SchedulePlan, Scheduler, SchedulerConfig, max_hit_tokens
from common.engine.sequence import Sequence
from common.hashing import root_hash
from common.logs import get_logger
from common.sampling_params import InvalidRequestError, SamplingParams, validate_prompt
from kernels.attention import select_backend
from kernels.linear import QuantizedBlocks, onednn_bf16_native

log = get_logger("engine")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
KEEP_FREED_BYTES = 1 << 30


class EngineConfigError(ValueError):
    """The engine cannot start with this configuration; the message names the setting."""


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (one per running request per step, so a
    plain slotted record: a frozen dataclass costs several times more to build)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    text: str | None = None  # the whole output text, set when finished
    logprobs: list[dict] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queue_s: float | None = None  # arrival to first scheduled, on a request's first output
    kv_lease: KvLease | None = None  # a held request's prompt KV, on its finishing output
    # Prompt logprobs this step computed (SamplingParams.prompt_logprobs): the records of
    # prompt tokens prompt_logprobs_start, ... (None for token 0). A prefill chunk that
    # samples nothing still gives an output, with no token, when it computed some.
    prompt_logprobs: list[dict | None] = field(default_factory=list)
    prompt_logprobs_start: int = 0


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int
    ttft_s: float
    e2e_s: float
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict | None] = field(default_factory=list)  # one per prompt token, None first


@dataclass
class EngineStats:
    num_steps: int = 0
    num_computed_tokens: int = 0  # tokens that went through the model (prefill + decode)
    num_prefix_hit_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_fetched_tokens: int = 0  # prompt tokens whose KV came from the KV store
    prefill_tokens: int = 0  # tokens computed by steps that prefilled at least a block ...
    prefill_seconds: float = 0.0  # ... and those steps' seconds (a measured prefill rate)
    # A measured decode rate: the tokens of steps that prefilled nothing and after which
    # work remained, and the seconds from each such step's start to the next step's start,
    # so what the caller's loop does between two steps counts too.
    decode_tokens: int = 0
    decode_seconds: float = 0.0


class Engine:
    def __init__(self, config: EngineConfig, kv_events: KVEventSink | None = None):
        """`config.dtype` "auto" is resolved here, once: `self.config` holds the dtype the
        engine computes in, which is what every consumer (block hashes, Hello, profiles,
        logs) must see. A GGUF file as `config.model_dir` is converted (once, cached) into
        the checkpoint directory the engine then reads (common/engine/gguf.py)."""
        config = dataclasses.replace(config, model_dir=checkpoint_dir(config.model_dir))
        _check_config(config)
        cpu_bf16_native = onednn_bf16_native()
        dtype_reason = dtype_choice(config.dtype, config.device, cpu_bf16_native)
        config = dataclasses.replace(config, dtype=resolve_dtype(config.dtype, config.device, cpu_bf16_native))
        self.config = config
        self.model_config = load_model_config(config.model_dir)
        self.tokenizer = load_tokenizer(config.model_dir)
        self.model_fingerprint, self.tokenizer_fingerprint = fingerprints(config.model_dir)
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            _keep_freed_host_memory()
        self.max_model_len = _max_model_len(config, self.model_config.context_limit)
        layout = KVLayout.for_model(self.model_config, config.block_size, config.dtype)
        num_blocks = _num_kv_blocks(config, layout, self.max_model_len)

        dtype = getattr(torch, config.dtype)
        self.model = CausalLM(self.model_config, dtype, self.device, self.max_model_len)
        self.model.load_hf_weights(load_state_dict(config.model_dir, self.model_config),
                                   _weight_blocks(config, self.model))
        self.kv_cache = KVCache(layout, num_blocks, self.device)
        backend = select_backend(config.attention_backend, self.device, self.model_config.head_dim, dtype)
        self.block_manager = BlockManager(num_blocks, config.block_size, kv_events)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs,
                            config.enable_prefix_caching, config.wait_for_shared_prefill),
            self.block_manager, make_queue_policy(config.queue_policy))
        self.runner = ModelRunner(self.model, self.kv_cache, backend, self.device)
        self.stats = EngineStats()
        # Called after each step that ran the model with its plan and its seconds (see
        # common.engine.step_log); None: no one is watching.
        self.step_observer: Callable[[SchedulePlan, float], None] | None = None
        self._seqs: dict[str, Sequence] = {}
        self._decode_step: tuple[int, float] | None = None  # (tokens, start) of a decode step still being timed
        self.leases = KvLeases()
        self._arrivals = itertools.count()
        self._root_hashes: dict[str, int] = {}
        self._eos = frozenset(self.model_config.eos_token_ids)
        self.sinks: list[KvSink] = [self.leases]  # where KV leaves for (common/engine/kv_connector.py)
        log.info("engine_ready", model=str(config.model_dir), dtype=config.dtype, dtype_choice=dtype_reason,
                 device=str(self.device), attention_backend=backend.name, native_attention=backend.native,
                 amx_chunk_attention=backend.amx_chunks,
                 layer_ops=self.model.ops.name, few_row_linears=self.model.linear_kernels(),
                 fused_decode_layers=self.model.fused_decode and backend.native, kv_blocks=num_blocks,
                 block_size=config.block_size, max_model_len=self.max_model_len)

    # ---- requests ------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Seq[int],
                    params: SamplingParams | None = None, tenant_salt: str | None = None,
                    hold_kv: bool = False, *, plan: Callable[[KvLoad], int] | None = None,
                    store_hint: StoreHint | None = None) -> KvLoad | None:
        """Queue a request; raises InvalidRequestError naming a bad parameter. With
        `hold_kv` (the prefill role) its finishing output carries a KvLease on the
        prompt's blocks, which stay held until `release_lease` or the lease expires.
        With `plan` (the connector's scheduler half) its blocks past the local cache may
        come from elsewhere, as `begin_load` without a first token takes them: when the
        plan allocates any, the request waits for them and their load is returned;
        otherwise (None) it is queued to prefill, as without a plan."""
        seq = self._new_sequence(request_id, prompt, params, tenant_salt)
        seq.hold_kv = hold_kv
        if plan is not None:
            load = self._begin_load(seq, None, None, plan, store_hint)
            if load is not None:
                return load
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return None

    # ---- KV from elsewhere: one load path (docs/architecture.md §7.1) -----------------

    def begin_load(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                   tenant_salt: str | None = None, *, first_token_id: int | None = None,
                   block_hashes: Seq[int] | None = None, plan: Callable[[KvLoad], int] | None = None,
                   store_hint: StoreHint | None = None, hold_kv: bool = False,
                   through_prompt_end: bool = False) -> KvLoad | None:
        """Take a request whose prompt KV past this engine's prefix cache comes, in part or
        whole, from elsewhere: fresh blocks are allocated for it and the request waits,
        outside the batch, until `complete_load` (or `cancel_load`). None, taking
        nothing, when the blocks or the batch are full, or when nothing is to be loaded.

        With `first_token_id` the prompt was computed elsewhere (a prefill worker's
        lease): the load runs through the prompt's end, and the request then decodes
        from that token. `through_prompt_end` without it: the same, the first token given
        to `complete_load` (the prompt's parts come while it is still being prefilled).
        `block_hashes`, the other engine's names of the full blocks, must equal this
        engine's (KvLoadError otherwise: another model, tokenizer, dtype, block size or
        tenant). Prompt logprobs are the other engine's to give: such a
        request never computes them, not even when a preemption recomputes its prompt.

        Without it, only full blocks are loaded, never the one holding the prompt's last
        token (computed to sample), and none for a request that scores its prompt. `plan`
        (the connector's scheduler half, services/worker/kv_loads.py) is shown them first,
        as a load with no blocks allocated yet, and answers how many of the leading ones
        to allocate (all when there is no `plan`). `store_hint` goes into the load as it
        is. Raises InvalidRequestError. `hold_kv` as for `add_request`."""
        through_prompt_end = through_prompt_end or first_token_id is not None
        if through_prompt_end and params is not None and params.prompt_logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=None)
        seq = self._new_sequence(request_id, prompt, params, tenant_salt)
        seq.hold_kv = hold_kv
        return self._begin_load(seq, first_token_id, block_hashes, plan, store_hint, through_prompt_end)

    def _begin_load(self, seq: Sequence, first_token_id: int | None, block_hashes: Seq[int] | None,
                    plan: Callable[[KvLoad], int] | None, store_hint: StoreHint | None,
                    through: bool = False) -> KvLoad | None:
        """`begin_load` for a sequence made already; it is registered only when taken."""
        request_id = seq.request_id
        size = self.config.block_size
        if first_token_id is not None:
            self._check_token(first_token_id)
        if through:
            full_blocks = seq.prompt_len // size
            if block_hashes is not None and list(block_hashes) != seq.block_hashes[:full_blocks]:
                raise KvLoadError("the prefill engine names this prompt's blocks otherwise: its model, tokenizer, "
                                  "dtype, block size or the request's tenant differ from this engine's")
            limit = full_blocks
        else:
            limit = max_hit_tokens(seq) // size
        hits = self.block_manager.match_prefix(seq.block_hashes, seq.token_ids,
                                               limit if self.config.enable_prefix_caching else 0)
        if through:
            count = -(-seq.prompt_len // size) - len(hits)
        else:
            count = limit - len(hits)
            if count > 0 and plan is not None:
                count = min(count, plan(KvLoad(request_id, seq.root_hash, len(hits), (),
                                               tuple(seq.block_hashes[len(hits):limit]), False, store_hint)))
            if count <= 0:
                return None
        fresh = self.scheduler.receive(seq, hits, count)
        if fresh is None:
            return None
        seq.loading = True
        seq.pending_token_id = first_token_id
        seq.load_through_end = through
        seq.num_cached_tokens = len(hits) * size
        self._seqs[request_id] = seq
        return KvLoad(request_id, seq.root_hash, len(hits), tuple(fresh),
                      tuple(seq.block_hashes[len(hits):len(hits) + count]), through, store_hint)

    def _check_token(self, token_id: int) -> None:
        if not 0 <= token_id < self.model_config.vocab_size:
            raise InvalidRequestError("first_token_id", f"{token_id} is outside the vocabulary")

    def block_names(self, request_id: str) -> tuple[int, ...]:
        """The names of a taken request's full prompt blocks, as this engine makes them
        (KeyError for an unknown request)."""
        seq = self._seqs[request_id]
        return tuple(seq.block_hashes[:seq.prompt_len // self.config.block_size])

    def complete_load(self, request_id: str, landed_blocks: int,
                      first_token_id: int | None = None) -> list[RequestOutput]:
        """The first `landed_blocks` of a `begin_load`'s blocks hold their KV: they join
        the prefix cache. A load through the prompt's end must land whole (else
        `cancel_load`); the request then decodes, and its first output, returned here,
        holds the other engine's first token (the client may have it already; the output
        says whether it alone finished the request); `first_token_id` is that token when
        `begin_load` did not have it. Any other load's unlanded blocks are
        freed and the request prefills the rest of its prompt. A request aborted while
        loading ends now ([]). Until this is called the blocks stay the load's, even
        across an abort, so a late copy never lands in a block another request holds."""
        seq = self._loading(request_id)
        size = self.config.block_size
        num_local = seq.num_cached_tokens // size
        planned = len(seq.block_ids) - num_local
        if not 0 <= landed_blocks <= planned:
            raise ValueError(f"landed_blocks={landed_blocks}: the load had {planned} blocks")
        if seq.load_through_end and not seq.abort_on_loaded:
            if landed_blocks < planned:
                raise ValueError(f"{request_id!r}: a load through the prompt's end lands whole ({landed_blocks} of "
                                 f"{planned} blocks); cancel_load it instead")
            if first_token_id is not None:
                self._check_token(first_token_id)
                seq.pending_token_id = first_token_id
            if seq.pending_token_id is None:
                raise ValueError(f"{request_id!r}: a load through the prompt's end needs its first token")
        seq.loading = False
        if seq.abort_on_loaded:
            self.abort(request_id)
            return []
        if seq.load_through_end:
            self.scheduler.received(seq)
            now = time.perf_counter()
            seq.first_scheduled_time = now
            first, seq.pending_token_id = seq.pending_token_id, None
            assert first is not None  # checked above
            seq.load_through_end = False
            return [self._advance(seq, first, None, now)]
        self.scheduler.fetched(seq, num_local + landed_blocks)
        seq.num_cached_tokens = (num_local + landed_blocks) * size
        self.stats.num_prefix_hit_tokens += num_local * size
        self.stats.num_fetched_tokens += landed_blocks * size
        return []

    def cancel_load(self, request_id: str) -> None:
        """End a loading request now and free its blocks: the caller guarantees that no
        byte of its load lands any more (the transfer was cancelled or has settled)."""
        seq = self._loading(request_id)
        seq.loading = False
        self.abort(request_id)

    def _loading(self, request_id: str) -> Sequence:
        seq = self._seqs.get(request_id)
        if seq is None or not seq.loading:
            raise KeyError(f"{request_id!r} is not loading KV")
        return seq

    # ---- KV to elsewhere: sinks (docs/architecture.md §7.2) ------------------------------

    def add_sink(self, sink: KvSink) -> None:
        """Tell `sink` of every eviction from the prefix cache and of every held request's
        end, after the sinks added before it (the engine's own leases come first)."""
        self.sinks.append(sink)
        self.block_manager.on_evict = self._evicted  # an engine without a sink names no chains

    def _evicted(self, blocks: list[EvictedBlock]) -> None:
        for sink in self.sinks:
            sink.evicted(blocks)

    def pool_planes(self) -> torch.Tensor:
        """The KV pool as (planes, num_blocks, plane elements): block b's value is [:, b, :]."""
        layout = self.kv_cache.layout
        return self.kv_cache.data.view(2 * layout.num_layers, self.kv_cache.num_blocks, -1)

    def read_blocks(self, block_ids: Seq[int]) -> np.ndarray:
        """Copies of blocks' values, (n, bytes_per_block) uint8 on the host: one gather."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        values = self.pool_planes().index_select(1, index).transpose(0, 1).contiguous().cpu()
        return values.view(torch.uint8).reshape(len(block_ids), -1).numpy()

    def write_blocks(self, block_ids: Seq[int], values: np.ndarray) -> None:
        """Write blocks' values ((n, bytes_per_block) uint8, as read_blocks gives)."""
        if not block_ids:
            return
        planes = self.pool_planes()
        source = torch.from_numpy(np.ascontiguousarray(values)).view(planes.dtype)
        source = source.reshape(len(block_ids), planes.shape[0], -1).transpose(0, 1).to(self.device)
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        planes.index_copy_(1, index, source)

    def _new_sequence(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None,
                      tenant_salt: str | None) -> Sequence:
        params = params or SamplingParams()
        if request_id in self._seqs:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        params.validate()
        if isinstance(prompt, str) and not prompt:
            raise InvalidRequestError("prompt", "is empty")
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not set(map(type, prompt_ids)) <= {int}:  # C-speed, and bools are refused
            raise InvalidRequestError("prompt", "token ids must be integers")
        validate_prompt(prompt_ids, self.model_config.vocab_size, self.max_model_len)
        seq = Sequence(
            request_id=request_id, prompt_len=len(prompt_ids), token_ids=prompt_ids,
            params=params, arrival_index=next(self._arrivals),
            root_hash=self._root_hash(self.config.tenant_salt if tenant_salt is None else tenant_salt),
            block_size=self.config.block_size, eos_token_ids=self._eos,
            max_model_len=self.max_model_len, arrival_time=time.perf_counter())
        if params.seed is not None:
            seq.generator = torch.Generator(self.device).manual_seed(params.seed)
        if params.stop:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop)
        return seq

    # ---- leases (prefill role) -------------------------------------------------------

    def lease(self, lease_id: str, request_id: str) -> KvLease:
        """A live lease (LeaseError if forged, stale or released)."""
        return self.leases.get(lease_id, request_id)

    def lease_part(self, request_id: str, first_block: int, min_blocks: int) -> KvLease | None:
        """A part of a held request's prompt while it is still being prefilled
        (docs/disaggregation.md §2.1): its computed full prompt blocks from `first_block` on,
        when there are at least `min_blocks` (and one), under a lease of their own: a
        second reference, the request keeps its own. None otherwise, or for a request
        that is not prefilling here with `hold_kv`."""
        seq = self._seqs.get(request_id)
        if seq is None or not seq.hold_kv or seq.loading:
            return None
        computed = min(seq.num_computed, seq.prompt_len, len(seq.block_ids) * self.config.block_size)
        last = computed // self.config.block_size
        if last - first_block < max(min_blocks, 1):
            return None
        block_ids = seq.block_ids[first_block:last]
        self.block_manager.retain(block_ids)
        return self.leases.part(request_id, first_block, block_ids, seq.block_hashes[first_block:last],
                                seq.prompt_len)

    def release_lease(self, lease_id: str, request_id: str) -> None:
        """The decode side has the KV (or gave up): free the blocks (they stay cached)."""
        self.block_manager.release(self.leases.release(lease_id, request_id))


    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it is not running."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        if seq.loading:  # its blocks may still be written: complete_load or cancel_load ends it
            seq.abort_on_loaded = True
            return True
        del self._seqs[request_id]
        self.scheduler.finish(seq, "abort")
        if not self.has_unfinished():  # the loop may now wait: that is no decode time
            self._decode_step = None
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids: Seq[int]) -> str:
        return self.tokenizer.decode(list(token_ids))

    # ---- stepping ------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling iteration; outputs for requests that got a token."""
        called = time.perf_counter()
        self._end_decode_period(called)
        plan = self.scheduler.schedule()
        self.stats.num_preemptions += len(plan.preempted)
        if plan.is_empty:
            return []
        self.stats.num_prefix_hit_tokens += plan.num_cached_tokens
        started = time.perf_counter()
        for chunk in plan.chunks:
            if chunk.seq.first_scheduled_time is None:
                chunk.seq.first_scheduled_time = started
        result = self.runner.execute(plan)
        self.scheduler.complete(plan)
        prefill_tokens = sum(chunk.num_new for chunk in plan.chunks if chunk.num_new > 1)
        self.stats.num_steps += 1
        self.stats.num_computed_tokens += result.num_computed_tokens
        self.stats.num_generated_tokens += len(result.token_ids)
        now = time.perf_counter()
        outputs = [self._advance(seq, token, logprob, now)
                   for seq, token, logprob in zip(result.seqs, result.token_ids, result.logprobs)]
        if result.prompt_logprobs:
            outputs = self._with_prompt_logprobs(outputs, result)
        if prefill_tokens >= self.config.block_size:
            self.stats.prefill_tokens += result.num_computed_tokens
            self.stats.prefill_seconds += now - started
        if self.step_observer is not None:
            self.step_observer(plan, time.perf_counter() - called)
        if prefill_tokens == 0 and self.has_unfinished():
            self._decode_step = (len(result.token_ids), called)
        return outputs

    def _end_decode_period(self, now: float) -> None:
        """Count the decode step being timed (EngineStats.decode_tokens) up to `now`."""
        if self._decode_step is not None:
            tokens, started = self._decode_step
            self.stats.decode_tokens += tokens
            self.stats.decode_seconds += now - started
            self._decode_step = None

    def _advance(self, seq: Sequence, token_id: int, logprob: dict | None, now: float) -> RequestOutput:
        seq.append_token(token_id)
        queue_s = None
        if seq.first_token_time is None:
            seq.first_token_time = now
            assert seq.first_scheduled_time is not None  # step() set it when it scheduled the chunk
            queue_s = seq.first_scheduled_time - seq.arrival_time
        if logprob is not None:
            seq.logprobs.append(logprob)
        reason = seq.check_stop(token_id)
        if seq.detokenizer is not None:
            stop_text = seq.detokenizer.find_stop(seq.detokenizer.push(token_id))
            if stop_text is not None:
                reason, seq.stop_text = "stop", stop_text
        logprobs = [logprob] if logprob else []
        if reason is None:
            return RequestOutput(seq.request_id, [token_id], False, logprobs=logprobs,
                                 num_prompt_tokens=seq.prompt_len, num_cached_tokens=seq.num_cached_tokens,
                                 queue_s=queue_s)
        lease = self._finish(seq, reason, token_id)
        return RequestOutput(seq.request_id, [token_id], True, reason, self._final_text(seq), logprobs,
                             seq.prompt_len, seq.num_cached_tokens, queue_s, lease)

    @staticmethod
    def _with_prompt_logprobs(outputs: list[RequestOutput], result: StepResult) -> list[RequestOutput]:
        """Record the step's prompt logprobs on their sequences and hand them out: on the
        output of a sequence that sampled, else on an output of their own, with no token
        (a prefill chunk short of the prompt's end)."""
        parts: dict[str, PromptLogprobs] = {}
        for part in result.prompt_logprobs:
            seq = part.seq
            assert part.start == len(seq.prompt_logprobs), "prompt logprobs come in prompt order, each once"
            seq.prompt_logprobs.extend(part.records)
            parts[seq.request_id] = part
        for output in outputs:
            if output.request_id in parts:
                part = parts.pop(output.request_id)
                output.prompt_logprobs, output.prompt_logprobs_start = part.records, part.start
        tokenless = [RequestOutput(part.seq.request_id, [], False, num_prompt_tokens=part.seq.prompt_len,
                                   num_cached_tokens=part.seq.num_cached_tokens, prompt_logprobs=part.records,
                                   prompt_logprobs_start=part.start) for part in parts.values()]
        return tokenless + outputs

    def _finish(self, seq: Sequence, reason: str, last_token_id: int) -> KvLease | None:
        """End a sequence; a held one's prompt blocks go under a lease, the rest are freed."""
        self._seqs.pop(seq.request_id, None)
        if not seq.hold_kv:
            self.scheduler.finish(seq, reason)
            return None
        blocks = self.scheduler.finish(seq, reason, hold=True)
        prompt_blocks = -(-seq.prompt_len // self.config.block_size)
        self.block_manager.release(blocks[prompt_blocks:])  # the prompt's KV is what moves
        for sink in self.sinks:
            lease = sink.held(seq.request_id, blocks[:prompt_blocks],
                              seq.block_hashes[:seq.prompt_len // self.config.block_size], seq.prompt_len,
                              last_token_id)
            if lease is not None:
                return lease
        self.block_manager.release(blocks[:prompt_blocks])  # no sink holds it
        return None

    def _final_text(self, seq: Sequence) -> str:
        if seq.stop_text is not None and seq.detokenizer is not None:  # the detokenizer found it
            return seq.detokenizer.text
        return self.decode(seq.output_ids)

    # ---- convenience ---------------------------------------------------------------

    def generate(self, prompts: Seq[str | Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[GenerationResult]:
        """Run prompts to completion, batched; results in prompt order."""
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError("params", f"{len(params)} params for {len(prompts)} prompts")
        batch = f"gen-{next(self._arrivals)}-"
        ids = [f"{batch}{index}" for index in range(len(prompts))]
        seqs = []
        for request_id, prompt, request_params in zip(ids, prompts, params):
            self.add_request(request_id, prompt, request_params)
            seqs.append(self._seqs[request_id])
        pending = set(ids)
        while pending:
            for output in self.step():
                if output.finished:
                    pending.discard(output.request_id)
        done = time.perf_counter()
        return [self._result(seq, done) for seq in seqs]

    def warm_up(self) -> float:
        """Build every kernel a step may need and run throwaway requests through each kind
        of step a request takes (a prefill that misses the prefix cache, two that hit it,
        a batched decode), then forget them: no KV event leaves the engine, the prefix
        cache and the stats are as before, every block is free. Returns the seconds it
        took. Call it on an idle engine, before it serves: otherwise a fresh engine's
        first requests pay one-time costs (lazy set-up, and on CPU oneDNN's kernel for
        each padded prefill size, kernels/linear.py; ~60 ms each against ~5 ms warm for
        the tiny model in a worker on the 2-core development machine), and they land on
        the requests a router sends to a worker it had not used, late, at load."""
        if self.has_unfinished():
            raise RuntimeError("warm_up needs an idle engine")
        started = time.perf_counter()
        events, observer, stats = self.block_manager.events, self.step_observer, self.stats
        self.block_manager.events, self.step_observer, self.stats = None, None, EngineStats()
        try:
            self.model.warm_up_linears(min(self.config.max_num_batched_tokens, self.max_model_len))
            params = SamplingParams(max_tokens=WARM_UP_OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
            for batch in warm_up_requests(self.model_config.vocab_size, self.config.block_size,
                                          self.max_model_len):
                self.generate(batch, params)
            self.block_manager.reset_prefix_cache()
        finally:
            self.block_manager.events, self.step_observer, self.stats = events, observer, stats
        return time.perf_counter() - started

    def _result(self, seq: Sequence, done: float) -> GenerationResult:
        # A finished sequence has its reason and its first token's time.
        assert seq.finish_reason is not None and seq.first_token_time is not None
        return GenerationResult(
            request_id=seq.request_id, prompt_token_ids=seq.token_ids[:seq.prompt_len],
            token_ids=seq.output_ids, text=self._final_text(seq), finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens, ttft_s=seq.first_token_time - seq.arrival_time,
            e2e_s=done - seq.arrival_time, logprobs=seq.logprobs, prompt_logprobs=seq.prompt_logprobs)

    def check_integrity(self) -> None:
        """Verify block bookkeeping against every live sequence (tests call this)."""
        self.block_manager.check_integrity([*self.scheduler.live_block_tables(), *self.leases.block_tables()])

    def _root_hash(self, tenant_salt: str) -> int:
        if tenant_salt not in self._root_hashes:
            self._root_hashes[tenant_salt] = root_hash(
                self.model_fingerprint, self.tokenizer_fingerprint, self.config.adapter_id,
                self.config.dtype, self.config.block_size, tenant_salt)
        return self._root_hashes[tenant_salt]


WARM_UP_OUTPUT_TOKENS = 4


def warm_up_requests(vocab_size: int, block_size: int, max_model_len: int) -> list[list[list[int]]]:
    """Engine.warm_up's prompts, batch by batch: one prompt of a few blocks, then two that
    share its first blocks and differ after (prefix hits, prefilled and decoded together)."""
    length = max(2, min(4 * block_size + block_size // 2, max_model_len - WARM_UP_OUTPUT_TOKENS))
    first_token = min(4, vocab_size - 1)  # past the special tokens where the vocabulary has them
    span = max(1, vocab_size - first_token)
    base = [first_token + (7 * position) % span for position in range(length)]
    shared = (length // block_size - 1) * block_size if length > 2 * block_size else 0
    hits = [base[:shared] + [first_token + (11 * position + tail) % span for position in range(length - shared)]
            for tail in (1, 2)]
    return [[base], hits]


def _weight_blocks(config: EngineConfig, model: CausalLM) -> dict[str, QuantizedBlocks]:
    """The quantized blocks of a GGUF checkpoint's weights, where the engine multiplies by
    them (kernels.linear.Linear): AMX linears and the weight_blocks setting on."""
    if not (config.weight_blocks and model.amx_linears):
        return {}
    return {name: QuantizedBlocks.from_arrays(blocks) for name, blocks in read_weight_blocks(config.model_dir).items()}


def _keep_freed_host_memory() -> bool:
    """Make glibc keep freed blocks up to KEEP_FREED_BYTES for reuse instead of handing
    them back to the OS. By default it serves large tensors with mmap and unmaps them on
    free, so every step that allocates the same activations again faults their pages in
    anew: on CPU that cost as much as the prefill itself. An engine allocates the same
    sizes step after step, so it keeps them (as a GPU caching allocator does). Returns
    whether the C library took the setting (False off glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, KEEP_FREED_BYTES)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES))


def _check_config(config: EngineConfig) -> None:
    if config.dtype not in DTYPE_SETTINGS:
        raise EngineConfigError(f"dtype: unsupported {config.dtype!r}; choose one of {DTYPE_SETTINGS}")
    for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
        value = getattr(config, name)
        if not isinstance(value, int) or value <= 0:
            raise EngineConfigError(f"{name}: must be a positive integer, got {value!r}")
    if config.num_kv_blocks is None and not config.kv_cache_gb > 0:
        raise EngineConfigError(f"kv_cache_gb: must be > 0, got {config.kv_cache_gb}")
    if not DEVICE_PATTERN.fullmatch(config.device):
        raise EngineConfigError(f"device: {config.device!r} is not cpu, cuda or cuda:N")
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise EngineConfigError(f"device: {config.device!r} requested but CUDA is not available")
    if config.device.startswith("cuda:") and int(config.device[5:]) >= torch.cuda.device_count():
        raise EngineConfigError(f"device: {config.device!r} but torch sees "
                                f"{torch.cuda.device_count()} GPU(s), numbered from 0")


def _max_model_len(config: EngineConfig, model_limit: int) -> int:
    if config.max_model_len is None:
        return model_limit
    if not 0 < config.max_model_len <= model_limit:
        raise EngineConfigError(f"max_model_len: must be in [1, {model_limit}] for this model, "
                                f"got {config.max_model_len}")
    return config.max_model_len


def _num_kv_blocks(config: EngineConfig, layout: KVLayout, max_model_len: int) -> int:
    needed = -(-max_model_len // config.block_size)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
        source = f"num_kv_blocks={num_blocks}"
    else:
        num_blocks = layout.blocks_for_bytes(config.kv_cache_gb * 2**30)
        source = f"kv_cache_gb={config.kv_cache_gb} holds {num_blocks} blocks"
    if num_blocks < needed:
        need_gb = needed * layout.bytes_per_block / 2**30
        raise EngineConfigError(
            f"kv_cache_gb: the KV pool is too small: {source} of {config.block_size} tokens "
            f"({layout.bytes_per_block} bytes each), but one sequence of max_model_len="
            f"{max_model_len} needs {needed} blocks ({need_gb:.4f} GiB); raise --kv-cache-gb "
            f"or lower --max-model-len")
    return num_blocks
