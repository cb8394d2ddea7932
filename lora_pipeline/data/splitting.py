"""The seeded train/test split: its one rule (split_problem, which validate applies too), the cut, and the removal
of train rows that ask what a test row asks."""
from __future__ import annotations

from lora_pipeline.data.rows import DataError, messages_key, row_key


def split_rows(rows: list[dict], test_size: float, seed: int) -> tuple[list[dict], list[dict]]:
    """Shuffle with `seed`, then cut off the test part: a fraction if test_size < 1, else a row count."""
    import random

    if problem := split_problem(len(rows), test_size):
        raise ValueError(problem)
    n_test = held_out(len(rows), test_size)
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    test_idx = set(order[:n_test])
    train = [rows[i] for i in order if i not in test_idx]
    test = [rows[i] for i in order[:n_test]]
    return train, test


def prompt_key(row: dict) -> str:
    """What a model is asked in a row: every message before its last assistant turn, as canonical JSON, whatever
    weight (trained or not) an earlier answer has (a text row: its text)."""
    if "messages" not in row:
        return row_key(row)
    messages = row["messages"]
    last_assistant = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages_key([{k: v for k, v in m.items() if k != "weight"} for m in messages[:last_assistant]])


def remove_test_prompts(train: list[dict], test: list[dict]) -> tuple[list[dict], int]:
    """Train rows that ask what a test row asks leak the test answer: (train without them, how many went)."""
    test_prompts = {prompt_key(row) for row in test}
    kept = [row for row in train if prompt_key(row) not in test_prompts]
    if not kept:
        raise DataError(f"every one of {len(train)} train rows asks what a test row asks; a smaller "
                        "split.test_size leaves more rows to train, or the data needs more distinct questions")
    return kept, len(train) - len(kept)


# A held-out figure (loss, compliance) from one row is a single sample, not an average: two rows is the least.
MIN_TEST_ROWS = 2


def held_out(rows: int, test_size: float) -> int:
    return round(rows * test_size) if test_size < 1 else int(test_size)


def rows_needed(test_size: float) -> int | None:
    """The fewest rows that split_problem accepts at this test_size; None where no row count is enough."""
    if test_size >= 1:
        return int(test_size) + 1 if int(test_size) >= MIN_TEST_ROWS else None
    # round(rows * test_size) reaches MIN_TEST_ROWS, and leaves one row to train, from about these on; both only grow
    estimate = max((MIN_TEST_ROWS - 0.5) / test_size, 0.5 / (1 - test_size))
    if estimate > 1e15:
        return None
    for rows in range(max(MIN_TEST_ROWS + 1, int(estimate) - 2), int(estimate) + 10):
        if not split_problem(rows, test_size):
            return rows
    return None


def too_few_rows(rows: int, test_size: float) -> str | None:
    """Where no split.test_size can split `rows` rows, how many the split needs (and at this test_size); else None."""
    least = MIN_TEST_ROWS + 1
    if rows >= least:
        return None
    needed = rows_needed(test_size)
    at = f"; {needed} at split.test_size {test_size:g}" if needed and needed > least else ""
    return f"the split needs at least {least} rows ({MIN_TEST_ROWS} test rows and one to train{at})"


def split_problem(rows: int, test_size: float, of: str = "") -> str | None:
    """The split's one rule, which validate applies to the most rows fetch can yield (`of` says what bounds them)
    and split to the rows fetched: at least MIN_TEST_ROWS test rows and one to train. None where it holds."""
    n_test = held_out(rows, test_size)
    if MIN_TEST_ROWS <= n_test < rows:
        return None
    return (f"split.test_size: {test_size:g} leaves {n_test} test and {max(rows - n_test, 0)} train rows of "
            f"{of or rows}; allowed: a fraction below 1 "
            f"or a whole row count that leaves at least {MIN_TEST_ROWS} test rows and one to train")
