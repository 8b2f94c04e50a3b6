"""The numpy engine: the tiny Llama generating on CPU at the weights the worker holds.

One thread owns the model and runs the schedule; the event loop only hands requests in
and takes chunks out. Each turn admits every waiting request (prefill: cached prefix
blocks are reused, the rest is computed and stored), then advances every running one by
one token with its own KV cache, so concurrent requests share the thread turn by turn
(continuous batching at the token level) and a new request waits at most one turn for
its first token. A chunk per token carries `token_ids`, `log_probs` (see `sampling`),
`top_logprobs` when asked for, and on the last one `finish_reason` and
`completion_usage` with the prompt tokens found in the prefix cache (`cached_tokens`).

The model is `numpy_llama.NumpyLlama` (no torch in the worker's process: importing it
cost most of a worker start); BLAS runs on the thread count `--threads` set before numpy
loaded (see `args`). Same interface as `MockerEngine`: a restart (flush, new weights) is a
fresh model with an empty prefix cache; the router hears `AllBlocksCleared` through the
KV event bridge.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dynamod.workers.cpu.errors import WorkerError
from dynamod.workers.cpu.kv_events import KvEventBridge
from dynamod.workers.cpu.llama_config import LlamaConfig
from dynamod.workers.cpu.numpy_llama import LayerKV, NumpyLlama, check_fit
from dynamod.workers.cpu.prefix_cache import KvEvent, PrefixCache
from dynamod.workers.cpu.sampling import (
    SamplingParams,
    generator_for,
    raw_logprobs,
    sample,
    top_entries,
)
from dynamod.workers.weights import WeightSet

log = logging.getLogger("dynamod.workers.cpu")

_END = object()


@dataclass(eq=False)
class _Sequence:
    """One request inside the engine; the thread appends, the event loop reads `out`."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    generator: np.random.Generator | None = None
    cache: list[LayerKV] = field(default_factory=list)  # per layer: keys, values
    generated: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    cancelled: bool = False

    def emit(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class NumpyEngine:
    """The model directory's Llama (`numpy_llama.NumpyLlama`) at the weights given."""

    def __init__(
        self,
        model_dir: Path,
        weights: WeightSet,
        block_size: int,
        cache_blocks: int,
        on_death: Callable[[BaseException | None], None],
    ) -> None:
        self._model_dir = model_dir
        self._weights = weights
        self.block_size = block_size
        self._cache_blocks = cache_blocks
        self._on_death = on_death
        self._model: NumpyLlama | None = None
        self._max_len = 0
        self._thread: threading.Thread | None = None
        self._inbox: queue.SimpleQueue[_Sequence | None] = queue.SimpleQueue()
        self._running: list[_Sequence] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: asyncio.Queue[KvEvent | None] = asyncio.Queue()
        self._publishing: asyncio.Task[None] | None = None
        self.cache = PrefixCache(block_size, cache_blocks, self._event)
        self.generation = 0
        self.kv_events: KvEventBridge | None = None

    # ------------------------------------------------------------------ lifecycle

    def bind_kv_events(self, bridge: KvEventBridge) -> None:
        self.kv_events = bridge

    def check_weights(self, weights: WeightSet) -> None:
        """WorkerError naming the checkpoint where its tensors do not fit the model
        directory's config (a name missing or extra, a shape, a dtype): the admission asks
        before it stops the running engine, whose start with them would fail. The running
        model's config, read at its start; the file only before there is one."""
        model = self._model
        config = model.config if model is not None else LlamaConfig.from_file(
            self._model_dir / "config.json")  # fmt: skip
        check_fit(config, weights.tensors, str(weights.source))

    def use_weights(self, weights: WeightSet) -> None:
        """Weights for the next start (the admission restarts the engine right after)."""
        self._weights = weights

    async def start(self, timeout: float = 60.0) -> None:
        self._loop = asyncio.get_running_loop()
        if self._publishing is None:
            self._publishing = asyncio.create_task(self._publish())
        self._model = await asyncio.wait_for(asyncio.to_thread(self._build), timeout)
        self._inbox = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="numpy-engine", daemon=True)
        self._thread.start()
        self.generation += 1
        log.info("numpy engine %d serving (digest %s)", self.generation, self._weights.digest)

    def _build(self) -> NumpyLlama:
        model = NumpyLlama.from_dir(self._model_dir, self._weights.tensors)
        self._max_len = model.config.max_position_embeddings
        return model

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def reachable(self) -> bool:
        """In this process, found by no discovery: reachable while it runs."""
        return self.alive

    def stats(self) -> dict[str, Any]:
        """The prefix cache's state and counts since the worker started (kept over flushes)."""
        stats = self.cache.stats
        return {
            "engine": "numpy",
            "prefix_cache": {
                "blocks": len(self.cache),
                "capacity_blocks": self.cache.capacity,
                "block_size": self.block_size,
                "queried_tokens": stats.queried_tokens,
                "hit_tokens": stats.hit_tokens,
                "hit_rate": round(stats.hit_rate, 4),
                "stored_blocks": stats.stored_blocks,
                "evicted_blocks": stats.evicted_blocks,
            },
        }

    def halt(self) -> None:
        """Tell the engine thread to end after its turn (safe from a signal handler)."""
        self._inbox.put(None)

    async def stop(self) -> None:
        thread = self._thread
        if thread is None:
            return
        self.halt()
        await asyncio.to_thread(thread.join)
        self._thread = None
        self._model = None
        self.cache.clear()

    async def close(self) -> None:
        await self.stop()
        if self._publishing is not None:
            self._events.put_nowait(None)
            with contextlib.suppress(asyncio.CancelledError):
                await self._publishing
            self._publishing = None
        if self.kv_events is not None:
            await self.kv_events.close()

    async def restart(self) -> None:
        await self.stop()
        try:
            await self.start()
        except Exception as exc:
            self._on_death(exc)
            raise

    # ----------------------------------------------------------------- KV events

    def _event(self, event: KvEvent) -> None:
        """From the engine thread (or the loop, on a clear): queue for the bridge."""
        loop = self._loop
        if loop is None:
            return
        if threading.current_thread() is threading.main_thread():
            self._events.put_nowait(event)
        else:
            loop.call_soon_threadsafe(self._events.put_nowait, event)

    async def _publish(self) -> None:
        while True:
            event = await self._events.get()
            if event is None:
                return
            if self.kv_events is not None:
                try:
                    await self.kv_events.publish([event])
                except Exception:  # the router re-learns on the next store; keep serving
                    log.exception("KV event not published")

    # ---------------------------------------------------------------- generation

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[Any]:
        if not self.alive or self._loop is None:
            raise WorkerError("numpy engine is not running")
        prompt = [int(t) for t in request.get("token_ids") or []]
        if not prompt:
            raise WorkerError("request has no prompt tokens")
        params = SamplingParams.from_request(request)
        seq = _Sequence(prompt, params, self._loop)
        self._inbox.put(seq)
        try:
            while True:
                item = await seq.out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise WorkerError(f"numpy engine failed: {item}") from item
                yield item
        finally:
            seq.cancelled = True

    def _serve(self) -> None:
        try:
            while self._turn():
                pass
        except Exception as exc:
            log.exception("numpy engine failed")
            for seq in self._running:
                seq.emit(exc)
            self._running.clear()
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._on_death, exc)
            return
        for seq in self._running:  # stopped with requests inside: end them
            seq.emit(_END)
        self._running.clear()

    def _turn(self) -> bool:
        """Admit what waits (blocking when nothing runs), then one token for each."""
        arrivals: list[_Sequence | None] = []
        if not self._running:
            arrivals.append(self._inbox.get())
        while True:
            try:
                arrivals.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for seq in arrivals:
            if seq is None:
                return False
            if not seq.cancelled:
                self._running.append(seq)  # first: a failure below must reach it too
                self._prefill(seq)
        self._running = [seq for seq in self._running if not seq.cancelled]
        if self._running:
            self._decode(list(self._running))
        return True

    def _forward(self) -> NumpyLlama:
        if self._model is None:
            raise WorkerError("numpy engine has no model (stopped)")
        return self._model

    def _prefill(self, seq: _Sequence) -> None:
        seq.generator = generator_for(seq.params.seed)
        blocks = self.cache.lookup(seq.prompt)
        seq.cached_tokens = len(blocks) * self.block_size
        logits, seq.cache = self._forward()(
            np.array([seq.prompt[seq.cached_tokens :]], dtype=np.int64),
            past=_cache_from_blocks(blocks),
        )
        self.cache.store(seq.prompt, lambda i: _block_kv(seq.cache, i, self.block_size))
        self._emit_next(seq, logits[0, -1])

    def _decode(self, batch: list[_Sequence]) -> None:
        """One token for every sequence in `batch`, in one forward pass.

        Each sequence keeps its own KV; for the pass they are left-padded to the longest,
        with the padding masked out and each row at its own position.
        """
        lengths = [len(seq.prompt) + len(seq.generated) - 1 for seq in batch]
        longest = max(lengths)
        mask = np.zeros((len(batch), longest + 1), dtype=np.int64)
        for row, length in enumerate(lengths):
            mask[row, longest - length :] = 1
        logits, kv = self._forward()(
            np.array([[seq.generated[-1]] for seq in batch], dtype=np.int64),
            past=_padded_cache([seq.cache for seq in batch], lengths, longest),
            attention_mask=mask,
            position_ids=np.array([[length] for length in lengths], dtype=np.int64),
        )
        for row, seq in enumerate(batch):
            seq.cache = [
                (
                    np.concatenate([keys, new_keys[row : row + 1, :, -1:, :]], axis=2),
                    np.concatenate([values, new_values[row : row + 1, :, -1:, :]], axis=2),
                )
                for (keys, values), (new_keys, new_values) in zip(seq.cache, kv, strict=True)
            ]
            self._emit_next(seq, logits[row, -1])

    def _emit_next(self, seq: _Sequence, logits: Any) -> None:
        params = seq.params
        logprobs = raw_logprobs(logits)
        banned = sorted(params.stop_token_ids) if len(seq.generated) < params.min_tokens else []
        assert seq.generator is not None  # set by _prefill
        token = sample(logits, params, seq.generator, banned)
        # The stop token is returned with its logprob, as vLLM returns it (dynamo.vllm
        # through the frontend: `completion_token_ids` ends with it); a trainer learns to
        # stop from it, and a first-token stop is one token, never an empty completion.
        seq.generated.append(token)
        chunk: dict[str, Any] = {"index": 0, "token_ids": [token],
                                 "log_probs": [float(logprobs[token])]}
        if params.logprobs is not None:
            chunk["top_logprobs"] = [top_entries(logprobs, token, params.logprobs)]
        finish: str | None = None
        if token in params.stop_token_ids:
            finish = "stop"
        elif len(seq.generated) >= params.max_tokens or (
            len(seq.prompt) + len(seq.generated) >= self._max_len
        ):
            finish = "length"
        if finish is not None:
            chunk["finish_reason"] = finish
            chunk["completion_usage"] = {
                "prompt_tokens": len(seq.prompt),
                "completion_tokens": len(seq.generated),
                "total_tokens": len(seq.prompt) + len(seq.generated),
                "prompt_tokens_details": {"cached_tokens": seq.cached_tokens},
            }
            self._running.remove(seq)
        seq.emit(chunk)
        if finish is not None:
            seq.emit(_END)


