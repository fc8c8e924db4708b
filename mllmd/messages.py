"""Every message that crosses a process boundary, each defined once (msgspec structs over ZMQ).

A request's hops and the message each one carries:

    main -> tokenizer        TokenizeRequest (prompt, validated SamplingParams, the output-token budget);
                             TokenizeOnly (/tokenize, /detokenize), answered by TokenizeResult
    main -> scheduler        GenerateRequest (token-id prompts skip the tokenizer), AbortRequest, FlushCache
    tokenizer -> scheduler   GenerateRequest (one per choice; a vision-language prompt's images ride as
                             ImageInputs whose pixels wait in a TensorHandle)
    scheduler -> tokenizer   TransportAck (the handles the scheduler has copied)
    scheduler -> detok       RegisterRequest, TokenOutputs (TokenOutput per request per step), ResetRequests
    detok -> main            TextOutputs (TextOutput per request per step)
    any worker -> main       Heartbeat, WorkerReady, WorkerFatal, RequestFailed; scheduler: EngineStats,
                             ControlResult

OpenAI request objects never leave the main process; workers report a failed request as
`RequestFailed` with an `ErrorCode`, which the main process maps to its HTTP status.

msgspec rather than pickled dataclasses or dicts: the decode path sends one TokenOutputs and one
TextOutputs a step, and msgpack-encoded array-like structs encode and decode several times faster
than pickled dicts (and an order of magnitude faster than pickled frozen dataclasses), with the
types checked on decode. This module is a torch-free leaf: the main process imports it.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from mllmd.sampling_params import SamplingParams


class _Message(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """A message: encoded as an array whose first item is the class name (its tag). Subclasses inherit the
    options; they repeat frozen=True for type checkers (a dataclass_transform base's frozen is not inherited)."""


# ---- prompts and what the tokenizer learns about them -------------------------------------------
class ChatPrompt(msgspec.Struct, frozen=True, tag=True):
    """Chat messages and tools for the model's chat template (tool_choice "none" keeps the tools)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] = {}


class TextPrompt(msgspec.Struct, frozen=True, tag=True):
    text: str


class TokenPrompt(msgspec.Struct, frozen=True, tag=True):
    ids: list[int]


Prompt = ChatPrompt | TextPrompt | TokenPrompt


class PromptMeta(msgspec.Struct, frozen=True):
    """Facts about the built prompt that the output side needs."""

    starts_in_reasoning: bool = False  # the chat template ended the prompt inside <think>


class OutputBudget(msgspec.Struct, frozen=True):
    """How many tokens a choice may generate: the client's `requested`, else `default` (None: the rest
    of the context), never more than the context, nor the KV cache (`kv_tokens`, when it is the smaller:
    a small GPU), leaves after the prompt (see sampling_params.fit_max_tokens)."""

    requested: int | None = None
    default: int | None = None
    param: str = "max_tokens"  # the request field named when the budget is at fault
    kv_tokens: int | None = None  # the tokens the serving model's KV cache holds (None: not known)


# ---- tensors between the tokenizer and the scheduler (mllmd.multimodal.transport) -----------------
class _Handle(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Where a tensor waits for its receiver; tagged, so `TensorHandle` decodes to the right one. `id` is
    the sender's: the receiver returns it in a TransportAck once it no longer needs the sender's copy."""


class ShmTensor(_Handle, frozen=True):
    """`default` mode: the bytes in a POSIX shared-memory segment, which the receiver unlinks after its copy.
    `name` is empty for a tensor with no elements (no segment)."""

    id: int
    name: str  # without the leading "/"
    shape: tuple[int, ...]
    dtype: str  # "uint8", "float32", "bfloat16", ... (mllmd.multimodal.transport.DTYPES)
    nbytes: int


class CudaIpcStorage(msgspec.Struct, frozen=True, array_like=True):
    """What torch.UntypedStorage._new_shared_cuda needs to map another process's CUDA storage: the
    tuple of the sender's storage._share_cuda_(), whose event was recorded after the sender's copy."""

    device: int
    handle: bytes  # the allocation's IPC handle
    size_bytes: int  # the storage's size
    offset_bytes: int  # the storage's offset in the allocation
    ref_counter_handle: bytes  # torch's per-storage reference counter (shared memory), decremented on release
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool  # False: the sender synchronised its stream instead of recording the event


class CudaIpcTensor(_Handle, frozen=True):
    """`cuda_ipc` mode: a device tensor of the sender's, kept alive there until acknowledged."""

    id: int
    storage: CudaIpcStorage
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


