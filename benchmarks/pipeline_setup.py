"""A recipe's pipeline made runnable offline: a scratch copy, stand-ins for the Hub's model and data, params."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from lora_pipeline.config.params import ParamsError, validate
from lora_pipeline.data import builtin as builtin_data

ROOT = Path(__file__).resolve().parents[1]

RECIPES = ("default", "qwen2-0.5b", "gpt-oss-20b")
# What the copy leaves out where the source has no git to list its files: environments, stores, DVC outputs.
COPY_IGNORE = {".venv", ".git", "__pycache__", ".pytest_cache", "mlflow.db", "mlartifacts", "mlruns", "models",
               "metrics", "plots", "reports", "checkpoints", "logs", ".whl", "dvc_plots", "measurements"}

# What the stages write that git also tracks (dvc.lock, metrics, plots, reports): a copy made again over an
# earlier run keeps that run's, so DVC sees its stages done and register reads their own figures.
RUN_STATE = ("dvc.lock", "metrics", "plots", "reports")
# Per recipe: the chat template family (lora_pipeline.model.tiny.FAMILIES), the data's shape, its rows.
STAND_INS = {
    "qwen2-0.5b": dict(family="tiny-qwen2", rows=4000, data="capybara"),
    "gpt-oss-20b": dict(family="tiny-gpt-oss", rows=1000, data="multilingual-thinking"),
}
# Reduced sizes of the same architectures, for tests only (--tiny).
TINY = {
    "qwen2-0.5b": dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2),
    "gpt-oss-20b": dict(vocab_size=4096, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                        num_experts_per_tok=2),
}
MT_COLUMNS = ("reasoning_language", "developer", "user", "analysis", "final", "messages")


class SetupError(RuntimeError):
    """A stand-in or the params cannot be built; the message names the file or key and the way on."""


def copy_repo(source: Path, dest: Path, exclude: Path | None = None) -> None:
    """The project's files into dest (outputs already there are kept, RUN_STATE too): the working tree's tracked
    and untracked, not ignored files (`git ls-files`), or, without git, all but COPY_IGNORE, DVC's cache and outputs.
    Nothing under `exclude` (default: dest) is copied, nor an earlier run's stand-in data."""
    dest.mkdir(parents=True, exist_ok=True)
    git = shutil.which("git") and (source / ".git").exists()

    def wanted(path: Path) -> bool:
        return not (path.is_relative_to(exclude or dest)
                    or path.parent == source / "data" and path.name != "local" and path.is_dir()
                    or path.parent == source / "data" / "local" and path.name.startswith("pipeline-")
                    or path.parent == source / ".dvc" and path.name in ("cache", "tmp", "config.local"))

    if git:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=source,
                                check=True, capture_output=True).stdout.decode().split("\0")
        files = [source / name for name in listed if name]
    else:
        files = []
        for folder, dirs, names in os.walk(source):
            dirs[:] = [d for d in dirs if d not in COPY_IGNORE and wanted(Path(folder) / d)]
            files += [Path(folder) / name for name in names if name not in COPY_IGNORE]
    for path in files:
        if path.is_file() and all(wanted(p) for p in (path, *path.parents) if p.is_relative_to(source)):
            target = dest / path.relative_to(source)
            if target.exists() and path.relative_to(source).parts[0] in RUN_STATE:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def qwen2_0_5b_config(**overrides):
    """Qwen/Qwen2-0.5B's config.json as a Qwen2Config (the same figures as train_throughput's checkpoint)."""
    from transformers import Qwen2Config

    fields = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=131072, rope_theta=1e6,
                  tie_word_embeddings=True, rms_norm_eps=1e-6)
    fields.update(overrides)
    return Qwen2Config(**fields)