def _cache_from_blocks(blocks: list[list[LayerKV]]) -> list[LayerKV] | None:
    """The concatenated per-layer KV of cached blocks (None when there are none)."""
    if not blocks:
        return None
    return [
        (
            np.concatenate([b[layer][0] for b in blocks], axis=2),
            np.concatenate([b[layer][1] for b in blocks], axis=2),
        )
        for layer in range(len(blocks[0]))
    ]


def _padded_cache(caches: list[list[LayerKV]], lengths: list[int], longest: int) -> list[LayerKV]:
    """One batch KV: each row's per-layer keys and values left-padded to `longest`."""
    padded = []
    for layer in range(len(caches[0])):
        keys0 = caches[0][layer][0]
        shape = (len(caches), keys0.shape[1], longest, keys0.shape[3])
        keys = np.zeros(shape, dtype=keys0.dtype)
        values = np.zeros(shape, dtype=keys0.dtype)
        for row, (kv, length) in enumerate(zip(caches, lengths, strict=True)):
            keys[row, :, longest - length :, :] = kv[layer][0][0]
            values[row, :, longest - length :, :] = kv[layer][1][0]
        padded.append((keys, values))
    return padded


def _block_kv(kv: list[LayerKV], index: int, block_size: int) -> list[LayerKV]:
    """Block `index`'s keys and values, per layer, copied out of a sequence's KV."""
    lo, hi = index * block_size, (index + 1) * block_size
    return [(k[:, :, lo:hi, :].copy(), v[:, :, lo:hi, :].copy()) for k, v in kv]
