"""The numbers behind every endpoint: one prefill of the prompt, then greedy single-token decode
steps, each position's log-probabilities the float32 logit row's log-softmax (reference.metrics,
as tools.golden scores a continuation). The forwards are those of tools.golden --engine reference:
the whole prompt in one prefill (every row through the output head) into a cache sized for prompt +
generation, then one token per step, so that a reply equals that golden to the last bit. With a
DFlash drafter (-md), the target verifies drafted tokens several at a time: the exact forward's rows
do not depend on how many rows a forward takes, so the tokens and every log-probability are the same.
No prefix is reused between requests: an answer never depends on the requests before it."""
import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .. import metrics
from ..chat import ChatError, chat_prompt, image_prompt_rows, prompt_ids
from ..cli import check_train_context
from ..dflash import Speculator
from ..run import draft_floor
from ..tokenizer import Tokenizer, TokenizerError, detokenize, token_to_piece

log = logging.getLogger("reference.serve")


class RequestError(ValueError):
    """A request the oracle refuses (bad ids, too long, a sampler); the message is one line."""


class Busy(Exception):
    """The queue of forwards is full: 503 with Retry-After."""


class Expired(Exception):
    """The request's deadline passed before its forwards were done."""


@dataclass(frozen=True)
class Scored:
    """One position's verdict: `token` as chosen (prompt) or generated (greedy), its log-probability
    and rank (1: the argmax, vLLM's) under the row before it, and that row's top ids and log-probabilities
    (best first, ties by the lower id, as np.argmax picks)."""
    token: int
    logprob: float
    rank: int
    top_ids: tuple
    top_logprobs: tuple


@dataclass(frozen=True)
class Ask:
    """What a request asks of the forwards besides its prompt ids."""
    n_predict: int                 # tokens to generate (< 0: to the context's end)
    k: int = 0                     # top ids and log-probabilities per position
    prompt_logprobs: bool = False  # score every prompt position
    stop_at_eog: bool = True       # False: ignore_eos
    stops: tuple = ()              # stop strings: generation ends once the text holds one
    images: tuple = ()             # uint8 [H, W, 3] per <|patch|> of the ids


@dataclass(frozen=True)
class Completion:
    prompt: list            # prompt ids
    prompt_scores: list     # Scored per prompt position 1 .. n-1 (the first has no row before it); [] unless asked
    tokens: list            # generated ids
    token_scores: list      # Scored per generated token
    finish: str             # "stop" (an end-of-generation token or a stop string) or "length"
    stop_word: str = ""     # the stop string that ended it


def score_row(row, token, k):  # float32 [V], the token it chose, top count -> Scored
    logprobs = metrics.log_softmax(row)
    top = np.argsort(-row, kind="stable")[:k] if k else np.zeros(0, np.int64)
    return Scored(int(token), float(logprobs[token]), int(np.sum(row > row[token])) + 1,
                  tuple(int(t) for t in top), tuple(float(logprobs[t]) for t in top))