def gpt_oss_20b_config(num_hidden_layers: int = 24, **overrides):
    """openai/gpt-oss-20b's config.json as a GptOssConfig (full width; fewer layers or experts for cheap checks)."""
    from transformers import GptOssConfig

    fields = dict(num_hidden_layers=num_hidden_layers, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
                  hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
                  sliding_window=128, use_cache=False, tie_word_embeddings=False)
    fields.update(overrides)
    n = fields["num_hidden_layers"]
    fields["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    return GptOssConfig(**fields)


def build_tokenizer(texts: list[str], vocab_size: int, family: str, out: Path):
    """A byte-level BPE trained on `texts` with the family's chat template (tiny_models.train_tokenizer), its
    vocabulary filled up to `vocab_size` with `<|reserved_N|>` entries that no text encodes to: the built-in rows
    hold far fewer merges than a real vocabulary, and the model's embedding and LM head must have the real size."""
    from transformers import AutoTokenizer

    from lora_pipeline.model.tiny import train_tokenizer

    trained = len(train_tokenizer(texts, vocab_size, family, out))
    if trained > vocab_size:
        raise SetupError(f"the tokenizer has {trained} entries, more than the model's vocab_size {vocab_size}")
    path = out / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    start = max(vocab.values()) + 1
    vocab.update({f"<|reserved_{i}|>": i for i in range(start, vocab_size)})
    path.write_text(json.dumps(data, ensure_ascii=False))
    tokenizer = AutoTokenizer.from_pretrained(out)
    if len(tokenizer) != vocab_size:
        raise SetupError(f"{path}: the tokenizer has {len(tokenizer)} entries, not the model's {vocab_size}")
    return tokenizer, trained


def random_bf16_model(config, device: str):
    """A model of `config`, random init, made in bf16 directly on `device` (gpt-oss-20b made in float32 first would
    be 84 GB)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(torch.float32)


def build_model(recipe: str, out: Path, texts: list[str], tiny: bool = False) -> dict:
    """The recipe's architecture at full size (reduced with `tiny`), random init, saved as the real checkpoint is:
    Qwen2-0.5B in bf16 safetensors; gpt-oss-20b bf16 with its experts in MXFP4 and a quantization_config. Built on
    the GPU where there is one. Returns what was built."""
    import torch
    from transformers import GenerationConfig

    from lora_pipeline.model.tiny import FAMILIES

    family = STAND_INS[recipe]["family"]
    sizes = TINY[recipe] if tiny else {}
    config = (qwen2_0_5b_config if recipe == "qwen2-0.5b" else gpt_oss_20b_config)(**sizes)
    config.use_cache = True  # as the real config.json (gpt_oss_20b_config is for training benchmarks)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, trained = build_tokenizer(texts, config.vocab_size, family, out)
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = None
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_bf16_model(config, device)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in FAMILIES[family]["eos"]]
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id)
    if config.model_type == "gpt_oss":
        from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import save_mxfp4_checkpoint

        save_mxfp4_checkpoint(model, out)
    else:
        model.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"model_type": config.model_type, "parameters": params, "vocab_size": config.vocab_size,
            "bpe_entries": trained, "layers": config.num_hidden_layers, "built_on": device}


def capybara_rows(rows: int, seed: int) -> list[dict]:
    """Capybara-like rows from the built-in problems: a `source` and 1-3 user/assistant turns, no system prompt and
    no separate reasoning (the answer explains itself)."""
    problems = builtin_data.generate(rows * 2, seed)
    out, i = [], 0
    for n in range(rows):
        messages = []
        for _ in range(1 + n % 3):
            p = problems[i % len(problems)]
            i += 1
            messages += [{"role": "user", "content": p["user"]},
                         {"role": "assistant", "content": f"{p['analysis']}\n\n{p['final']}"}]
        out.append({"source": "builtin", "messages": messages})
    return out


def multilingual_thinking_rows(rows: int, seed: int) -> list[dict]:
    """Rows with HuggingFaceH4/Multilingual-Thinking's columns, from the built-in problems."""
    return [{column: row[column] for column in MT_COLUMNS} for row in builtin_data.generate(rows, seed)]


def build_data(recipe: str, path: Path, rows: int | None = None, seed: int = 0) -> list[dict]:
    """The recipe's stand-in data as a jsonl file; returns its rows."""
    spec = STAND_INS[recipe]
    made = (capybara_rows if spec["data"] == "capybara" else multilingual_thinking_rows)(rows or spec["rows"], seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in made:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return made


def compose_params(recipe: str, repo: Path, model_dir: Path | None, data_name: str | None, mgsm: str | None,
                   accelerate: str | None, sets: list[str] = (), layers: int | None = None) -> dict:
    """params.yaml of `repo` with the recipe applied (cli.recipes), the stand-ins (of `layers` decoder layers where
    they are fewer than the recipe's model has: cut_to_depth), one accelerate config for every stage that launches
    (single_gpu unless `accelerate` names another; eval.batch_size scaled so that the fewer processes evaluate the
    recipe's batches at once) and `sets` (KEY=VALUE); validated.
    "default" is params.yaml as it is, with only an explicit accelerate config and sets."""
    from cli.recipes import apply_sets, compose

    params = yaml.safe_load((repo / "params.yaml").read_text()) if recipe == "default" else compose(recipe, repo)
    if layers:
        cut_to_depth(params, layers)
    if recipe != "default":
        params["model"].update(source="local", name=str(model_dir))
        params["data"].update(source="local", name=data_name)
        params["eval"]["mgsm"]["path"] = mgsm or ""
        accelerate = accelerate or "single_gpu"
    for section in ("train", "eval"):
        if accelerate and "accelerate_config" in params[section]:
            recipe_processes = processes(repo, params[section]["accelerate_config"])
            name = params[section]["accelerate_config"] = accelerate
            if not (repo / "configs" / "accelerate" / f"{name}.yaml").is_file():
                raise SetupError(f"{section}.accelerate_config: no configs/accelerate/{name}.yaml (PIPELINE_ACCELERATE "
                                 "names one of configs/accelerate/)")
            if section == "eval":  # the recipe's batches, all on fewer processes: e.g. 8 x 40 prompts, one GPU 320
                params["eval"]["batch_size"] *= recipe_processes
                params["eval"]["batch_size"] //= processes(repo, name)
    apply_sets(params, list(sets))
    validate(params, source=f"params.yaml with recipes/{recipe}.yaml and the stand-ins")
    return params


def cut_to_depth(params: dict, layers: int) -> None:
    """`params`, in place, for a model of `layers` decoder layers, fewer than the recipe's has: no more layers' experts
    kept in 16 bits (train.experts_kept_16bit) than it has."""
    params["train"]["experts_kept_16bit"] = min(params["train"]["experts_kept_16bit"], layers)


def processes(repo: Path, accelerate_config: str) -> int:
    """num_processes of configs/accelerate/<accelerate_config>.yaml (1 where it names none or the file is missing)."""
    path = repo / "configs" / "accelerate" / f"{accelerate_config}.yaml"
    return int((yaml.safe_load(path.read_text()) or {}).get("num_processes", 1)) if path.is_file() else 1


def mgsm_folder(value: str) -> str | None:
    """MGSM_DIR as an absolute folder, None for "none" (no MGSM); a missing folder stops with the way on."""
    if value.lower() in ("", "none"):
        return None
    folder = Path(value).resolve()
    if not (folder / "mgsm_en.tsv").is_file():
        raise SetupError(f"MGSM_DIR={value}: no mgsm_en.tsv there. Copy ../shared/data/mgsm into a git-ignored folder "
                         "of the repo and pass MGSM_DIR=<that folder>, or MGSM_DIR=none to evaluate without MGSM")
    return str(folder)


def dvc_config(repo: Path) -> None:
    """DVC in the copy without git (core.no_scm), outputs hardlinked from its cache instead of copied (gpt-oss-20b's
    base and merged model are 13 GB each), analytics off."""
    (repo / ".dvc").mkdir(exist_ok=True)
    (repo / ".dvc" / "config.local").write_text("[core]\n    no_scm = true\n    analytics = false\n"
                                                "[cache]\n    type = \"hardlink,symlink,copy\"\n")


def stand_ins(recipe: str, work: Path, tiny: bool = False, rows: int | None = None) -> tuple[Path, Path]:
    """The recipe's stand-in model and data under `work` (work/model, work/pipeline-<recipe>.jsonl), built once: kept
    while work/model.json matches. Returns their paths."""
    from lora_pipeline.model.tiny import tokenizer_corpus

    if recipe not in STAND_INS:
        raise SetupError(f"no stand-ins for '{recipe}'; recipes with stand-ins: {', '.join(STAND_INS)}")
    spec = {"recipe": recipe, "tiny": tiny, "rows": rows or STAND_INS[recipe]["rows"]}
    data_file = work / f"pipeline-{recipe}.jsonl"
    model_dir = work / "model"
    marker = work / "model.json"  # beside the folder: fetch copies the folder whole
    if not (marker.is_file() and json.loads(marker.read_text()).get("spec") == spec and data_file.is_file()):
        shutil.rmtree(model_dir, ignore_errors=True)
        made = build_data(recipe, data_file, rows)
        print(f"data: {len(made)} rows -> {data_file}", flush=True, file=sys.stderr)
        built = build_model(recipe, model_dir, tokenizer_corpus(made), tiny)
        marker.write_text(json.dumps({"spec": spec, **built}, indent=1))
        print(f"model: {built} -> {model_dir}", flush=True, file=sys.stderr)
    return model_dir, data_file


def setup(recipe: str, work: Path, repo: Path = ROOT, mgsm: str = "", accelerate: str | None = None,
          tiny: bool = False, rows: int | None = None, sets: list[str] = ()) -> None:
    """The stand-ins under `work` (built once: kept while `work`/model.json matches) and the params in `repo`,
    a scratch copy, with this very copy's code."""
    if recipe not in RECIPES:
        raise SetupError(f"unknown recipe '{recipe}'; this script runs: {', '.join(RECIPES)}")
    dvc_config(repo)
    model_dir = data_name = None
    if recipe != "default":
        model_dir, data_file = stand_ins(recipe, work, tiny, rows)
        data_name = f"data/local/pipeline-{recipe}.jsonl"
        (repo / "data" / "local").mkdir(parents=True, exist_ok=True)
        shutil.copy2(data_file, repo / data_name)
    params = compose_params(recipe, repo, model_dir, data_name, mgsm_folder(mgsm) if recipe != "default" else None,
                            accelerate, sets, TINY[recipe]["num_hidden_layers"] if tiny and recipe in TINY else None)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False, allow_unicode=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    copy = sub.add_parser("copy", help="copy this repo's files to WORK/repo (outputs there are kept); print it")
    build = sub.add_parser("build", help="in a scratch copy: the recipe's stand-ins under WORK and its params.yaml")
    build.add_argument("recipe", choices=RECIPES)
    build.add_argument("--mgsm", default="none", help="folder of mgsm_<lang>.tsv; none: no MGSM")
    build.add_argument("--accelerate", help="train.accelerate_config (recipes default to single_gpu)")
    build.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a params key after the recipe, e.g. eval.batch_size=320")
    build.add_argument("--tiny", action="store_true", help="reduced sizes of the architecture (tests only)")
    build.add_argument("--rows", type=int, help="data rows (default: the recipe's stand-in size)")
    for command in (copy, build):
        command.add_argument("--work", type=Path, required=True, help="where the copy (WORK/repo), model and data go")
    args = parser.parse_args(argv)
    work = args.work.resolve()
    try:
        if args.command == "copy":
            copy_repo(ROOT, work / "repo", exclude=work)
            print(work / "repo")
        else:
            setup(args.recipe, work, ROOT, args.mgsm, args.accelerate, args.tiny, args.rows, args.set)
    except (SetupError, ParamsError, FileNotFoundError) as exc:
        print(f"pipeline setup: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
