"""The merged checkpoint as the base's own files with only the weights the adapter changed written over, verified."""
from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from lora_pipeline.merge.merged_checks import adapter_values
from lora_pipeline.model.checkpoint_files import tensor_files

# The files of a checkpoint folder besides its weights that describe the model (the tokenizer is saved on its own).
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
# safetensors' dtype names (its header's "dtype") of the floating point tensors a merge writes
STORED_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
COMPARE_BYTES = 64 * 2**20  # the byte ranges compared a slice at a time, several at once


@dataclass
class Written:
    """What verify_over_base found: tensors written from the merged model, read back with safetensors equal to its
    values in the stored dtype; tensors of the base, byte for byte; and the written ones whose stored values are not
    the merged model's in its own dtype (a float32 model over a bf16 base: rounded once more)."""
    replaced: int
    copied: int
    rounded: list[str]


def changed_weights(merged, layers: dict, adapter_dir: str | Path) -> dict[str, torch.Tensor]:
    """The merged model's tensors the adapter changed, by name: each weight a LoRA layer adapts (`layers`, lora_weights
    of the model before merging) and the adapter file's other tensors (lora.bias all / lora_only: trained biases).
    check_merged_weights has checked every other weight equal to the base's."""
    params = dict(merged.named_parameters(remove_duplicate=False)) | dict(merged.named_buffers())
    names = list(layers) + [name for name in adapter_values(adapter_dir) if name not in layers]
    missing = [name for name in names if name not in params]
    if missing:
        raise ValueError(f"{missing[:3]}: changed by the adapter but not in the merged model")
    return {name: params[name].detach() for name in names}


def _header(path: Path) -> tuple[int, dict]:
    """A safetensors file's header (names, dtypes, shapes, data_offsets) and where its data begins: 8 bytes of
    little-endian header size, the JSON header, then the data, which data_offsets count from."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return 8 + size, json.loads(f.read(size))


def copy_problem(names, base_dir: str | Path) -> str | None:
    """Why the merged checkpoint cannot be the base's files with the tensors `names` written over them (None: it can):
    one is stored otherwise than as a plain floating point tensor (e.g. MXFP4 experts that a LoRA on the experts
    changed: they have to be re-encoded), or not at all."""
    files = tensor_files(base_dir)
    headers = {path: _header(path)[1] for path in set(files.values())}
    for name in names:
        if name not in files:
            stored = "in MXFP4 (blocks and scales)" if f"{name}_blocks" in files else "nowhere"
            return f"{name}, which the adapter changes, is stored {stored} in {base_dir}"
        dtype = headers[files[name]][name]["dtype"]
        if dtype not in STORED_DTYPES:
            return f"{name}, which the adapter changes, is stored as {dtype} in {base_dir}"
    return None


def save_over_base(base_dir: str | Path, out_dir: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write to out_dir the base checkpoint's weight files, config.json (its quantization_config included),
    generation_config.json and index as they are, then each of `tensors` over its stored data, in the stored dtype.

    The base's bytes are copied by the kernel (shutil.copyfile); every tensor not in `tensors` (MXFP4 experts,
    embeddings, norms, routers...) keeps them, and the header, the shard layout and the index stay the base's: a tensor
    written over has the same dtype and shape, so the same size and place."""
    base, out = Path(base_dir), Path(out_dir)
    files = tensor_files(base)
    problem = copy_problem(tensors, base)
    if problem:
        raise ValueError(problem)
    out.mkdir(parents=True, exist_ok=True)
    for fname in MODEL_FILES:
        if (base / fname).is_file():
            shutil.copyfile(base / fname, out / fname)
    for path in sorted(set(files.values())):
        shutil.copyfile(path, out / path.name)
        start, header = _header(path)
        with open(out / path.name, "r+b") as f:
            for name in (n for n in tensors if files[n] == path):
                begin, end = header[name]["data_offsets"]
                data = _stored_bytes(tensors[name], header[name], name)
                if len(data) != end - begin:
                    raise ValueError(f"{name}: {len(data)} bytes to write over {end - begin}")
                f.seek(start + begin)
                f.write(data)


def _stored(tensor: torch.Tensor, entry: dict, name: str) -> torch.Tensor:
    """The tensor as its header entry stores it: that dtype, on the CPU, contiguous."""
    if list(tensor.shape) != entry["shape"]:
        raise ValueError(f"{name}: shape {list(tensor.shape)} in the merged model, {entry['shape']} stored")
    return tensor.to("cpu", STORED_DTYPES[entry["dtype"]]).contiguous()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _stored_bytes(tensor: torch.Tensor, entry: dict, name: str) -> memoryview:
    return memoryview(_as_bytes(_stored(tensor, entry, name)).numpy())


