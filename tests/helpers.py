"""What several tests build on that the pipeline itself never calls."""
from lora_pipeline.builtin_data import LANGUAGES
from lora_pipeline.data import load_data
from lora_pipeline.mxfp4_checkpoint import save_mxfp4_checkpoint
from lora_pipeline.tiny_models import random_gpt_oss

LANGUAGE_CODES = {name: code for code, name in LANGUAGES.items()}


def language_code(name_or_code: str) -> str:
    """Return the ISO code for a language given as code ("de") or English name ("German", "german")."""
    if isinstance(name_or_code, str):
        key = name_or_code.strip()
        if key.lower() in LANGUAGES:
            return key.lower()
        for name, code in LANGUAGE_CODES.items():
            if name.lower() == key.lower():
                return code
    valid = ", ".join(f"{code} ({name})" for code, name in LANGUAGES.items())
    raise ValueError(f"unknown language {name_or_code!r}; valid: {valid}")


def load_rows(data_params) -> tuple[list[dict], dict]:
    """The usable rows of the configured source, and what reading them found (rows in, kept, dropped per reason)."""
    rows, counts, _ = load_data(data_params)
    return rows, counts


def build_tiny_gpt_oss(out_dir, **sizes) -> None:
    """Write a randomly initialised tiny gpt-oss (see random_gpt_oss) to out_dir as an MXFP4 checkpoint."""
    save_mxfp4_checkpoint(random_gpt_oss(**sizes), out_dir)