class Oracle:
    """A text model and its tokenizer behind the endpoints; `complete` runs on the one forward thread."""

    def __init__(self, lm, tok, name, layout, n_ctx, vision=None, image_max_tokens=None, drafter=None, n_max=3,
                 p_min=0.0):
        # lm: TextModel; tok: TokenizerConfig; layout: (cache kind, prefill chunk); n_ctx: positions a request
        # may take; vision: the VisionModel of --mmproj (None: text only); drafter: the Drafter of
        # -md/--model-draft, drafting n_max tokens a step with the floor p_min (--spec-draft-p-min)
        self.lm, self.tok, self.name = lm, tok, name
        self.kind, self.chunk = layout
        self.n_ctx = n_ctx
        self.vision, self.image_max_tokens = vision, image_max_tokens
        self.drafter, self.n_max, self.p_min = drafter, n_max, p_min
        self.tokenizer = Tokenizer(tok)
        self.eog = tok.eog_ids

    @property
    def n_vocab(self):
        return self.tok.n_vocab

    # -- text <-> ids ---------------------------------------------------------------------------
    def tokenize(self, text, add_special, parse_special=True):  # -> ids (llama_tokenize)
        try:
            return self.tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)
        except TokenizerError as e:
            raise RequestError(str(e)) from None

    def tokenize_mixed(self, prompt, add_special=True):  # str | [int | str] -> ids, llama-server's tokenize_mixed
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_special)
        ids = []
        for i, part in enumerate(prompt):  # BOS only when the first item is text
            ids += self.tokenize(part, add_special and i == 0) if isinstance(part, str) else self.check_ids([part])
        return ids

    def check_ids(self, ids):  # -> ids; RequestError for one outside the vocabulary
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is out of range for a vocabulary of {self.n_vocab}")
        return list(ids)

    def piece(self, i):  # id -> its bytes (special tokens' text too, as llama-server's common_token_to_piece)
        return token_to_piece(self.tok, i)

    def text(self, ids):  # -> text of ids (llama_detokenize, special tokens kept)
        return detokenize(self.tok, self.check_ids(ids))

    def generated_text(self, ids):  # -> generated text: control tokens (end of generation) print nothing
        return detokenize(self.tok, ids, special=False)

    def completion_text(self, done):  # Completion -> its generated text, cut before the stop string that ended it
        return before_stop(self.generated_text(done.tokens), done.stop_word)

    def chat(self, messages):  # OpenAI messages -> prompt ids through the GGUF's chat template
        try:
            return prompt_ids(self.tokenizer, self.chat_text(messages))
        except TokenizerError as e:
            raise RequestError(str(e)) from None

    def chat_text(self, messages):  # -> the rendered template
        try:
            return chat_prompt(self.tok, messages)
        except ChatError as e:
            raise RequestError(str(e)) from None

    # -- checks before queueing -----------------------------------------------------------------
    def check_length(self, n_prompt, n_predict):  # -> n_predict, clamped to the context when < 0 (no limit)
        if n_prompt == 0:
            raise RequestError("the prompt has no tokens")
        if n_prompt > self.n_ctx:
            raise RequestError(f"the prompt has {n_prompt} tokens, more than the context of {self.n_ctx}")
        n_predict = self.n_ctx - n_prompt if n_predict < 0 else n_predict
        if n_prompt + n_predict > self.n_ctx:
            raise RequestError(f"{n_prompt} prompt tokens and {n_predict} to generate exceed the context of "
                               f"{self.n_ctx}")
        return n_predict

    # -- the forwards (on the forward thread) ---------------------------------------------------
    def complete(self, ids, ask, cancelled, on_token=None):  # ids, Ask, an Event -> Completion
        """A prefill of ids (each <|patch|> of them one of ask.images, encoded by the vision tower as
        reference.run does), then up to ask.n_predict greedy tokens, each scored with its top ask.k.
        on_token(Scored) is called as each token is chosen (streaming); `cancelled` (deadline passed,
        client gone) stops the work before its next forward. With a drafter (text prompts), the
        tokens are verified several at a time: the same tokens and the same rows."""
        def check():
            if cancelled.is_set():
                raise Expired("cancelled")
        check()
        rows = self.image_rows(ids, ask.images) if ask.images else None
        n_rows = len(ids) if rows is None else len(rows)
        n_predict = self.check_length(n_rows, ask.n_predict)
        n_ctx = n_rows + max(n_predict, 1)
        cache = self.lm.new_cache(n_ctx, self.kind, self.chunk)
        speculator = Speculator(self.lm, self.drafter, cache, self.drafter.new_cache(n_ctx), self.chunk,
                                ask.stop_at_eog) if self.drafter and rows is None else None
        # llama-server's outputs: the prompt's last row alone unless the prompt is scored (under ggml-cpu
        # numerics the output matrix's kernel, so the row's last bits, depend on how many rows it takes)
        out = None if ask.prompt_logprobs else np.array([n_rows - 1])
        logits = (speculator.forward(ids) if speculator else self.lm.prefill(ids, cache, self.chunk, out_rows=out)
                  if rows is None else self.lm.prefill_embeddings(rows, cache, self.chunk, out_rows=out)).astype(np.float32)
        prompt_scores = [score_row(logits[p - 1], ids[p], ask.k) for p in range(1, len(ids))] \
            if ask.prompt_logprobs else []
        steps = []
        chosen = speculator.greedy(logits[-1], n_predict, self.n_max, *draft_floor(self.p_min), steps=steps) \
            if speculator else self.greedy(logits[-1], n_predict, cache)
        tokens, scores, finish, word = [], [], "length", ""
        for token, row in chosen:
            scored = score_row(row.astype(np.float32), token, ask.k)
            tokens.append(token)
            scores.append(scored)
            if on_token is not None:
                on_token(scored)
            word = stop_word(self.generated_text(tokens), ask.stops) if ask.stops else ""
            if word or (ask.stop_at_eog and token in self.eog):
                finish = "stop"
                break
            if len(tokens) < n_predict:
                check()
        if speculator:
            log.info("speculative: %d of %d drafts accepted in %d steps", sum(s.accepted for s in steps),
                     sum(s.drafted for s in steps), len(steps))
        return Completion(list(ids), prompt_scores, tokens, scores, finish, word)

    def greedy(self, row, n_predict, cache):  # -> (id, the row that chose it) per token: one decode step each
        for n in range(n_predict):
            token = int(np.argmax(row))
            yield token, row
            if n + 1 < n_predict:
                row = self.lm.prefill([token], cache, self.chunk)[-1]

    def image_rows(self, ids, images):  # ids with a <|patch|> per image, [uint8 [H, W, 3]] -> embedding rows [T, E]
        if self.vision is None:
            raise RequestError("image input needs a vision tower: start the server with --mmproj")
        try:
            embeddings = [self.vision.encode(rgb, self.image_max_tokens) for rgb in images]
            return image_prompt_rows(self.tok, self.lm.embed, ids, embeddings)
        except ChatError as e:
            raise RequestError(str(e)) from None


