"""Request traces in the field's exchange formats, read into :class:`~pagedbench.bench.workloads.Request`.

=========  ===================================================================  =======================
format     columns or keys                                                      arrival time
=========  ===================================================================  =======================
azure      CSV ``TIMESTAMP, ContextTokens, GeneratedTokens`` (Azure LLM          a date-time string,
           inference traces 2023 and 2024)                                      ``2023-11-16 18:15:46.68``
burstgpt   CSV ``Timestamp, Model, Request tokens, Response tokens, Total        seconds
           tokens, Log Type``
mooncake   JSONL ``timestamp, input_length, output_length, hash_ids`` (one id    milliseconds
           per 512-token block of the prompt; equal ids are a shared prefix)
vidur      CSV ``arrived_at, num_prefill_tokens, num_decode_tokens`` (Vidur's    seconds
           processed traces)
jsonl      the project's JSONL (:func:`pagedbench.bench.workloads.load_jsonl`)   seconds (``arrival_s``)
=========  ===================================================================  =======================

:func:`load_trace` reads any of them (``format=None`` sniffs it from the header or the first object).
Arrival times are made relative to the first request (the project's JSONL keeps its own); request ids
are the rows' order. A missing, negative or non-numeric field, timestamps going backwards, an empty file
or an unknown format raise :class:`TraceFormatError`, naming the file, the line and the field. A row
with no prompt or no output tokens (a failed request in BurstGPT, say) cannot exercise a KV manager: it
is skipped and counted.

Requests longer than the model's context (``max_seq_len`` tokens, prompt + output) follow
``over_context``: ``"error"`` (the default) raises, ``"drop"`` leaves them out, ``"clip"`` keeps the
output and cuts the prompt's end so the request fits (a prompt's start, so its shared prefix, is kept;
an output that alone fills the context keeps ``max_seq_len - 1`` tokens after a one-token prompt). Both
are counted in the :class:`LoadedTrace`.

Mooncake's ``hash_ids`` survive as ``Request.block_hash_ids``; :func:`prompt_token_ids` turns them into
token ids (block ``i`` of 512 tokens holds ``2 * hash_ids[i] + 1``), so two prompts with equal leading
ids share those tokens and a prefix cache finds them. Prompts without ids get tokens of their own.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from pagedbench.bench import workloads
from pagedbench.bench.workloads import Request

FORMATS = ("azure", "burstgpt", "mooncake", "vidur", "jsonl")
OVER_CONTEXT = ("error", "drop", "clip")
MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's traces
TRACES_DIR = Path(__file__).resolve().parents[1] / "traces"

#: the traces shipped with the package (bench/traces/README.md gives their source, licence and subset)
SHIPPED = {
    "azure-conv": TRACES_DIR / "azure2023_conv.csv",
    "azure-code": TRACES_DIR / "azure2023_code.csv",
    "mooncake-conv": TRACES_DIR / "mooncake_conversation.jsonl",
    "sharegpt-sample": TRACES_DIR / "sharegpt_sample.jsonl",
}

# CSV formats: (arrival column, prompt column, output column, arrival unit); the header names them
_CSV_COLUMNS = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "burstgpt": ("Timestamp", "Request tokens", "Response tokens"),
    "vidur": ("arrived_at", "num_prefill_tokens", "num_decode_tokens"),
}
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
_DATETIME = re.compile(r"^(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?$")


class TraceFormatError(ValueError):
    """A trace file that cannot be read: the message names the file, the line and the field."""


@dataclass(frozen=True, slots=True)
class LoadedTrace:
    requests: tuple[Request, ...]
    format: str
    path: str
    over_context: str  # the policy applied: error, drop or clip
    max_seq_len: int | None
    num_rows: int  # requests in the file (rows with tokens)
    num_dropped: int  # over the context, left out (drop)
    num_clipped: int  # over the context, prompt cut (clip)
    num_empty: int  # rows with no prompt or no output tokens, skipped


def shipped(name: str) -> Path:
    """The path of a shipped trace by name (see :data:`SHIPPED`)."""
    if name not in SHIPPED:
        raise ValueError(f"unknown shipped trace {name!r}; shipped: {', '.join(SHIPPED)}")
    return SHIPPED[name]


def sniff_format(path: str | Path) -> str:
    """The format of ``path`` from its first line (a CSV header or a JSON object's keys)."""
    path = Path(path)
    first = _first_line(path)
    if first.lstrip().startswith("{"):
        try:
            keys = set(json.loads(first))
        except (json.JSONDecodeError, TypeError):
            raise TraceFormatError(f"{path}:1: not a JSON object") from None
        if "input_length" in keys or "hash_ids" in keys:
            return "mooncake"
        if "prompt_len" in keys:
            return "jsonl"
        raise TraceFormatError(f"{path}:1: unknown format: keys {sorted(keys)}; expected Mooncake's "
                               f"{list(_MOONCAKE_KEYS)} or the project's ['prompt_len', 'output_len', 'arrival_s']")
    header = [h.strip() for h in next(csv.reader([first]))]
    for fmt, cols in _CSV_COLUMNS.items():
        if all(c in header for c in cols):
            return fmt
    raise TraceFormatError(f"{path}:1: unknown format: header {header}; expected one of "
                           + "; ".join(f"{f} {list(c)}" for f, c in _CSV_COLUMNS.items()))


def load_trace(path: str | Path, *, format: str | None = None, max_seq_len: int | None = None,
               over_context: str = "error") -> LoadedTrace:
    """Read a trace in any of :data:`FORMATS` (``None``: sniffed); see the module docstring."""
    path = Path(path)
    if format is not None and format not in FORMATS:
        raise TraceFormatError(f"{path}: unknown format {format!r}; known: {', '.join(FORMATS)}")
    if over_context not in OVER_CONTEXT:
        raise ValueError(f"over_context must be one of {', '.join(OVER_CONTEXT)}, got {over_context!r}")
    if max_seq_len is not None and (type(max_seq_len) is not int or max_seq_len < 2):
        raise ValueError(f"max_seq_len must be an int >= 2 or None, got {max_seq_len!r}")
    if not path.is_file():
        raise TraceFormatError(f"{path}: no such file")
    fmt = format or sniff_format(path)
    num_empty = 0
    if fmt == "jsonl":
        try:
            requests = list(workloads.load_jsonl(path))
        except ValueError as e:
            raise TraceFormatError(str(e)) from None
    else:
        rows = _mooncake_rows(path) if fmt == "mooncake" else _csv_rows(path, fmt)
        requests, num_empty = _requests(path, rows)
    if not requests:
        raise TraceFormatError(f"{path}: empty trace (no request with prompt and output tokens)")
    kept, dropped, clipped = _fit(path, requests, max_seq_len, over_context)
    if not kept:
        raise TraceFormatError(f"{path}: every request exceeds max_seq_len {max_seq_len} (over_context='drop')")
    return LoadedTrace(tuple(kept), fmt, str(path), over_context, max_seq_len, len(requests), dropped, clipped,
                       num_empty)


def prompt_token_ids(r: Request) -> list[int]:
    """Token ids for ``r``'s prompt: its shared blocks' ids expanded (see the module docstring), then
    tokens unique to the request (even ids, never equal to a shared block's odd ones)."""
    tokens: list[int] = []
    for h in r.block_hash_ids:
        tokens += [2 * h + 1] * MOONCAKE_BLOCK_TOKENS
    del tokens[r.prompt_len:]
    tokens += [2 * (r.request_id + 1)] * (r.prompt_len - len(tokens))
    return tokens


# --- reading -------------------------------------------------------------------------------------------
def _first_line(path: Path) -> str:
    with open(path, newline="") as f:
        for line in f:
            if line.strip():
                return line.lstrip("\ufeff").rstrip("\r\n")
    raise TraceFormatError(f"{path}: empty file")


def _number(path: Path, lineno: int, field: str, text) -> float:
    if text is None or (isinstance(text, str) and not text.strip()):
        raise TraceFormatError(f"{path}:{lineno}: missing field {field!r}")
    if isinstance(text, bool):
        raise TraceFormatError(f"{path}:{lineno}: field {field!r} must be a number, got {text!r}")
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise TraceFormatError(f"{path}:{lineno}: field {field!r} must be a number, got {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise TraceFormatError(f"{path}:{lineno}: field {field!r} must be a finite number >= 0, got {text!r}")
    return v


def _count(path: Path, lineno: int, field: str, text) -> int:
    v = _number(path, lineno, field, text)
    if v != int(v):
        raise TraceFormatError(f"{path}:{lineno}: field {field!r} must be a whole number of tokens, got {text!r}")
    return int(v)


def _datetime_s(path: Path, lineno: int, field: str, text) -> float:
    """Seconds since the epoch of an Azure timestamp (any number of fractional digits; UTC unless an
    offset is given)."""
    m = _DATETIME.match(text.strip()) if isinstance(text, str) else None
    if m is None:
        if text is None or not str(text).strip():
            raise TraceFormatError(f"{path}:{lineno}: missing field {field!r}")
        raise TraceFormatError(f"{path}:{lineno}: field {field!r} must be a date-time like "
                               f"'2023-11-16 18:15:46.6805900', got {text!r}")
    day, clock, frac, tz = m.groups()
    try:
        t = datetime.fromisoformat(f"{day} {clock}")
    except ValueError:
        raise TraceFormatError(f"{path}:{lineno}: field {field!r}: no such date-time {text!r}") from None
    offset = timedelta(0)
    if tz and tz != "Z":
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        offset = sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
    t = t.replace(tzinfo=timezone(offset))
    return t.timestamp() + (float("0." + frac) if frac else 0.0)


def _csv_rows(path: Path, fmt: str):
    """(line, arrival s, prompt, output, None) for each data row of a CSV trace."""
    arrival_col, prompt_col, output_col = _CSV_COLUMNS[fmt]
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = None
        for row in reader:
            lineno = reader.line_num
            if not any(c.strip() for c in row):
                continue
            if header is None:
                header = [h.strip().lstrip("\ufeff") for h in row]
                missing = [c for c in (arrival_col, prompt_col, output_col) if c not in header]
                if missing:
                    raise TraceFormatError(f"{path}:{lineno}: the {fmt} header lacks column(s) {missing}; "
                                           f"got {header}")
                idx = [header.index(c) for c in (arrival_col, prompt_col, output_col)]
                continue
            cells = [row[i] if i < len(row) else None for i in idx]
            if fmt == "azure":
                t = _datetime_s(path, lineno, arrival_col, cells[0])
            else:
                t = _number(path, lineno, arrival_col, cells[0])
            yield (lineno, t, _count(path, lineno, prompt_col, cells[1]),
                   _count(path, lineno, output_col, cells[2]), ())


def _mooncake_rows(path: Path):
    for lineno, obj in workloads.json_objects(path, TraceFormatError):
        t_ms = _number(path, lineno, "timestamp", obj.get("timestamp"))
        prompt = _count(path, lineno, "input_length", obj.get("input_length"))
        output = _count(path, lineno, "output_length", obj.get("output_length"))
        ids = obj.get("hash_ids", [])
        if not isinstance(ids, list) or any(type(h) is not int or h < 0 for h in ids):
            raise TraceFormatError(f"{path}:{lineno}: field 'hash_ids' must be a list of ints >= 0")
        if len(ids) > -(-prompt // MOONCAKE_BLOCK_TOKENS):
            raise TraceFormatError(f"{path}:{lineno}: field 'hash_ids' has {len(ids)} ids, more than the "
                                   f"{-(-prompt // MOONCAKE_BLOCK_TOKENS)} blocks of {prompt} prompt tokens")
        yield lineno, t_ms / 1000.0, prompt, output, tuple(ids)


def _requests(path: Path, rows) -> tuple[list[Request], int]:
    out: list[Request] = []
    empty = 0
    first = prev = None
    for lineno, t, prompt, output, ids in rows:
        if prev is not None and t < prev:
            raise TraceFormatError(f"{path}:{lineno}: timestamps must not decrease: {t - first:.6f} s after "
                                   f"{prev - first:.6f} s (relative to the first row)")
        first = t if first is None else first
        prev = t
        if prompt < 1 or output < 1:
            empty += 1
            continue
        out.append(Request(len(out), prompt, output, t - first, ids))
    return out, empty


def _fit(path: Path, requests: list[Request], max_seq_len: int | None, policy: str):
    if max_seq_len is None:
        return requests, 0, 0
    kept: list[Request] = []
    dropped = clipped = 0
    for r in requests:
        if r.total_len <= max_seq_len:
            kept.append(dataclasses.replace(r, request_id=len(kept)))
            continue
        if policy == "error":
            raise TraceFormatError(f"{path}: request {r.request_id} has {r.prompt_len} + {r.output_len} = "
                                   f"{r.total_len} tokens, more than max_seq_len {max_seq_len}; choose "
                                   f"over_context 'drop' or 'clip'")
        if policy == "drop":
            dropped += 1
            continue
        clipped += 1
        output = min(r.output_len, max_seq_len - 1)
        prompt = max_seq_len - output
        ids = r.block_hash_ids[:-(-prompt // MOONCAKE_BLOCK_TOKENS)]
        kept.append(Request(len(kept), prompt, output, r.arrival_s, ids))
    return kept, dropped, clipped
