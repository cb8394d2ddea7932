"""The Hugging Face Hub: downloads that fail with one line naming the id and revision when the Hub cannot be reached."""
from __future__ import annotations

import os
from pathlib import Path

from lora_pipeline.config.errors import chain

# Weights as safetensors only; the original/ and metal/ folders of gpt-oss are other formats.
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


class HubUnreachable(RuntimeError):
    """A model or data set could not be fetched because the Hub is offline or unreachable."""


def offline_mode() -> bool:
    return any(os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE")
               for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def why_unreachable(exc: BaseException) -> str | None:
    """Why the Hub could not be reached (offline mode, connection refused, timeout), or None for another error."""
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    for error in chain(exc):
        # LocalEntryNotFoundError: no connection and no cached copy; datasets raises a builtin ConnectionError
        if isinstance(error, (OfflineModeIsEnabled, LocalEntryNotFoundError, ConnectionError, TimeoutError)) or \
                type(error).__name__ in ("ConnectError", "ConnectTimeout", "ReadTimeout"):
            if offline_mode():
                return "offline mode is on (HF_HUB_OFFLINE=1) and it is not in the local Hugging Face cache"
            detail = str(error.__cause__ or error).splitlines()[0][:200]
            return f"the Hugging Face Hub is unreachable ({detail}) and it is not in the local Hugging Face cache"
    return None


def unreachable_error(key: str, name: str, revision: str, exc: BaseException) -> HubUnreachable | None:
    """The one-line error for a failed download of `name` at `revision` (params key `key`), if the Hub was the cause."""
    why = why_unreachable(exc)
    if why is None:
        return None
    return HubUnreachable(f"{key} '{name}' at revision '{revision}' could not be fetched: {why}; "
                          "unset HF_HUB_OFFLINE or connect to the Hub, then run again")


def download_model(name: str, revision: str, dest: Path) -> None:
    """snapshot_download of the model's config, tokenizer and safetensors weights into dest."""
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(name, revision=revision, local_dir=dest, allow_patterns=MODEL_FILES,
                          ignore_patterns=["original/*", "metal/*"])
    except Exception as exc:
        error = unreachable_error("model.name", name, revision, exc)
        if error is None:
            raise
        raise error from None
