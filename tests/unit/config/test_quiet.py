"""The library notices lora_pipeline.config.quiet filters are exactly the known ones: another warning of the same library shows."""
import logging
import warnings

import pytest

from lora_pipeline.config import quiet

KNOWN = [
    ("transformers.training_args", "`gradient_checkpointing` is deprecated and will be removed in v6. "
                                   "Use `activation_checkpointing` instead."),
    ("transformers.training_args", "`gradient_checkpointing_kwargs` is deprecated and will be removed in v6. "
                                   "Use `activation_checkpointing_kwargs` instead."),
    ("transformers.modeling_utils", "`is_gradient_checkpointing` is deprecated and will be removed in v6. "
                                    "Use `is_activation_checkpointing` instead."),
]
OTHERS = [
    ("transformers.training_args", "`use_liger_kernel` is deprecated and will be removed in v6. Use `kernels` instead."),
    ("transformers.modeling_utils", "`gradient_checkpointing_enable` is deprecated and will be removed in v6."),
    ("peft.peft_model", KNOWN[0][1]),  # the same text from another library
]


def shown(module: str, message: str) -> list[str]:
    """The warnings that reach the user when `module` warns `message`, after quiet()."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.quiet()
        warnings.warn_explicit(message, FutureWarning, f"{module.replace('.', '/')}.py", 1, module=module)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("module, message", KNOWN)
def test_the_known_transformers_notices_are_silenced(module, message):
    assert shown(module, message) == []


@pytest.mark.parametrize("module, message", OTHERS)
def test_other_warnings_still_show(module, message):
    assert shown(module, message) == [message]


def test_training_args_with_gradient_checkpointing_warn_nothing(tmp_path):
    from transformers import TrainingArguments

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.quiet()
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, gradient_checkpointing=True,
                                 gradient_checkpointing_kwargs={"use_reentrant": False}, report_to="none")
    assert args.gradient_checkpointing is True  # the old name still takes effect
    assert [str(w.message) for w in caught if "checkpointing" in str(w.message)] == []


@pytest.fixture
def bitsandbytes_records():
    logger = logging.getLogger(quiet.BITSANDBYTES_LOGGER)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    quiet.quiet()
    yield logger, records
    logger.removeHandler(handler)
    logger.removeFilter(quiet._not_bitsandbytes_notice)


def test_the_bitsandbytes_kernel_notice_is_dropped_and_others_kept(bitsandbytes_records):
    logger, records = bitsandbytes_records
    quiet.quiet()  # twice: one filter
    assert logger.filters.count(quiet._not_bitsandbytes_notice) == 1
    logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already "
                   "`pip install kernels` and the kernels >= 0.11.1", ModuleNotFoundError("No module named 'kernels'"))
    logger.warning("Failed to load CPU-only bitsandbytes library")
    assert [record.getMessage() for record in records] == ["Failed to load CPU-only bitsandbytes library"]


def test_mlflow_progress_notes_are_hidden_and_its_warnings_shown():
    import lora_pipeline.train.tracking  # noqa: F401  (sets the levels on import)

    for name in ("mlflow.store.db.utils", "alembic.runtime.migration", "mlflow.system_metrics.system_metrics_monitor"):
        assert not logging.getLogger(name).isEnabledFor(logging.INFO), name
        assert logging.getLogger(name).isEnabledFor(logging.WARNING), name
    assert logging.getLogger("mlflow.pyfunc").isEnabledFor(logging.INFO)  # other MLflow loggers keep their level
