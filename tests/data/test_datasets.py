import json
import re

import grain
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl_async.data import (
    BOXED_INSTRUCTION,
    GSM8K_SAMPLE_PATH,
    DataFormatError,
    DatasetConfig,
    PromptDataset,
    PromptRecord,
    iter_eval_batches,
    load_prompt_dataset,
    make_train_iterator,
    shard_dataset,
)
from jaxrl_async.data.datasets import sniff_format
from jaxrl_async.data.formats import (FormatDetectionError, RowError, detect_format, gsm8k_final_answer,
                                      last_boxed_content, parse_row, row_formats)


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def generic_ds(tmp_path, tok, n=10, **kw):
    path = write_jsonl(tmp_path / "g.jsonl", [{"prompt": f"What is {i}+1?", "answer": i + 1, "id": f"q{i}"} for i in range(n)])
    return load_prompt_dataset(DatasetConfig(path, format="generic", **kw), tok)


# ---------------------------------------------------------------------------------------------- formats
def test_gsm8k_sample_file(arith_tok):
    ds = load_prompt_dataset(DatasetConfig(GSM8K_SAMPLE_PATH, format="gsm8k", prompt_suffix=BOXED_INSTRUCTION), arith_tok)
    assert isinstance(ds, grain.MapDataset) and len(ds) == 40 and ds.stats.kept == 40
    assert len({r.prompt for r in ds.records}) == 40
    for r in ds.records:
        # Every calculator annotation <<expr=v>> is right, and the gold answer is the last computed value.
        calcs = re.findall(r"<<([^=>]+)=([^>]+)>>", r.metadata["solution"])
        assert calcs and all(eval(e.replace("/", "//")) == int(v) for e, v in calcs)
        assert r.answer == calcs[-1][1]
        assert r.metadata["raw_prompt"].endswith(BOXED_INSTRUCTION)
        assert r.prompt.startswith("<|im_start|>user\n") and r.prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert r.prompt_ids == arith_tok.encode(r.prompt, add_special_tokens=False)
    assert ds.records[9].answer == "1170"  # written as "#### 1,170"


def test_gsm8k_final_answer():
    assert gsm8k_final_answer("a <<2*3=6>>6\n#### 1,072") == "1072"
    assert gsm8k_final_answer("x #### -5") == "-5"
    with pytest.raises(RowError, match="####"):
        gsm8k_final_answer("no marker 12")
    with pytest.raises(RowError, match="not a number"):
        gsm8k_final_answer("#### twelve")


def test_math_format():
    p = parse_row({"prompt": "Find x.", "answer": 3}, "math")
    assert (p.prompt, p.answer, p.id) == ("Find x.", "3", None)
    boba = {"prompt": "Half?", "solutions": ["so \\boxed{1} no, \\boxed{\\frac{1}{2}}", "\\boxed{0.5}"], "query_id": "b7"}
    p = parse_row(boba, "math")
    assert (p.answer, p.id) == ("\\frac{1}{2}", "b7")
    assert p.metadata["solutions"] == boba["solutions"] and "query_id" not in p.metadata
    assert parse_row({"prompt": "q", "solutions": ["42"]}, "math").answer == "42"
    with pytest.raises(RowError, match="'answer' or 'solutions'"):
        parse_row({"prompt": "q"}, "math")
    with pytest.raises(RowError, match="solutions"):
        parse_row({"prompt": "q", "solutions": "42"}, "math")


def test_generic_format_and_field_mapping():
    p = parse_row({"problem": "2+2?", "sol": 4, "level": 1}, "generic", {"prompt": "problem", "answer": "sol"})
    assert (p.prompt, p.answer, p.metadata) == ("2+2?", "4", {"level": 1})
    with pytest.raises(RowError, match=r"missing field 'answer' \(file column 'sol'\)"):
        parse_row({"problem": "2+2?"}, "generic", {"prompt": "problem", "answer": "sol"})
    with pytest.raises(RowError, match="'prompt' must be a string"):
        parse_row({"prompt": 5, "answer": "1"}, "generic")
    with pytest.raises(RowError, match="string or number"):
        parse_row({"prompt": "p", "answer": True}, "generic")


