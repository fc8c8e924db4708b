"""Tokenizer worker: chat template and tokenization, then hand the token ids to the scheduler.

The chat template is the model's own, or the administrator's `model.chat_template` file; a request
only sets template variables (chat_template_kwargs, checked by the main process). A tokenizer that
loads empty (a model folder without tokenizer files, for which transformers builds an empty one)
fails the load instead of every request.

A vision-language model's chats with image parts go through `vision_prompts.VisionPrompts`: images
loaded under the `server.*image*` limits and resized, the prompt built around their tokens, the pixels
sent to the scheduler by the tensor transport (whose TransportAcks arrive in this worker's inbox).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from mllmd.messages import (
    AbortRequest,
    ChatPrompt,
    GenerateRequest,
    ImageInput,
    PromptMeta,
    RequestFailed,
    TextPrompt,
    TokenizeOnly,
    TokenizeRequest,
    TokenizeResult,
    TokenizerInbox,
    TokenPrompt,
    TransportAck,
    decoder,
    encode,
    request_id_of,
)
from mllmd.models import load_hf_config
from mllmd.multimodal.chat import VisionPrompt, image_parts
from mllmd.multimodal.image_io import ImageError
from mllmd.multimodal.transport import TransportFull
from mllmd.sampling_params import InvalidSamplingParam, OutputConstraint, choice_params, fit_max_tokens
from mllmd.structured.grammar import GrammarCompiler, GrammarError
from mllmd.workers import ipc, template_limits
from mllmd.workers.base import WorkerContext, worker_main
from mllmd.workers.chat_messages import template_messages
from mllmd.workers.tokenize_jobs import TokenizeJobs
from mllmd.workers.vision_prompts import VisionPrompts, takes_images

logger = logging.getLogger("tokenizer")

THINK_END = "</think>"  # a reasoning block's end (Qwen3, Qwen3.5); _meta looks for its start


def _template_kwargs(prompt: ChatPrompt, chat_template: str | None) -> dict[str, Any]:
    kwargs = dict(prompt.chat_template_kwargs)
    kwargs.pop("chat_template", None)  # never the client's (main refuses it; this is the last line)
    if prompt.tools:
        kwargs["tools"] = prompt.tools
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    return kwargs


class WorkerBusy(RuntimeError):
    """Every slot for work off the loop (long prompts to encode, images to load) is taken: a 503
    (retry), not a client error."""


def _meta(text: str) -> PromptMeta:
    return PromptMeta(starts_in_reasoning=text.rstrip().endswith("<think>"))


# A text longer than this many characters per token of the context, and than PREFIX_MIN_CHARS, is
# measured on a prefix first (below that, encoding it whole costs under half a second here and the
# refusal can name the prompt's exact length).
PREFIX_CHARS_PER_TOKEN = 8
PREFIX_MIN_CHARS = 1 << 18
# Tokens the end of a prefix may split differently from the whole text (a pre-token cut in two).
PREFIX_BOUNDARY_TOKENS = 16
# Texts longer than this are encoded off the worker's loop (TokenizeJobs' thread): about 50 ms here.
LONG_TEXT_CHARS = 1 << 16


@functools.lru_cache(maxsize=8)
def _max_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for: its longest vocabulary entry (a byte-level entry has
    a symbol per byte, and a character is at least one byte). Qwen's: 128 (a run of spaces or dashes)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def encode_within(tokenizer: Any, text: str, context_length: int | None, param: str) -> list[int]:
    """tokenizer.encode(text), except that a text with more tokens than the context holds is refused
    (InvalidSamplingParam naming `param`), as fit_max_tokens would refuse the whole, without encoding it
    all where that can be known sooner: a text longer than the context times the longest token cannot
    fit and is refused unread, and one whose prefix alone has more tokens is refused from that prefix
    (both only past PREFIX_MIN_CHARS: a shorter text is encoded whole, and its refusal names its exact
    length). Encoding the 8 MB a request body may hold takes about 10 s (see LONG_TEXT_CHARS)."""
    if (context_length is not None and len(text) > PREFIX_MIN_CHARS
            and len(text) > context_length * _max_token_chars(tokenizer)):  # fmt: skip
        raise InvalidSamplingParam(
            f"the prompt has {len(text)} characters, more tokens than fit: the model's context length is "
            f"{context_length} and a token stands for at most {_max_token_chars(tokenizer)} characters",
            param,
        )
    if context_length is not None and len(text) > max(context_length * PREFIX_CHARS_PER_TOKEN, PREFIX_MIN_CHARS):
        head = tokenizer.encode(text[: max(context_length * PREFIX_CHARS_PER_TOKEN, PREFIX_MIN_CHARS)],
                                add_special_tokens=False)  # fmt: skip
        if len(head) - PREFIX_BOUNDARY_TOKENS >= context_length:
            raise InvalidSamplingParam(
                f"the prompt has more than {len(head) - PREFIX_BOUNDARY_TOKENS} tokens but the model's context "
                f"length is {context_length} (at least one token must be left for the completion)",
                param,
            )
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_text(tokenizer: Any, req: TokenizeRequest, chat_template: str | None = None) -> tuple[str, PromptMeta] | None:
    """The text a chat or completion prompt encodes, and facts the detokenizer needs; None for token ids."""
    prompt = req.prompt
    if isinstance(prompt, ChatPrompt):
        prompt = template_messages(tokenizer, prompt, chat_template)
        kwargs = _template_kwargs(prompt, chat_template)
        text = tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return text, _meta(text)
    if isinstance(prompt, TextPrompt):
        return prompt.text, PromptMeta()
    return None


def tokenize(tokenizer: Any, req: TokenizeRequest, chat_template: str | None = None,
             context_length: int | None = None) -> tuple[list[int], PromptMeta]:
    """Token ids for a chat / completion / token-id prompt, plus facts the detokenizer needs.
    `chat_template`: the administrator's template (None: the model's); `context_length`: a prompt far
    over it is refused early (encode_within)."""
    built = prompt_text(tokenizer, req, chat_template)
    if built is None:
        assert isinstance(req.prompt, TokenPrompt)
        return list(req.prompt.ids), PromptMeta()
    text, meta = built
    return encode_within(tokenizer, text, context_length, req.prompt_param), meta


def _with_images(built: VisionPrompt, vision: VisionPrompts) -> tuple[list[int], PromptMeta, Callable[[], list[ImageInput]]]:
    """A built vision prompt's ids and facts, and what sends its pixels (once per choice)."""
    return built.input_ids, _meta(built.text), lambda: vision.send(built)