def verify_over_base(base_dir: str | Path, out_dir: str | Path, tensors: dict[str, torch.Tensor]) -> Written:
    """Check out_dir (save_over_base's) exactly: each of `tensors` read back with safetensors equals the tensor in the
    stored dtype, bit for bit (torch.equal of their bytes); every other byte of each weight file (the header and every
    other tensor) is the base's; the model files are the base's. ValueError naming the first difference.

    The saved model then holds what the merged model holds: the copied tensors are the base's, which
    check_merged_weights found the merged model to hold, and loading them decodes the same bytes the base's load did;
    the written ones are the merged values, but for those in `rounded` (stored in a narrower dtype than the model's).
    With none rounded, its logits are the merged model's, with no second load or forward to show it."""
    from safetensors import safe_open

    base, out = Path(base_dir), Path(out_dir)
    files = tensor_files(base)
    problem = copy_problem(tensors, base)
    if problem:
        raise ValueError(problem)
    for fname in MODEL_FILES:
        if (base / fname).is_file() and (base / fname).read_bytes() != (out / fname).read_bytes():
            raise ValueError(f"{out / fname} is not the base's {fname}")
    replaced = copied = 0
    rounded = []
    for path in sorted(set(files.values())):
        written = out / path.name
        if written.stat().st_size != path.stat().st_size:
            raise ValueError(f"{written}: {written.stat().st_size} bytes, the base's {path.name} {path.stat().st_size}")
        start, header = _header(path)
        names = [n for n in header if n != "__metadata__"]
        ours = [n for n in names if n in tensors]
        with safe_open(written, "pt") as f:
            if sorted(f.keys()) != sorted(names):
                raise ValueError(f"{written} does not hold the tensors of the base's {path.name}")
            for name in ours:
                read, expected = f.get_tensor(name), _stored(tensors[name], header[name], name)
                if read.dtype != expected.dtype or not torch.equal(_as_bytes(read), _as_bytes(expected)):
                    raise ValueError(f"{written}: {name} read back is not the merged model's")
                if not torch.equal(read.to(tensors[name].device, tensors[name].dtype), tensors[name]):
                    rounded.append(name)
        skipped = sorted(tuple(start + b for b in header[n]["data_offsets"]) for n in ours)
        kept, at = [], 0  # the byte ranges outside the written tensors' data
        for begin, end in skipped + [(path.stat().st_size, path.stat().st_size)]:
            if begin > at:
                kept.append((at, begin))
            at = max(at, end)
        differ = _first_difference(path, written, kept)
        if differ is not None:
            name = next((n for n in names if start + header[n]["data_offsets"][0] <= differ
                         < start + header[n]["data_offsets"][1]), "its header")
            raise ValueError(f"{written}: byte {differ} ({name}) is not the base's, though nothing was written there")
        replaced, copied = replaced + len(ours), copied + len(names) - len(ours)
    return Written(replaced=replaced, copied=copied, rounded=rounded)


def _first_difference(a: Path, b: Path, ranges: list[tuple[int, int]]) -> int | None:
    """The first offset in `ranges` where the files' bytes differ (None: nowhere), read COMPARE_BYTES at a time by
    several threads (os.pread lets go of the GIL)."""
    slices = [(at, min(end, at + COMPARE_BYTES)) for begin, end in ranges for at in range(begin, end, COMPARE_BYTES)]
    fa, fb = os.open(a, os.O_RDONLY), os.open(b, os.O_RDONLY)

    def differs(piece):
        begin, end = piece
        left, right = os.pread(fa, end - begin, begin), os.pread(fb, end - begin, begin)
        if left == right:
            return None
        return begin + next(i for i, (x, y) in enumerate(zip(left, right)) if x != y) if len(left) == len(right) \
            else begin + min(len(left), len(right))

    try:
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            return next((at for at in pool.map(differs, slices) if at is not None), None)
    finally:
        os.close(fa)
        os.close(fb)


def put_stored(tensors: dict[str, torch.Tensor], out_dir: str | Path, names) -> None:
    """Overwrite each of `tensors` named in `names` (the merged model's own, in place) with the values out_dir stores
    for it, cast back to its dtype: the model as saved, where the stored dtype rounded them."""
    from safetensors import safe_open

    files = tensor_files(out_dir)
    with torch.no_grad():
        for name in names:
            with safe_open(files[name], "pt") as f:
                tensors[name].copy_(f.get_tensor(name))
