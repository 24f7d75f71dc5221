"""Trace loaders: each format read into Requests, sniffed, its bad lines named, over-context policies."""

from __future__ import annotations

import json

import pytest
from pagedbench.bench.workloads import Request
from pagedbench.bench.workloads import trace_formats as tf

AZURE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
         "2023-11-16 18:15:46.6805900,374,44\n"
         "2023-11-16 18:15:50.9951690,396,109\n"
         "2023-11-16 18:16:05.0000000,10,3\n")
BURSTGPT = ("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            "5,ChatGPT,472,18,490,Conversation log\n"
            "45,ChatGPT,1087,0,1087,Conversation log\n"  # a failed request: no response
            "118.5,GPT-4,417,276,693,API log\n")
VIDUR = "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,374,44\n4.314579,396,109\n"


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def _mooncake(tmp_path, rows):
    return _write(tmp_path, "m.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def test_azure_timestamps_become_seconds_from_the_first_request(tmp_path):
    t = tf.load_trace(_write(tmp_path, "a.csv", AZURE))
    assert t.format == "azure"
    assert [(r.request_id, r.prompt_len, r.output_len) for r in t.requests] == [(0, 374, 44), (1, 396, 109),
                                                                             (2, 10, 3)]
    assert [r.arrival_s for r in t.requests] == pytest.approx([0.0, 4.314579, 18.31941], abs=1e-6)


def test_burstgpt_skips_and_counts_rows_without_a_response(tmp_path):
    t = tf.load_trace(_write(tmp_path, "b.csv", BURSTGPT))
    assert t.format == "burstgpt" and t.num_empty == 1 and t.num_rows == 2
    assert t.requests == (Request(0, 472, 18, 0.0), Request(1, 417, 276, 113.5))


def test_vidur_and_the_projects_jsonl(tmp_path):
    assert tf.load_trace(_write(tmp_path, "v.csv", VIDUR)).requests == (Request(0, 374, 44, 0.0),
                                                                         Request(1, 396, 109, 4.314579))
    j = _write(tmp_path, "p.jsonl", '{"prompt_len": 3, "output_len": 2, "arrival_s": 1.5}\n')
    t = tf.load_trace(j)
    assert t.format == "jsonl" and t.requests == (Request(0, 3, 2, 1.5),)


def test_mooncake_hash_ids_become_shared_prompt_prefixes(tmp_path):
    rows = [{"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]},
            {"timestamp": 2500, "input_length": 700, "output_length": 3, "hash_ids": [7, 10]}]
    t = tf.load_trace(_mooncake(tmp_path, rows))
    a, b = t.requests
    assert t.format == "mooncake" and (a.arrival_s, b.arrival_s) == (0.0, 1.5) and a.block_hash_ids == (7, 8, 9)
    ta, tb = tf.prompt_token_ids(a), tf.prompt_token_ids(b)
    assert (len(ta), len(tb)) == (1100, 700)
    shared = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
    assert shared == 512  # exactly the first block, as its id says


def test_prompts_without_ids_share_no_token():
    a, b = tf.prompt_token_ids(Request(0, 4, 1)), tf.prompt_token_ids(Request(1, 4, 1))
    assert not set(a) & set(b)
    assert not set(a) & set(tf.prompt_token_ids(Request(5, 600, 1, block_hash_ids=(0,))))


def test_over_context_error_drop_clip(tmp_path):
    p = _write(tmp_path, "v.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,5\n1,100,50\n2,3,200\n")
    with pytest.raises(tf.TraceFormatError, match=r"request 1 has 100 \+ 50 = 150 tokens, more than max_seq_len 64"):
        tf.load_trace(p, max_seq_len=64)
    dropped = tf.load_trace(p, max_seq_len=64, over_context="drop")
    assert dropped.requests == (Request(0, 10, 5, 0.0),) and (dropped.num_dropped, dropped.num_clipped) == (2, 0)
    clipped = tf.load_trace(p, max_seq_len=64, over_context="clip")
    assert clipped.requests == (Request(0, 10, 5, 0.0), Request(1, 14, 50, 1.0), Request(2, 1, 63, 2.0))
    assert (clipped.num_dropped, clipped.num_clipped) == (0, 2)
    assert tf.load_trace(p).num_clipped == 0  # no context given: nothing is over it


def test_clipping_keeps_the_prompts_leading_block_ids(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 500, "hash_ids": [7, 8, 9]}]
    (r,) = tf.load_trace(_mooncake(tmp_path, rows), max_seq_len=1024, over_context="clip").requests
    assert (r.prompt_len, r.output_len, r.block_hash_ids) == (524, 500, (7, 8))


@pytest.mark.parametrize("text, message", [
    (VIDUR + "9,,3\n", r"v\.csv:4: missing field 'num_prefill_tokens'"),
    (VIDUR + "9,12,-3\n", r"v\.csv:4: field 'num_decode_tokens' must be a finite number >= 0, got '-3'"),
    (VIDUR + "9,abc,3\n", r"v\.csv:4: field 'num_prefill_tokens' must be a number, got 'abc'"),
    (VIDUR + "9,12.5,3\n", r"v\.csv:4: field 'num_prefill_tokens' must be a whole number"),
    (VIDUR + "1.0,12,3\n", r"v\.csv:4: timestamps must not decrease"),
    (VIDUR + "9,12\n", r"v\.csv:4: missing field 'num_decode_tokens'"),
    ("arrived_at,num_prefill_tokens,num_decode_tokens\n", r"v\.csv: empty trace"),
    ("", r"v\.csv: empty file"),
    ("a,b,c\n1,2,3\n", r"v\.csv:1: unknown format: header \['a', 'b', 'c'\]"),
])
def test_bad_csv_lines_name_file_line_and_field(tmp_path, text, message):
    with pytest.raises(tf.TraceFormatError, match=message):
        tf.load_trace(_write(tmp_path, "v.csv", text))


def test_bad_azure_and_mooncake_lines(tmp_path):
    with pytest.raises(tf.TraceFormatError, match=r"a\.csv:3: field 'TIMESTAMP' must be a date-time"):
        tf.load_trace(_write(tmp_path, "a.csv", AZURE.replace("2023-11-16 18:15:50.9951690", "yesterday")))
    good = {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}
    bad = [({**good, "timestamp": "x"}, r"m\.jsonl:2: field 'timestamp' must be a number, got 'x'"),
           ({k: v for k, v in good.items() if k != "output_length"}, r"m\.jsonl:2: missing field 'output_length'"),
           ({**good, "hash_ids": [1, 2]}, r"m\.jsonl:2: field 'hash_ids' has 2 ids, more than the 1 blocks"),
           ({**good, "hash_ids": [-1]}, r"m\.jsonl:2: field 'hash_ids' must be a list of ints >= 0")]
    for row, message in bad:
        with pytest.raises(tf.TraceFormatError, match=message):
            tf.load_trace(_mooncake(tmp_path, [good, row]))
    with pytest.raises(tf.TraceFormatError, match=r"m\.jsonl:2: not a JSON object"):
        tf.load_trace(_write(tmp_path, "m.jsonl", json.dumps(good) + "\n{oops\n"))


def test_format_and_policy_arguments_are_checked(tmp_path):
    p = _write(tmp_path, "v.csv", VIDUR)
    with pytest.raises(tf.TraceFormatError, match=r"v\.csv: unknown format 'splitwise'; known: azure"):
        tf.load_trace(p, format="splitwise")
    with pytest.raises(ValueError, match="over_context must be one of error, drop, clip, got 'trim'"):
        tf.load_trace(p, over_context="trim")
    with pytest.raises(tf.TraceFormatError, match=r"the azure header lacks column\(s\) \['TIMESTAMP'"):
        tf.load_trace(p, format="azure")
    with pytest.raises(tf.TraceFormatError, match="no such file"):
        tf.load_trace(tmp_path / "absent.csv")


def test_shipped_traces_load_and_are_documented():
    readme = (tf.TRACES_DIR / "README.md").read_text()
    for name, path in tf.SHIPPED.items():
        assert f"`{name}`" in readme and path.name in readme
        t = tf.load_trace(path, max_seq_len=4096, over_context="drop")
        assert t.num_rows > 100 and len(t.requests) + t.num_dropped == t.num_rows
    conv = tf.load_trace(tf.shipped("azure-conv"), max_seq_len=4096, over_context="drop")
    assert conv.num_rows == 19_366 and 0.07 < conv.num_dropped / conv.num_rows < 0.1  # 8% exceed 4,096
    mooncake = tf.load_trace(tf.shipped("mooncake-conv"), max_seq_len=131_072)
    assert mooncake.num_rows == 1750 and mooncake.requests[-1].arrival_s < 600
    with pytest.raises(ValueError, match="unknown shipped trace 'azure'"):
        tf.shipped("azure")