def generate_requests(req: TokenizeRequest, ids: list[int], meta: PromptMeta, context_length: int,
                      images: Callable[[], list[ImageInput]] | None = None) -> list[GenerateRequest]:
    """One GenerateRequest per choice, with max_tokens fitted to the prompt (InvalidSamplingParam if it
    cannot); `images` gives each choice its own ImageInputs."""
    b = req.budget
    max_tokens = fit_max_tokens(b.requested, b.default, len(ids), context_length, req.prompt_param, b.param,
                                b.kv_tokens)
    params = dataclasses.replace(req.params, max_tokens=max_tokens)
    sent = time.perf_counter()  # FirstTokenTimes.tokenized
    return [GenerateRequest(rid, ids, p, meta, req.t_submit, images() if images is not None else [], sent)
            for rid, p in zip(req.rids, choice_params(params, len(req.rids)))]


class Grammars:
    """The structured-output compiler of this tokenizer (built at the first constrained request:
    xgrammar's view of a 151k vocabulary takes about a second). A constraint that is not cached
    compiles on the compiler's thread while this worker goes on with other requests (`Parked`)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None
        think_end = tokenizer.convert_tokens_to_ids(THINK_END)
        self.think_end: int | None = think_end if isinstance(think_end, int) and think_end != tokenizer.unk_token_id else None

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._compiler

    def start(self, c: OutputConstraint) -> concurrent.futures.Future[Any] | None:
        """None when `c` is compiled already, else its compilation (GrammarError from the future when
        it cannot be built)."""
        return None if self.compiler.lookup(c) is not None else self.compiler.submit(c)

    def constrain(self, req: TokenizeRequest, meta: PromptMeta) -> TokenizeRequest:
        """The request with its constraint placed: a prompt that opens a reasoning block gets the
        grammar only after the block's end."""
        c = req.params.constraint
        if c is None:
            return req
        start = self.think_end if meta.starts_in_reasoning else None
        if start == c.starts_after_token:
            return req
        params = dataclasses.replace(req.params, constraint=dataclasses.replace(c, starts_after_token=start))
        return msgspec.structs.replace(req, params=params)


