"""benchmarks/bench_history.py: measurements/*.jsonl rows of differing keys as one readable table per file."""
import importlib.util
import json

import pytest

from conftest import ROOT

pytestmark = pytest.mark.unit

spec = importlib.util.spec_from_file_location("bench_history", ROOT / "benchmarks" / "bench_history.py")
bench_history = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_history)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_rows_of_differing_keys_share_one_table_with_a_dash_where_a_key_is_missing(tmp_path, capsys):
    path = write_rows(tmp_path / "results.jsonl", [
        {"recipe": "qwen2-0.5b", "label": "fast", "gpus": 1, "tokens_per_s": 56690, "seed_tokens_per_s": 10358,
         "ratio": 5.47, "mfu": 0.114, "micro_batch": 32, "grad_accum": 1, "date": "2026-11-30", "commit": "c5baab4"},
        {"recipe": "gpt-oss-20b", "label": "quoted", "tokens_per_s": 10871, "peak_gib": 68.8,
         "source": "docs/performance.md at 5cb0632"},
    ])
    assert bench_history.main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{path}: 2 rows"
    header = lines[1].split()
    # Columns in the table's order; none that no row holds (seconds, status, ...).
    assert header == ["date", "commit", "recipe", "what", "gpus", "batch", "tokens/s", "seed", "tokens/s", "ratio",
                      "MFU", "peak", "GiB", "source"]
    assert set(lines[2]) == {"-", " "}
    assert lines[3].split() == ["2026-11-30", "c5baab4", "qwen2-0.5b", "fast", "1", "32", "x", "1", "56,690",
                                "10,358", "5.47x", "0.114", "-", "-"]
    assert lines[4].split() == ["-", "-", "gpt-oss-20b", "quoted", "-", "-", "10,871", "-", "-", "-", "68.8",
                                "docs/performance.md", "at", "5cb0632"]
    assert len(lines) == 5


def test_columns_line_up_under_their_headers(tmp_path, capsys):
    path = write_rows(tmp_path / "pipeline.jsonl", [
        {"recipe": "default", "stage": "validate", "seconds": 9.7, "date": "2026-12-02T10:00:00+00:00"},
        {"recipe": "qwen2-0.5b", "stage": "evaluate_base", "seconds": 114.3, "status": 0},
    ])
    bench_history.main([str(path)])
    header, rule, *rows = capsys.readouterr().out.splitlines()[1:]
    start = header.index("seconds")
    assert rule[start - 2:start] == "  " and rule[start] == "-"
    assert rows[0][start:].split()[0] == "9.7" and rows[1][start:].split()[0] == "114.3"
    assert rows[0].split()[0] == "2026-12-02", "dates are cut to the day"


def test_recipe_filter_and_extra_keys(tmp_path, capsys):
    path = write_rows(tmp_path / "generation.jsonl", [
        {"recipe": "qwen2-0.5b", "attention": "sdpa", "cache": "dynamic", "batch": 64, "ms_per_step": 70.1,
         "device": "NVIDIA H200"},
        {"recipe": "gpt-oss-20b", "attention": "eager", "batch": 301, "ms_per_step": 102.6},
    ])
    bench_history.main([str(path), "--recipe", "qwen2-0.5b", "--keys", "device"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(": 1 rows")
    assert lines[1].split()[-1] == "device" and lines[3].split()[-2:] == ["NVIDIA", "H200"]
    assert "sdpa dynamic" in lines[3] and "gpt-oss-20b" not in "\n".join(lines)
    assert lines[1].split()[:2] == ["recipe", "card"] and lines[3].split()[:2] == ["qwen2-0.5b", "H200"]


def test_a_generation_row_names_its_card_and_compile_backend_and_an_error_row_its_error(tmp_path, capsys):
    path = write_rows(tmp_path / "generation.jsonl", [
        {"recipe": "qwen2-0.5b", "attention": "sdpa", "cache": "WindowCache (window_cache.py)",
         "decode_step": "cudagraphs", "backend": "cudagraphs_in_place (cuda_graphs.py)",
         "device": "NVIDIA H100 80GB HBM3", "ms_per_step": 21.6},
        {"recipe": "gpt-oss-20b", "decode_step": "cudagraphs", "error": "CUDA out of memory", "device": "NVIDIA H200"},
    ])
    bench_history.main([str(path)])
    header, _, first, second = capsys.readouterr().out.splitlines()[1:]
    assert header.split() == ["recipe", "card", "what", "ms/step", "error"]
    assert first.split()[:6] == ["qwen2-0.5b", "H100", "sdpa", "WindowCache", "cudagraphs", "cudagraphs_in_place"]
    assert second.split() == ["gpt-oss-20b", "H200", "-", "-", "CUDA", "out", "of", "memory"]


def test_long_cells_are_cut_and_nested_values_shown_as_json():
    assert bench_history.cell("x" * 100) == "x" * (bench_history.CELL_WIDTH - 3) + "..."
    assert bench_history.cell({"a": 1}) == '{"a": 1}'
    assert bench_history.cell(None) == "-" and bench_history.cell(False) == "false"
    assert bench_history.cell(1234.5) == "1,234.5" and bench_history.cell(0.2021) == "0.2021"


def test_a_line_that_is_not_a_json_object_names_its_file_and_line(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"recipe": "a"}\n\n[1, 2]\n')
    with pytest.raises(SystemExit, match=r"results.jsonl:3: a JSON list, not an object"):
        bench_history.read_rows(path)
    path.write_text('{"recipe": "a"}\n{"recipe": \n')
    with pytest.raises(SystemExit, match=r"results.jsonl:2: not a JSON line"):
        bench_history.read_rows(path)


def test_every_committed_row_prints_as_one_line(capsys):
    files = sorted((ROOT / "measurements").glob("*.jsonl"))
    assert files
    bench_history.main([str(path) for path in files])
    out = capsys.readouterr().out
    for path in files:
        rows = bench_history.read_rows(path)
        block = out.split(f"{path.relative_to(ROOT)}: {len(rows)} rows\n", 1)[1].split("\n\n", 1)[0].splitlines()
        assert len(block) == 2 + len(rows), path.name
