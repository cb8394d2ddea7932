"""Print measurements/*.jsonl as tables: one per file, the columns its rows hold, a dash where a row lacks one."""
import argparse
import json
import re
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CELL_WIDTH = 48


def _what(row: dict) -> str | None:
    """What a row measured: the benchmark's label, the pipeline's stage, or a generation run's settings."""
    if row.get("label") or row.get("stage"):
        return row.get("label") or row.get("stage")
    if "attention" in row:
        cache = re.sub(r" \(\S+\.py\)$", "", row.get("cache") or "")  # "WindowCache (window_cache.py)": its file
        backend = (row.get("backend") or "").split(" (")[0]  # the compile backend's name, without its note
        parts = [row["attention"], cache, row.get("decode_step"), backend]
        return " ".join(str(part) for part in parts if part)
    return None


def _card(row: dict) -> str | None:
    """The accelerator a row ran on, short: "NVIDIA H100 80GB HBM3" -> "H100"."""
    device = row.get("device")
    if not device:
        return None
    words = [word for word in str(device).split() if word != "NVIDIA"]
    return words[0] if words else device


# (header, key or function of the row); a column shows only where some row of the table has a value.
COLUMNS = [
    ("date", lambda row: None if row.get("date") is None else str(row["date"])[:10]),
    ("commit", "commit"),
    ("call", "call"),
    ("recipe", "recipe"),
    ("card", _card),
    ("what", _what),
    ("ran", "ran"),
    ("gpus", "gpus"),
    ("global batch", "global_batch"),
    ("batch", lambda row: row.get("batch") if row.get("micro_batch") is None
     else f"{row['micro_batch']} x {row.get('grad_accum', 1)}"),
    ("tokens/s", "tokens_per_s"),
    ("seed tokens/s", "seed_tokens_per_s"),
    ("ratio", lambda row: None if row.get("ratio") is None else f"{row['ratio']}x"),
    ("MFU", "mfu"),
    ("peak GiB", "peak_gib"),
    ("seconds", "seconds"),
    ("ms/step", "ms_per_step"),
    ("new tokens/s", "new_tokens_per_s"),
    ("first step s", "first_step_s"),
    ("status", "status"),
    ("source", "source"),
    ("error", "error"),
]


def read_rows(path: Path) -> list[dict]:
    """The JSON objects of a JSON Lines file; a line that is not one stops with its file and line number."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise SystemExit(f"{path}:{number}: not a JSON line ({error.msg}); fix or remove that line") from None
        if not isinstance(row, dict):
            raise SystemExit(f"{path}:{number}: a JSON {type(row).__name__}, not an object; fix or remove that line")
        rows.append(row)
    return rows


def cell(value) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        text = f"{value:,.1f}".removesuffix(".0") if abs(value) >= 1000 else f"{value:.4g}"
    elif isinstance(value, int):
        text = f"{value:,}"
    else:
        text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= CELL_WIDTH else text[: CELL_WIDTH - 3] + "..."


def table(rows: list[dict], extra: tuple[str, ...] = ()) -> list[str]:
    """The rows as aligned text lines: a header, a rule, one line per row, in the file's order."""
    columns = [(header, (lambda row, key=key: row.get(key)) if isinstance(key, str) else key)
               for header, key in COLUMNS + [(key, key) for key in extra]]
    cells = {header: [cell(value(row)) for row in rows] for header, value in columns}
    shown = [header for header, _ in columns if any(text != "-" for text in cells[header])]
    widths = {header: max(len(header), *(len(text) for text in cells[header])) for header in shown}
    lines = ["  ".join(header.ljust(widths[header]) for header in shown).rstrip(),
             "  ".join("-" * widths[header] for header in shown)]
    lines += ["  ".join(cells[header][i].ljust(widths[header]) for header in shown).rstrip()
              for i in range(len(rows))]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("files", nargs="*", type=Path, help="JSON Lines files (default: measurements/*.jsonl)")
    parser.add_argument("--recipe", help="only the rows of this recipe")
    parser.add_argument("--keys", default="", help="more columns: row keys, comma-separated")
    args = parser.parse_args(argv)
    order = {"results.jsonl": 0, "pipeline.jsonl": 1}  # the training benchmark, then the pipeline, then the others
    files = args.files or sorted((ROOT / "measurements").glob("*.jsonl"), key=lambda f: (order.get(f.name, 2), f))
    extra = tuple(key for key in args.keys.split(",") if key)
    for index, path in enumerate(files):
        rows = [row for row in read_rows(path) if args.recipe in (None, row.get("recipe"))]
        name = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
        print(("\n" if index else "") + f"{name}: {len(rows)} rows")
        if rows:
            print("\n".join(table(rows, extra)))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the output quietly
    sys.exit(main())