class PoolTensor(_Handle, frozen=True):
    """`cuda_ipc_pool` mode: bytes [offset, offset + nbytes) of the sender's workspace `pool_id`. The
    receiver maps `pool` once per pool_id and waits on `event_handle` (recorded after the sender's copy
    into the chunk); the chunk is reused only after the ack of `id`. `generation` names this use of the
    chunk (a stale ack for an earlier use of the same offset frees nothing)."""

    id: int
    pool_id: int
    pool: CudaIpcStorage
    offset: int
    nbytes: int
    generation: int
    shape: tuple[int, ...]
    dtype: str
    event_handle: bytes


TensorHandle = ShmTensor | CudaIpcTensor | PoolTensor


# ---- main -> tokenizer -> scheduler ---------------------------------------------------------------
class TokenizeRequest(_Message, frozen=True):
    """One prompt with one sampling run per rid (n choices); `group` names them together."""

    group: str
    rids: list[str]
    prompt: Prompt
    params: SamplingParams  # validated; max_tokens is set from `budget` once the prompt length is known
    budget: OutputBudget
    prompt_param: str = "messages"  # the request field named when the prompt is at fault
    t_submit: float | None = None  # main's time.perf_counter() at submission (FirstTokenTimes, MLLMD_STEP_TRACE)


class TokenizeOnly(_Message, frozen=True):
    """main -> tokenizer (/tokenize, /detokenize, completions' echo): tokenize `prompt` (a chat with or
    without the generation prompt, or text), or, with `prompt` None, decode each list of `decode`.
    Answered by a TokenizeResult."""

    id: str
    prompt: ChatPrompt | TextPrompt | None = None
    add_generation_prompt: bool = True
    decode: list[list[int]] = []


class TokenizeResult(_Message, frozen=True):
    """tokenizer -> main: the ids of a TokenizeOnly's prompt or the texts of its `decode` lists (in
    order), or why it failed: the client's fault, or, with `unavailable`, the worker's (too many such
    requests at once: a 503)."""

    id: str
    ids: list[int] = []
    texts: list[str] = []
    error: str | None = None
    unavailable: bool = False


class ImageInput(msgspec.Struct, frozen=True, array_like=True):
    """One image of a tokenized prompt: its pad tokens are input_ids[start : start + num_tokens]; its
    resized uint8 pixels [H, W, 3] wait behind `pixels` (mllmd.multimodal.transport)."""

    start: int
    num_tokens: int
    grid_thw: tuple[int, int, int]
    content_hash: bytes
    pixels: TensorHandle


class GenerateRequest(_Message, frozen=True):
    """A tokenized choice for the engine (`images`: a vision-language prompt's, in prompt order)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    meta: PromptMeta = PromptMeta()
    t_submit: float | None = None
    images: list[ImageInput] = []
    t_tokenized: float | None = None  # when the tokenizer worker sent it (None: main sent token ids itself)


class FirstTokenTimes(msgspec.Struct, frozen=True, array_like=True):
    """A request's way to its first token, as time.perf_counter() readings of each process. On Linux
    that clock is CLOCK_MONOTONIC, one clock for every process of the host, so differences across
    processes are the time between the hops (main's metrics turn them into
    mllmd_first_token_hop_seconds). Set on the first TokenOutput by the scheduler worker and carried
    on the first TextOutput, with the detokenizer's time, to main."""

    submitted: float  # main sent the request on (to the tokenizer, or a token prompt to the scheduler)
    tokenized: float | None  # the tokenizer worker sent it to the scheduler (None: no tokenizer hop)
    arrived: float  # the scheduler worker took it in
    admitted: float  # the engine step that first scheduled it began
    first_token: float  # the step that gave its first token had returned
    detokenized: float | None = None  # the detokenizer sent its first text


class AbortRequest(_Message, frozen=True):
    """main -> scheduler: stop choice `rid`; main -> tokenizer: drop the parked work of group `rid`."""

    rid: str


class FlushCache(_Message, frozen=True):
    id: str


# ---- scheduler -> detokenizer ------------------------------------------------------------------------
class RegisterRequest(_Message, frozen=True):
    """What the detokenizer keeps for an admitted request."""

    rid: str
    prompt_ids: list[int]
    stop: list[str]
    skip_special_tokens: bool
    meta: PromptMeta = PromptMeta()


class TokenOutput(msgspec.Struct, frozen=True, array_like=True):
    """What changed for one request in one engine step (new tokens are a delta). The engine's
    per-step output, in process (offline LLM) and across the scheduler -> detokenizer hop."""

    rid: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    matched_stop: int | str | None = None
    # SamplingParams.prompt_logprobs, on the first output: prompt token i + 1's logprob and top
    # alternatives, for each i
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    first_times: FirstTokenTimes | None = None  # on a request's first output, in the daemon


class TokenOutputs(_Message, frozen=True):
    outputs: list[TokenOutput]


class ResetRequests(_Message, frozen=True):
    """A new scheduler process started: whatever the previous one ran is gone."""