def stop_word(text, stops):  # -> the stop string that occurs first in text, "" when none does
    found = [(text.find(w), w) for w in stops if w in text]
    return min(found)[1] if found else ""


def before_stop(text, word):  # -> text up to its stop string (the servers' content leaves it out)
    return text[:text.find(word)] if word else text


def held_back(text, stops):  # -> where the tail of text that could begin a stop string starts (len(text): none)
    """llama-server's string_find_partial_stop over every stop string, the earliest start winning."""
    cut = len(text)
    for word in stops:
        n = next((n for n in range(min(len(text), len(word)), 0, -1) if text.endswith(word[:n])), 0)
        cut = min(cut, len(text) - n)
    return cut


class Release:
    """The text a stream sends as its tokens come, as llama-server's process_token releases it: only what
    no later token can change. An incomplete UTF-8 character at the end, and a tail that could begin a
    stop string, wait; a completed stop string ends the text before it. The pieces add up to the text
    of the answer that is not streamed. Only the text not yet released is searched: what was released
    never ends in the start of a stop string, so no stop string can begin in it."""

    def __init__(self, oracle, stops):
        self.oracle, self.stops = oracle, stops
        self.held, self.sent = b"", ""  # generated bytes not released yet; the text released

    def token(self, t):  # -> the text released once t is generated ("" while it could still change)
        self.held += token_to_piece(self.oracle.tok, t, special=False)
        if len(valid_utf8(self.held)) < len(self.held):
            return ""
        text = self.held.decode("utf-8", errors="replace")
        word = stop_word(text, self.stops)
        out = before_stop(text, word) if word else text[:held_back(text, self.stops)]
        self.held = text[len(out):].encode()
        self.sent += out
        return out

    def rest(self, done):  # Completion -> the text still held when generation ended
        text = self.oracle.completion_text(done)
        return text[len(self.sent):]


class ForwardQueue:
    """One forward at a time (one thread), at most `bound` requests waiting or running; past that, Busy.
    A waiting request whose client goes away or whose deadline passes is dropped before it runs."""

    def __init__(self, bound):
        self.bound, self.pending = bound, 0
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="forward")

    def run(self, work, deadline_s, gone=None):  # work(cancelled Event) -> an awaitable of its result
        """Admits the request now (Busy past the bound); the awaitable waits for its turn and its
        result, within deadline_s seconds and while `gone()` (an async client check) says False."""
        if self.pending >= self.bound:
            raise Busy(f"{self.pending} requests are queued or running, the most this server holds")
        self.pending += 1
        return self.wait(work, deadline_s, gone)

    async def wait(self, work, deadline_s, gone):
        cancelled = threading.Event()
        future = asyncio.wrap_future(self.thread.submit(work, cancelled))
        watch = asyncio.ensure_future(watch_client(gone)) if gone is not None else None
        try:
            done, _ = await asyncio.wait({future} | ({watch} if watch else set()), timeout=deadline_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if future in done:
                return future.result()
            raise Expired("the client went away" if watch in done else
                          f"no answer within the deadline of {deadline_s:g} s (--timeout)")
        finally:
            if not future.done():  # a waiting request never runs; a running one stops at its next forward
                cancelled.set()
                future.cancel()
            if watch is not None:
                watch.cancel()
            self.pending -= 1

    def close(self):
        self.thread.shutdown(wait=True, cancel_futures=True)


async def watch_client(gone):  # returns once gone() says the client went away
    """Asks only after a first poll interval: most requests are answered before it (asking costs a
    receive on the connection, a tenth of the server's own time per request)."""
    while True:
        await asyncio.sleep(CLIENT_POLL_S)
        if await gone():
            return


CLIENT_POLL_S = 0.1  # how often a waiting request asks whether its client is still there


def context_size(cfg, ctx, model, beyond):  # --ctx (0: the training context) -> positions a request may take
    n_ctx = ctx or cfg.n_ctx_train
    check_train_context(n_ctx, cfg.n_ctx_train, "--ctx", model, beyond)
    return n_ctx


def valid_utf8(data):  # bytes -> the prefix that does not end inside a UTF-8 character (llama-server's validate_utf8)
    for i in range(1, min(4, len(data)) + 1):
        lead = data[-i]
        if (lead & 0xE0 == 0xC0 and i < 2) or (lead & 0xF0 == 0xE0 and i < 3) or (lead & 0xF8 == 0xF0 and i < 4):
            return data[:-i]
    return data


def piece_text(data):  # a token's bytes -> its text as the servers print it: a cut character dropped
    return valid_utf8(data).decode("utf-8", errors="replace")
