"""Library notices that ask nothing of the user, filtered by their own message so that every other warning shows."""
from __future__ import annotations

import logging
import re
import warnings

# transformers 5.24 (requirements.txt) renames gradient_checkpointing(_kwargs) to activation_checkpointing(_kwargs)
# in v6. train.sft keeps the old names, which 5.24 still accepts; peft and trl read the model's
# is_gradient_checkpointing alias on every load.
RENAMED_IN_V6 = (
    ("transformers.training_args", r"`gradient_checkpointing(_kwargs)?` is deprecated and will be removed in v6\. "
                                   r"Use `activation_checkpointing(_kwargs)?` instead\."),
    ("transformers.modeling_utils", r"`is_gradient_checkpointing` is deprecated and will be removed in v6\. "
                                    r"Use `is_activation_checkpointing` instead\."),
)
# bitsandbytes on a CPU with AVX512-BF16 tries a Hub kernel for 4-bit matmuls on import and falls back to its own
BITSANDBYTES_LOGGER = "bitsandbytes.backends.cpu.ops"
BITSANDBYTES_NOTICE = re.compile(r"Failed to load CPU gemm_4bit_forward from kernels-community")


def _not_bitsandbytes_notice(record: logging.LogRecord) -> bool:
    return not BITSANDBYTES_NOTICE.match(str(record.msg))


def quiet() -> None:
    """Install the filters (again is harmless); call before transformers or bitsandbytes is imported."""
    for module, message in RENAMED_IN_V6:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning, module=re.escape(module))
    logger = logging.getLogger(BITSANDBYTES_LOGGER)
    if _not_bitsandbytes_notice not in logger.filters:
        logger.addFilter(_not_bitsandbytes_notice)