# ---- detokenizer -> main -----------------------------------------------------------------------------
class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    token: str
    bytes: list[int]
    logprob: float


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    token: str
    bytes: list[int]
    logprob: float | None  # None: a prompt's first token (nothing before it)
    top: list[TopLogprob]


class TextOutput(msgspec.Struct, frozen=True, array_like=True):
    """A TokenOutput after detokenization and stop strings: what main streams to the client."""

    rid: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    matched_stop: int | str | None
    matched_stop_str: str | None  # set when a stop string ended it (the engine must be told to stop)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    meta: PromptMeta = PromptMeta()
    prompt_logprobs: list[TokenLogprob] | None = None  # every prompt token's, on the first output
    first_times: FirstTokenTimes | None = None  # the first output's way through the workers


class TextOutputs(_Message, frozen=True):
    items: list[TextOutput]


# ---- workers -> main ---------------------------------------------------------------------------------
ErrorCode = Literal["invalid_request", "unavailable", "internal"]


class RequestFailed(_Message, frozen=True):
    """A request (or every choice of a group: `rid` may be a group name) ended with an error."""

    rid: str
    code: ErrorCode
    message: str
    param: str | None = None


class Heartbeat(_Message, frozen=True):
    worker: str
    pid: int
    time: float
    requests: int | None = None  # requests the worker holds state for (None: it keeps none)


class WorkerReady(_Message, frozen=True):
    """A worker finished starting; the scheduler and tokenizer say what they loaded."""

    worker: str
    pid: int
    context_length: int | None = None
    vocab_size: int | None = None
    max_total_tokens: int | None = None
    max_running_requests: int | None = None  # as the scheduler runs it (hybrids: at most the state slots)
    dtype: str | None = None
    device: str | None = None
    architecture: str | None = None
    transport: str | None = None  # the tokenizer's tensor transport mode in use (vision-language models)
    transport_fallback: str | None = None  # why it is not the configured one


class WorkerFatal(_Message, frozen=True):
    worker: str
    pid: int
    message: str


class KVUsage(msgspec.Struct, frozen=True, array_like=True):
    total: int
    free: int
    cached: int
    evictable: int


class StateUsage(msgspec.Struct, frozen=True, array_like=True):
    """A hybrid model's recurrent-state pool (Qwen3.5): slots held by requests, by prefix-cache
    snapshots, and free; `bytes_per_slot` is one request's conv + recurrent state over all layers."""

    total: int
    free: int
    snapshots: int
    bytes_per_slot: int


class RequestTiming(msgspec.Struct, frozen=True, array_like=True):
    """Phases of one finished request as the scheduler worker saw them, in seconds: waiting for
    admission (arrival in the worker to the step that first scheduled it), prefill (that step to its
    first output token) and decode (first token to finish)."""

    queue: float
    prefill: float
    decode: float


class EngineStats(_Message, frozen=True):
    running: int
    waiting: int
    kv: KVUsage
    prefill_tokens_computed: int
    decode_tokens_computed: int
    cached_prompt_tokens: int
    preemptions: int
    states: StateUsage | None = None  # None: the model keeps no recurrent state
    timings: list[RequestTiming] = []  # requests finished since the previous stats


class ControlResult(_Message, frozen=True):
    op: str
    id: str
    freed_tokens: int = 0


class TransportAck(_Message, frozen=True):
    """scheduler -> tokenizer: the handles whose copies completed in the receiver (ids of TensorHandles)."""

    ids: list[int]


# ---- what each socket receives ---------------------------------------------------------------------
MainInbox = (Heartbeat | WorkerReady | WorkerFatal | RequestFailed | EngineStats | ControlResult | TextOutputs
             | TokenizeResult)
TokenizerInbox = TokenizeRequest | TransportAck | TokenizeOnly | AbortRequest
SchedulerInbox = GenerateRequest | AbortRequest | FlushCache
DetokenizerInbox = RegisterRequest | TokenOutputs | ResetRequests

_encoder = msgspec.msgpack.Encoder()


def encode(msg: _Message) -> bytes:
    return _encoder.encode(msg)


def decoder(inbox: Any) -> msgspec.msgpack.Decoder[Any]:
    """A decoder for one socket's union of messages (type errors raise msgspec.ValidationError)."""
    return msgspec.msgpack.Decoder(inbox)


def request_id_of(data: bytes) -> str | None:
    """The id (a request's rid or a TokenizeRequest's group: the first field) of a message that its
    socket's decoder refused, so that the request can be failed instead of left waiting; None if even
    that cannot be read."""
    try:
        raw = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, ValueError, RecursionError):
        return None
    if isinstance(raw, list) and len(raw) > 1 and isinstance(raw[1], str):
        return raw[1]
    return None