def test_code_format():
    stdio = parse_row({"prompt": "echo", "tests": {"inputs": ["1\n", "2\n"], "outputs": ["1\n", "2\n"]}}, "code")
    assert stdio.answer == {"kind": "stdio", "inputs": ["1\n", "2\n"], "outputs": ["1\n", "2\n"]}
    call = parse_row({"prompt": "add", "tests": json.dumps({"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]})}, "code")
    assert call.answer == {"kind": "call", "fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}
    with pytest.raises(RowError, match="equal length"):
        parse_row({"prompt": "p", "tests": {"inputs": ["1"], "outputs": []}}, "code")
    with pytest.raises(RowError, match="string 'inputs'"):
        parse_row({"prompt": "p", "tests": {"inputs": [1], "outputs": ["1"]}}, "code")
    with pytest.raises(RowError, match="not valid JSON"):
        parse_row({"prompt": "p", "tests": "{oops"}, "code")


def test_last_boxed_content():
    assert last_boxed_content("\\boxed{a{b}c} and \\boxed{d}") == "d"
    assert last_boxed_content("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed_content("none") is None


# ---------------------------------------------------------------------------------------------- bad rows
BAD_ROWS = [
    {"prompt": "ok 1", "answer": "1"},
    "",  # blank line: ignored, but still counts in line numbering
    {"prompt": "no answer"},
    "{not json",
    {"prompt": ["wrong", "type"], "answer": "1"},
    "[1, 2]",
    {"prompt": "ok 2", "answer": 2},
]


@pytest.mark.parametrize("line,match", [
    (3, "missing field 'answer'"),
    (4, "invalid JSON"),
    (5, "'prompt' must be a string"),
    (6, "JSON object"),
])
def test_bad_rows_raise_with_file_and_line(tmp_path, arith_tok, line, match):
    # Rows before the one under test are replaced by valid rows so each case hits its own first error.
    rows = [{"prompt": "ok", "answer": "0"} if 3 <= i + 1 < line else r for i, r in enumerate(BAD_ROWS)]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataFormatError, match=match) as e:
        load_prompt_dataset(DatasetConfig(path, format="generic"), arith_tok)
    assert (e.value.path, e.value.line) == (path, line)
    assert str(e.value).startswith(f"{path}: row {line}: ")  # the 1-based line number


def test_bad_rows_skipped_and_counted(tmp_path, arith_tok):
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_ROWS)
    ds = load_prompt_dataset(DatasetConfig(path, format="generic", skip_bad_rows=True), arith_tok)
    assert [r.answer for r in ds.records] == ["1", "2"]
    assert [r.id for r in ds.records] == ["bad.jsonl:1", "bad.jsonl:7"]
    s = ds.stats
    assert (s.rows_read, s.kept, s.bad_rows, s.too_long) == (6, 2, 4, 0)
    assert [ex.split(": ")[:2] for ex in s.bad_row_examples] == [[path, f"row {i}"] for i in (3, 4, 5, 6)]
    assert ds.stats.as_dict()["data/bad_rows"] == 4


# ---------------------------------------------------------------------------------------------- length filter
def test_max_prompt_len_filter(tmp_path, arith_tok):
    # Raw mode, arithmetic tokenizer: one token per digit, no BOS => len(prompt_ids) = number of digits.
    path = write_jsonl(tmp_path / "len.jsonl", [{"prompt": "7" * k, "answer": "0"} for k in (1, 2, 3, 4, 2)])
    ds = load_prompt_dataset(DatasetConfig(path, apply_chat_template=False, max_prompt_len=2), arith_tok)
    assert [r.prompt for r in ds.records] == ["7", "77", "77"]
    assert [len(r.prompt_ids) for r in ds.records] == [1, 2, 2]
    assert (ds.stats.too_long, ds.stats.kept, ds.stats.max_prompt_tokens) == (2, 3, 4)
    # Templated: chat scaffold "<|im_start|>user\n" + ... + "<|im_end|>\n<|im_start|>assistant\n" costs a fixed
    # number of tokens c; the limit applies to the templated length.
    templated = load_prompt_dataset(DatasetConfig(path), arith_tok)
    c = len(templated[0].prompt_ids) - 1
    assert [len(r.prompt_ids) - c for r in templated.records] == [1, 2, 3, 4, 2]
    cut = load_prompt_dataset(DatasetConfig(path, max_prompt_len=c + 3), arith_tok)
    assert (cut.stats.kept, cut.stats.too_long) == (4, 1)


def test_raw_prompt_and_system_prompt(tmp_path, arith_tok):
    raw = generic_ds(tmp_path, arith_tok, n=2, apply_chat_template=False)
    assert raw[1].prompt == "What is 1+1?" and raw[1].answer == "2" and raw[1].id == "q1"
    sys = generic_ds(tmp_path, arith_tok, n=1, system_prompt="Be brief.")
    assert sys[0].prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 0+1?")


# ---------------------------------------------------------------------------------------------- shuffling / state
def take_ids(it, n):
    return [r.id for r in it.next_batch(n)]


def test_shuffle_per_epoch_and_seed(tmp_path, arith_tok):
    ds = generic_ds(tmp_path, arith_tok, n=12)
    ids = sorted(r.id for r in ds.records)
    it = make_train_iterator(ds, seed=3)
    e0, e1, e2 = take_ids(it, 12), take_ids(it, 12), take_ids(it, 12)
    assert sorted(e0) == sorted(e1) == sorted(e2) == ids  # each epoch is a permutation
    assert e0 != e1 and e1 != e2 and e0 != [r.id for r in ds.records]
    assert it.epoch == 3
    assert take_ids(make_train_iterator(ds, seed=3), 36) == e0 + e1 + e2
    assert take_ids(make_train_iterator(ds, seed=4), 12) != e0
    assert take_ids(make_train_iterator(ds, seed=3, shuffle=False), 13) == [r.id for r in ds.records] + ["q0"]


def test_bounded_epochs(tmp_path, arith_tok):
    ds = generic_ds(tmp_path, arith_tok, n=5)
    out = [r.id for r in make_train_iterator(ds, seed=0, num_epochs=2)]
    assert len(out) == 10 and all(out.count(f"q{i}") == 2 for i in range(5))


@pytest.mark.parametrize("consumed", [0, 7, 12, 30])
def test_iterator_state_resumes_exactly(tmp_path, arith_tok, consumed):
    ds = generic_ds(tmp_path, arith_tok, n=12)
    it = make_train_iterator(ds, seed=11, process_index=1, process_count=2)
    take_ids(it, consumed)
    state = json.loads(json.dumps(it.get_state()))  # checkpoints store it as JSON
    assert state["next_index"] == consumed
    expected = take_ids(it, 25)
    fresh = make_train_iterator(ds, seed=11, process_index=1, process_count=2)
    fresh.set_state(state)
    assert take_ids(fresh, 25) == expected
    with pytest.raises(ValueError, match="saved for"):
        make_train_iterator(ds, seed=12, process_index=1, process_count=2).set_state(state)


# ---------------------------------------------------------------------------------------------- sharding / eval
@pytest.mark.parametrize("n,count", [(10, 3), (12, 4), (5, 1)])
def test_sharding_disjoint_and_complete(tmp_path, arith_tok, n, count):
    ds = generic_ds(tmp_path, arith_tok, n=n)
    shards = [[r.id for r in shard_dataset(ds, p, count)] for p in range(count)]
    flat = [i for s in shards for i in s]
    assert sorted(flat) == sorted(r.id for r in ds.records) and len(set(flat)) == n
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    for p in range(count):  # a training epoch of process p is a permutation of its shard
        it = make_train_iterator(ds, seed=5, process_index=p, process_count=count)
        assert sorted(take_ids(it, len(shards[p]))) == sorted(shards[p])
    with pytest.raises(ValueError):
        shard_dataset(ds, count, count)


def test_eval_batches_in_order_once(tmp_path, arith_tok):
    ds = generic_ds(tmp_path, arith_tok, n=10)
    batches = list(iter_eval_batches(ds, 4))
    assert [len(b) for b in batches] == [4, 4, 2]
    assert [r.id for b in batches for r in b] == [f"q{i}" for i in range(10)]
    p1 = [r.id for b in iter_eval_batches(ds, 2, process_index=1, process_count=3) for r in b]
    assert p1 == ["q1", "q4", "q7"]


# ---------------------------------------------------------------------------------------------- parquet / multi-file
def test_parquet_reader_with_field_mapping(tmp_path, arith_tok):
    path = str(tmp_path / "gsm.parquet")
    table = pa.table({"problem": ["What is 2+3?", "What is 10-4?"], "sol": ["2+3=<<2+3=5>>5\n#### 5", "#### 6"],
                      "uid": [101, 102]})
    pq.write_table(table, path)
    cfg = DatasetConfig(path, format="gsm8k", fields={"question": "problem", "answer": "sol", "id": "uid"})
    ds = load_prompt_dataset(cfg, arith_tok)
    assert [(r.id, r.answer, r.metadata["raw_prompt"]) for r in ds.records] == [("101", "5", "What is 2+3?"),
                                                                               ("102", "6", "What is 10-4?")]
    math_path = str(tmp_path / "boba.parquet")
    pq.write_table(pa.table({"prompt": ["a", "b", None],
                             "solutions": [["\\boxed{1}"], ["\\boxed{2}"], ["\\boxed{3}"]]}), math_path)
    with pytest.raises(DataFormatError, match="missing field 'prompt'") as e:
        load_prompt_dataset(DatasetConfig(math_path, format="math"), arith_tok)
    assert (e.value.path, e.value.line) == (math_path, 3)
    ok = load_prompt_dataset(DatasetConfig(math_path, format="math", skip_bad_rows=True), arith_tok)
    assert [r.answer for r in ok.records] == ["1", "2"] and ok.stats.bad_rows == 1


def test_multiple_files_and_max_rows(tmp_path, arith_tok):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a", "answer": "1"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "b", "answer": "2"}, {"prompt": "c", "answer": "3"}])
    ds = load_prompt_dataset(DatasetConfig([a, b], apply_chat_template=False), arith_tok)
    assert [r.id for r in ds.records] == ["a.jsonl:1", "b.jsonl:1", "b.jsonl:2"]
    assert len(load_prompt_dataset(DatasetConfig([a, b], max_rows=2), arith_tok)) == 2
    with pytest.raises(FileNotFoundError):
        load_prompt_dataset(DatasetConfig(str(tmp_path / "missing.jsonl")), arith_tok)
    with pytest.raises(ValueError, match="format"):
        DatasetConfig(a, format="csv")


def test_prompt_dataset_is_grain_map_dataset():
    recs = [PromptRecord(id=str(i), prompt="p", prompt_ids=[i], answer="a", metadata={}) for i in range(4)]
    ds = PromptDataset(recs)
    assert isinstance(ds, grain.MapDataset)
    assert [r.id for r in ds.map(lambda r: r).slice(slice(1, 3))] == ["1", "2"]


# -- format detection (evaluate --format auto) ---------------------------------------------------------
GSM = {"question": "q", "answer": "3 + 4 = 7\n#### 7"}


@pytest.mark.parametrize("row, formats", [
    (GSM, {"gsm8k"}),
    ({"question": "q", "answer": "7"}, set()),  # no '####': not told as gsm8k
    ({"prompt": "p", "solutions": ["\\boxed{1}"]}, {"math"}),
    ({"prompt": "p", "answer": "1", "solutions": ["x"], "query_id": "a"}, {"math"}),
    ({"prompt": "p", "answer": 1}, {"generic"}),
    ({"prompt": "p", "tests": {"inputs": ["1"], "outputs": ["1"]}}, {"code"}),
    ({"prompt": "p", "tests": "{}", "answer": "1"}, {"code", "generic"}),
    ({"prompt": "p", "answer": None}, set()),
    ([1, 2], set()),
])
def test_row_formats(row, formats):
    assert row_formats(row) == formats


def test_detect_format_chooses_explains_and_refuses_ambiguity():
    rows = [(f"f: row {i}", r) for i, r in enumerate([GSM, {"question": "bad"}, GSM], start=1)]
    assert detect_format(rows) == ("gsm8k", "detected from the columns of 2 of the first 3 rows")
    with pytest.raises(FormatDetectionError, match=r"f: row 1: the columns \['answer', 'prompt', 'tests'\] fit the "
                                                   r"formats \['code', 'generic'\]; pass --format"):
        detect_format([("f: row 1", {"prompt": "p", "tests": "{}", "answer": "1"})])
    with pytest.raises(FormatDetectionError, match="f: row 1 looks like generic but f: row 2 looks like gsm8k"):
        detect_format([("f: row 1", {"prompt": "p", "answer": "1"}), ("f: row 2", GSM)])
    with pytest.raises(FormatDetectionError, match=r"f: row 1: cannot tell the format from the columns \['text'\]"):
        detect_format([("f: row 1", {"text": "t"})])


def test_sniff_format_reads_the_first_rows_of_the_file(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", ["", "{not json", GSM, GSM])
    assert sniff_format(path) == ("gsm8k", "detected from the columns of 2 of the first 2 rows")
    pq.write_table(pa.Table.from_pylist([{"prompt": "p", "answer": "1"}] * 3), tmp_path / "m.parquet")
    assert sniff_format(str(tmp_path / "m.parquet"))[0] == "generic"
    assert sniff_format(GSM8K_SAMPLE_PATH)[0] == "gsm8k"
