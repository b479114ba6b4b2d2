"""bench/constrained_decode.py's batched part: constrained against free decode in the
engine's running batch.

For each grammar, N concurrent greedy requests go through a real Engine over a
ModelRunner (max_batch N, prefix cache off): all N under the grammar, then all N free,
alternating. A first constrained run, not measured, fixes how many tokens each row
produces (a row stops where its grammar is complete, or at the budget); the free rows
then run exactly as many tokens each, EOS ignored (their runner's model has no EOS ids,
as the single-sequence bench's free run decodes past EOS), so both runs keep the same
rows in the batch for the same steps. Speed is the batch's aggregate decode rate over
its steady part: from the moment every row has produced its first token (no prompt is
being read any more) to the last token, counting the tokens produced in that window.
Every constrained output is checked: a finished one must validate, one cut at the
budget cannot be.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jsonschema

from runtime.engine import Engine, ModelRunner, RequestHandle, RunnerSettings
from runtime.load import LoadedModel
from runtime.types import (
    Constraint,
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TextDelta,
)

GREEDY = SamplingParams(temperature=0.0)
TARGET = 0.9  # issue 11: a constrained stream costs at most 10% more per token


@dataclass(frozen=True)
class BatchCase:
    """One grammar, the prompt of each row, and the check of a finished output's text."""

    name: str
    constraint: Constraint
    prompts: Sequence[Sequence[int]]
    valid: Callable[[str], bool]


@dataclass
class Row:
    """What one request produced: its tokens, when each arrived, and how it ended."""

    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    ended: Finished | None = None


@dataclass
class Tally:
    """The constrained outputs of one case over all its runs."""

    valid: int = 0
    finished: int = 0
    cut: int = 0  # ended at the budget: no complete document to validate

    def __str__(self) -> str:
        cut = f"{self.cut} cut at the budget" if self.cut else ""
        if not self.finished:
            return f"- ({cut})"
        verdict = "yes" if self.valid == self.finished else "NO"
        return f"{verdict} ({self.valid}/{self.finished} finished valid{'; ' if cut else ''}{cut})"


def schema_check(schema: Mapping[str, Any]) -> Callable[[str], bool]:
    """A finished output is a JSON document valid against `schema`."""

    def valid(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    return valid


def tool_check(tools: Sequence[Mapping[str, Any]], opener: str) -> Callable[[str], bool]:
    """A finished output (after the forced `opener`) is, to the hermes parser, calls to
    declared tools whose arguments are valid against their parameter schemas."""
    from tests.support.schema_cases import hermes_calls

    declared = [dict(t) for t in tools]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}

    def valid(text: str) -> bool:
        calls = hermes_calls(opener + text, declared)
        try:
            for name, args in calls:
                jsonschema.validate(json.loads(args), schemas[name])
        except (KeyError, ValueError, jsonschema.ValidationError):
            return False
        return bool(calls)

    return valid


def _consume(handle: RequestHandle, row: Row) -> None:
    for event in handle:
        if isinstance(event, TextDelta):
            now = time.perf_counter()
            row.tokens += event.token_ids
            row.times += [now] * len(event.token_ids)
        elif isinstance(event, Finished):
            row.ended = event


def _run(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    budgets: Sequence[int],
    constraint: Constraint | None,
) -> list[Row]:
    """The rows of one batch of concurrent requests, each read on a thread of its own
    (as a server's event loop would), so every token is timed as it arrives."""
    requests = [
        GenerationRequest(tuple(p), b, GREEDY, constraint=constraint)
        for p, b in zip(prompts, budgets, strict=True)
    ]
    rows = [Row() for _ in requests]
    handles = engine.submit_all(requests)
    readers = [
        threading.Thread(target=_consume, args=(h, r), daemon=True)
        for h, r in zip(handles, rows, strict=True)
    ]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    for row in rows:
        assert row.ended is not None
        if row.ended.reason is FinishReason.ERROR or not row.tokens:
            raise SystemExit(f"a batched request failed: {row.ended.error}")
    return rows


def steady_rate(rows: Sequence[Row]) -> float:
    """Tokens/s of the whole batch from the moment every row has its first token to the
    last token, over the tokens produced in between."""
    start = max(r.times[0] for r in rows)
    end = max(r.times[-1] for r in rows)
    tokens = sum(1 for r in rows for t in r.times if start < t <= end)
    return tokens / (end - start) if tokens and end > start else 0.0


def _tally(tally: Tally, rows: Sequence[Row], case: BatchCase, loaded: LoadedModel) -> None:
    eos = loaded.eos_token_ids
    for row in rows:
        assert row.ended is not None
        if row.ended.reason is not FinishReason.STOP:
            tally.cut += 1
            continue
        text = loaded.tokenizer.decode(
            [t for t in row.tokens if t not in eos], skip_special_tokens=False
        )
        tally.finished += 1
        tally.valid += case.valid(text)


def bench_batched(
    loaded: LoadedModel, cases: Sequence[BatchCase], budget: int, repeats: int, rows: int
) -> None:
    """Print the table of one model: each case's free and constrained batch decode rate
    (the best of `repeats` alternating runs), their ratio, and the outputs' validity."""
    settings = RunnerSettings(max_batch=rows, prefix_cache_bytes=0)
    free = Engine(
        ModelRunner(replace(loaded, eos_token_ids=frozenset()), settings), max_queue=2 * rows
    )
    held = Engine(ModelRunner(loaded, settings), max_queue=2 * rows)
    print(
        f"\n{rows} concurrent requests through the engine: the batch's decode tok/s, all "
        "rows summed, from every row's first token to the last (best of "
        f"{repeats}); free rows ignore EOS and run as many tokens as the same row did "
        f"constrained; outputs checked over every constrained run (the unmeasured first "
        f"included); target constrained / free >= {TARGET}x\n"
    )
    print(
        "| grammar | rows | tokens/row | free tok/s | constrained tok/s | constrained / free "
        "| constrained outputs valid |"
    )
    print("|---|---:|---:|---:|---:|---:|---|", flush=True)
    free.start()
    held.start()
    try:
        if cases:  # warm up
            _run(free, cases[0].prompts, [8] * rows, None)
        for case in cases:
            tally = Tally()
            # not measured: imports the vocabulary on first use, fixes the rows' lengths
            first = _run(held, case.prompts, [budget] * rows, case.constraint)
            _tally(tally, first, case, loaded)
            lengths = [len(r.tokens) for r in first]
            a = b = 0.0
            for _ in range(repeats):
                a = max(a, steady_rate(_run(free, case.prompts, lengths, None)))
                measured = _run(held, case.prompts, [budget] * rows, case.constraint)
                b = max(b, steady_rate(measured))
                _tally(tally, measured, case, loaded)
            ratio = f"{b / a:.2f}x" if a else "-"
            print(
                f"| {case.name} | {rows} | {statistics.median_low(lengths)} | {a:.1f} | {b:.1f} | {ratio} "
                f"| {tally} |",
                flush=True,
            )
    finally:
        held.stop()
        free.stop()