@dataclasses.dataclass
class Parked:
    """A request waiting, off the worker's loop, for its long text to be encoded ("prompt"), for its
    images to be loaded ("images"), or then for its grammar to compile ("grammar", until `deadline`);
    `finish_parked` takes it on."""

    req: TokenizeRequest
    waiting: concurrent.futures.Future[Any]
    stage: str = "images"
    deadline: float | None = None
    ids: list[int] = dataclasses.field(default_factory=list)
    meta: PromptMeta = PromptMeta()
    send_images: Callable[[], list[ImageInput]] | None = None


def tokenize_only(tokenizer: Any, msg: TokenizeOnly, chat_template: str | None = None) -> TokenizeResult:
    """/tokenize and /detokenize: the ids of a prompt (as a generation would build it), or the text of ids."""
    try:
        prompt = msg.prompt
        if prompt is None:
            vocab = len(tokenizer)
            bad = next((t for ids in msg.decode for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                return TokenizeResult(msg.id, error=f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
            return TokenizeResult(msg.id, texts=tokenizer.batch_decode(msg.decode))
        if isinstance(prompt, ChatPrompt):
            if image_parts(prompt.messages):
                return TokenizeResult(msg.id, error="/tokenize does not take images")
            prompt = template_messages(tokenizer, prompt, chat_template)
            text = tokenizer.apply_chat_template(prompt.messages, tokenize=False,
                                                 add_generation_prompt=msg.add_generation_prompt,
                                                 **_template_kwargs(prompt, chat_template))
        else:
            text = prompt.text
        return TokenizeResult(msg.id, ids=tokenizer.encode(text, add_special_tokens=False))
    except Exception as e:  # a template or tokenizer error is the request's fault
        return TokenizeResult(msg.id, error=f"could not tokenize: {e}")


def check_tokenizer(tokenizer: Any, path: str) -> None:
    """Refuse a tokenizer that cannot tokenize (transformers builds an empty one from a folder without
    tokenizer files)."""
    if len(tokenizer) == 0 or not tokenizer.encode("hello", add_special_tokens=False):
        raise RuntimeError(f"the tokenizer in {path} is empty: the folder has no usable tokenizer files "
                           "(tokenizer.json, or vocab.json and merges.txt)")


def run(wctx: WorkerContext) -> None:
    from transformers import AutoTokenizer

    path = wctx.settings["tokenizer_path"]
    template_limits.install()  # the folder's chat template is bounded in time and size
    tokenizer = AutoTokenizer.from_pretrained(path)
    check_tokenizer(tokenizer, path)
    chat_template = None
    if wctx.settings.get("chat_template"):
        with open(wctx.settings["chat_template"], encoding="utf-8") as f:
            chat_template = f.read()
    engine = wctx.settings["engine"]
    hf_config = load_hf_config(engine["model_path"]).get_text_config()
    context_length = engine.get("context_length") or int(hf_config.max_position_embeddings)
    vision = None
    if takes_images(engine["model_path"]):
        vision = VisionPrompts.start(engine["model_path"], wctx.settings.get("server") or {},
                                     wctx.settings.get("ipc") or {}, str(engine.get("device") or "cpu"))
    grammars = Grammars(tokenizer, int(hf_config.vocab_size))
    inbox = ipc.pull(wctx.ctx, wctx.ipc_dir, ipc.TOKENIZER)
    to_sched = ipc.push(wctx.ctx, wctx.ipc_dir, ipc.SCHEDULER)
    decode = decoder(TokenizerInbox).decode
    wctx.ready(context_length=context_length, transport=vision.mode if vision else None,
               transport_fallback=vision.sender.fallback_reason if vision else None)
    parked: list[Parked] = []  # requests whose grammar compiles
    jobs = TokenizeJobs(lambda: AutoTokenizer.from_pretrained(path),  # /tokenize, /detokenize on a thread
                        functools.partial(tokenize_only, chat_template=chat_template))
    try:
        while not wctx.stopping:
            if parked:
                finish_parked(parked, grammars, context_length, wctx, to_sched, vision, chat_template)
            for answer in jobs.finished():
                wctx.send_main(answer)
            if not inbox.poll(5 if parked or jobs.pending else 100):
                continue
            data = inbox.recv()
            try:
                msg: TokenizeRequest | TransportAck | TokenizeOnly | AbortRequest = decode(data)
            except Exception as e:  # main's bug, not a reason to drop every request: fail this one
                logger.error("cannot decode a request: %s", e)
                group = request_id_of(data)
                if group is not None:
                    wctx.send_main(RequestFailed(group, "internal", "the request could not be read by the tokenizer"))
                continue
            if isinstance(msg, TransportAck):
                if vision is not None:
                    vision.on_ack(msg)
                continue
            if isinstance(msg, AbortRequest):  # its client left: drop its parked work
                drop_parked(parked, msg.rid)
                continue
            if isinstance(msg, TokenizeOnly):
                busy = jobs.submit(msg)
                if busy is not None:
                    wctx.send_main(busy)
                continue
            handle(msg, tokenizer, vision, chat_template, context_length, wctx, to_sched, grammars, parked, jobs)
    finally:
        jobs.close()
        if vision is not None:
            vision.close()


def handle(req: TokenizeRequest, tokenizer: Any, vision: VisionPrompts | None, chat_template: str | None,
           context_length: int, wctx: WorkerContext, to_sched: Any, grammars: Grammars | None = None,
           parked: list[Parked] | None = None, jobs: TokenizeJobs | None = None) -> None:
    """Tokenize one request and send its choices on, or tell main why it failed. With `parked`, a
    request whose images are still loading or whose grammar is still compiling waits there instead of
    holding up the requests behind it; so does one whose text is long, encoded on `jobs`' thread."""
    logger.debug("request %s (%s)", req.group, type(req.prompt).__name__)
    try:
        send_images = None
        if vision is not None and vision.wants(req.prompt):
            assert isinstance(req.prompt, ChatPrompt)
            # in the template's shape (prompt_text converts a text prompt's), also while parked
            chat = template_messages(tokenizer, req.prompt, chat_template)
            req = msgspec.structs.replace(req, prompt=chat)
            if parked is not None:
                loading = vision.load_later(chat)
                if loading is None:
                    raise WorkerBusy(f"{vision.max_queued} image requests are already being loaded; retry shortly")
                parked.append(Parked(req, loading))
                return
            kwargs = _template_kwargs(chat, chat_template)
            ids, meta, send_images = _with_images(vision.build(tokenizer, chat, kwargs), vision)
        elif isinstance(req.prompt, ChatPrompt) and image_parts(req.prompt.messages):
            raise ImageError("images are not supported by the loaded model", "model")
        elif parked is not None and jobs is not None and (built := prompt_text(tokenizer, req, chat_template)):
            text, meta = built
            if len(text) <= LONG_TEXT_CHARS:
                ids = encode_within(tokenizer, text, context_length, req.prompt_param)
            else:
                encoding = jobs.call_later(functools.partial(encode_within, text=text, context_length=context_length,
                                                             param=req.prompt_param))  # fmt: skip
                if encoding is None:
                    raise WorkerBusy(f"{jobs.max_queued} long prompts are already being encoded; retry shortly")
                parked.append(Parked(req, encoding, "prompt", meta=meta))
                return
        else:
            ids, meta = tokenize(tokenizer, req, chat_template, context_length)
        _go_on(req, ids, meta, send_images, context_length, to_sched, grammars, parked)
    except Exception as e:
        wctx.send_main(_failure(req, e))


def _go_on(req: TokenizeRequest, ids: list[int], meta: PromptMeta, send_images: Callable[[], list[ImageInput]] | None,
           context_length: int, to_sched: Any, grammars: Grammars | None, parked: list[Parked] | None) -> None:
    """A tokenized request: its grammar (parked while it compiles), then its choices to the scheduler."""
    c = req.params.constraint
    if grammars is not None and c is not None:
        req = grammars.constrain(req, meta)
        compiling = grammars.start(c)
        if compiling is not None:
            deadline = time.monotonic() + grammars.compiler.timeout_s
            if parked is not None:
                parked.append(Parked(req, compiling, "grammar", deadline, ids, meta, send_images))
                return
            _wait(compiling, grammars.compiler, c)
    for gen in generate_requests(req, ids, meta, context_length, send_images):
        to_sched.send(encode(gen))


def finish_parked(parked: list[Parked], grammars: Grammars, context_length: int, wctx: WorkerContext,
                  to_sched: Any, vision: VisionPrompts | None = None, chat_template: str | None = None) -> None:
    """Take on the parked requests whose images are loaded or whose grammar compiled; fail those whose
    images or grammar were refused, or whose grammar outlived the compile timeout (its thread runs on;
    later compilations queue behind it)."""
    now = time.monotonic()
    for p in [p for p in parked if p.waiting.done() or (p.deadline is not None and now >= p.deadline)]:
        parked.remove(p)
        try:
            if p.stage == "prompt":
                _go_on(p.req, p.waiting.result(), p.meta, None, context_length, to_sched, grammars, parked)
                continue
            if p.stage == "images":
                assert vision is not None and isinstance(p.req.prompt, ChatPrompt)
                tokenizer = grammars.tokenizer  # the worker's
                encode_text = functools.partial(encode_within, tokenizer, context_length=context_length,
                                                param=p.req.prompt_param)  # fmt: skip
                kwargs = _template_kwargs(p.req.prompt, chat_template)
                built = vision.prompt(tokenizer, p.req.prompt, kwargs, p.waiting.result(), encode_text)
                ids, meta, send_images = _with_images(built, vision)
                _go_on(p.req, ids, meta, send_images, context_length, to_sched, grammars, parked)
                continue
            assert p.req.params.constraint is not None
            grammars.compiler.finish(p.waiting, p.req.params.constraint)
            for gen in generate_requests(p.req, p.ids, p.meta, context_length, p.send_images):
                to_sched.send(encode(gen))
        except Exception as e:
            wctx.send_main(_failure(p.req, e))


def drop_parked(parked: list[Parked], group: str) -> None:
    """Forget the parked work of request `group` (main gave it up): a load, an encode or a compilation
    that has not started is cancelled; one running ends unheeded."""
    for p in [p for p in parked if p.req.group == group]:
        parked.remove(p)
        p.waiting.cancel()


def _wait(compiling: concurrent.futures.Future[Any], compiler: GrammarCompiler, c: OutputConstraint) -> None:
    concurrent.futures.wait([compiling], timeout=compiler.timeout_s)
    compiler.finish(compiling, c)


def _failure(req: TokenizeRequest, e: Exception) -> RequestFailed:
    """What main tells the client about a request this worker could not send on."""
    if isinstance(e, (GrammarError, InvalidSamplingParam)):
        return RequestFailed(req.group, "invalid_request", str(e), e.param)
    if isinstance(e, ImageError):
        return RequestFailed(req.group, "invalid_request", e.message, req.prompt_param)
    if isinstance(e, TransportFull):
        return RequestFailed(req.group, "unavailable", f"too many images in flight: {e}")
    if isinstance(e, WorkerBusy):
        return RequestFailed(req.group, "unavailable", str(e))
    # a template or tokenizer error is the request's fault
    return RequestFailed(req.group, "invalid_request", f"could not build the prompt: {e}")


if __name__ == "__main__":
    worker_main(ipc.TOKENIZER, run)
