"""Keep Python's cyclic garbage collector off the objects a process holds for its whole life.

A full (generation 2) collection visits every tracked object. After loading, the scheduler worker
holds about 250,000 of them (the model's modules and parameters, Triton's and torch's caches), the
tokenizer and detokenizer workers about 500,000 each (the tokenizer's vocabulary), the main process
about 40,000. Serving promotes each request's objects to the old generation until a full collection
runs, and that collection then stalls the process for every request at once: measured on this
project's 2-core CI machine, 2,000 chats gave each worker 6-7 full collections of up to 300-380 ms
(docs/benchmarks.md, 2026-12-07). `gc.freeze()` moves what is alive to a permanent generation that
collections skip, as vLLM's engine core and SGLang's scheduler do after start-up; the objects are
still freed by reference counting, only a cycle among them waits for the next `freeze_long_lived`.
"""

from __future__ import annotations

import gc


def freeze_long_lived() -> int:
    """Collect, then freeze what is left; returns how many objects are frozen now.

    Call it once a process has loaded what it keeps (a worker before it reports ready; the main
    process when a model becomes active). What an earlier call froze is thawed and collected first,
    so that a cycle that has become garbage since (a model swapped out) is freed, not kept for ever.
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
