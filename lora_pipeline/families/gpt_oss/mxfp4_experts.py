"""gpt-oss's frozen MoE experts kept in MXFP4 while LoRA trains the rest (model.experts_implementation
grouped_mm_mxfp4).

openai/gpt-oss-20b loads with Mxfp4Config(dequantize=True): its expert weights become 16-bit, about 38 GB, though
LoRA never trains them. pack_experts re-encodes each experts module's gate_up_proj and down_proj with the project's
encoder (mxfp4) into uint8 buffers in the layout of the checkpoint (mxfp4_checkpoint.expert_to_disk:
`gate_up_proj_blocks`, `gate_up_proj_scales`, ...; [experts, out, in/32, 16] and [experts, out, in/32]), checking
that every value decodes back exactly, as every value loaded from MXFP4 does; about 4.25 bits a value instead of 16.

The experts forward registered under that name is transformers' grouped_mm one (tokens sorted by expert, one grouped
GEMM per projection, gpt-oss's biases, clamped interleaved GLU and routing weights), with each weight taken through
PackedGroupedLinear: the forward decodes the weight into a temporary, and autograd keeps only the packed bytes; the
backward decodes it again and returns the input's gradient (there is no weight gradient to compute).
"""
from __future__ import annotations

import contextlib

import torch
from transformers.integrations.moe import ExpertsInterface

from lora_pipeline.families.gpt_oss.rules import MXFP4_EXPERTS, PACKED, packing_problems
from lora_pipeline.model.loading import experts_modules, set_experts_implementation
from lora_pipeline.families.gpt_oss.mxfp4 import MXFP4_BLOCK, decode_table
from lora_pipeline.families.gpt_oss.mxfp4_checkpoint import expert_from_disk, expert_to_disk
from lora_pipeline.families.gpt_oss import mxfp4_triton

__all__ = ["DECODERS", "GLUES", "PATHS", "PackedGroupedLinear", "decode_weight", "down_glue", "forced_path",
           "gate_up_glue", "pack_experts", "paths_run"]

PATHS = ("grouped_mm", "loop")  # one grouped GEMM per projection, or a matmul per expert (where there is no kernel)
# How a packed weight is decoded: one Triton kernel (mxfp4_triton: a run of bytes a program, two values a byte), one
# elementwise pass compiled by Inductor (table lookup and scale in registers), or mxfp4.dequantize_mxfp4's torch ops,
# several passes over 16-bit temporaries (docs/performance.md has the cost).
DECODERS = ("triton", "compiled", "eager")
# The elementwise work around the two grouped GEMMs (biases, gpt-oss's clamped GLU, routing weights, the rows back in
# token order): transformers' torch ops, a kernel each, or two functions compiled by Inductor with dynamic row
# counts, forward and backward fused. Compiled on a GPU, eager elsewhere, unless forced (glue_for, forced_path).
GLUES = ("eager", "compiled")
KEPT_16BIT = "16-bit weights"  # what paths_run names for the layers train.experts_kept_16bit leaves unpacked
_forced: dict[str, list[str]] = {"path": [], "decoder": [], "glue": []}  # forced_path's choices, innermost last


@contextlib.contextmanager
def forced_path(path: str | None = None, decoder: str | None = None, glue: str | None = None):
    """Run the packed experts' matmuls through `path` (grouped_mm or loop), decode their weights with `decoder`
    (compiled or eager) and run the elementwise work between them as `glue` (eager or compiled) inside the block,
    whatever the device offers: the tests, the GPU check and the throughput benchmark compare them."""
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if decoder is not None and decoder not in DECODERS:
        raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
    if glue is not None and glue not in GLUES:
        raise ValueError(f"glue must be one of {GLUES}, got {glue!r}")
    forced = {"path": path, "decoder": decoder, "glue": glue}
    for key, choice in forced.items():
        if choice:
            _forced[key].append(choice)
    try:
        yield
    finally:
        for key, choice in forced.items():
            if choice:
                _forced[key].pop()


def _grouped_mm_kernel():
    """torch's grouped GEMM: torch.nn.functional.grouped_mm (torch 2.10 on), else torch._grouped_mm, else None."""
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def matmul_path(device: torch.device, dtype: torch.dtype) -> str:
    """grouped_mm where torch has a grouped GEMM for the device and dtype, as transformers' grouped_mm path decides
    (CUDA: bf16 on compute capability 8.0 and above, 9.0 for the older torch._grouped_mm; CPU: float32, bfloat16,
    float16 with torch.nn.functional.grouped_mm), else loop."""
    if _forced["path"]:
        return _forced["path"][-1]
    if _grouped_mm_kernel() is None or torch.compiler.is_compiling() and dtype != torch.bfloat16:
        return "loop"  # Inductor lowers grouped_mm for bf16 only
    if device.type == "cuda":
        needed = (8, 0) if hasattr(torch.nn.functional, "grouped_mm") else (9, 0)
        return "grouped_mm" if dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= needed \
            else "loop"
    if device.type == "cpu" and hasattr(torch.nn.functional, "grouped_mm"):
        return "grouped_mm" if dtype in (torch.float32, torch.bfloat16, torch.float16) else "loop"
    return "loop"


def _compiled_on_gpu(kind: str, device: torch.device) -> str:
    """forced_path's choice of `kind` if any; else compiled on a GPU, eager elsewhere, where compiling would cost
    more than it saves."""
    if _forced[kind]:
        return _forced[kind][-1]
    return "compiled" if device.type == "cuda" else "eager"


def decoder_for(device: torch.device) -> str:
    """The decoder: forced_path's choice if any; on a GPU the Triton kernel (the compiled pass where Triton is
    missing), eager elsewhere."""
    if _forced["decoder"] or device.type != "cuda":
        return _compiled_on_gpu("decoder", device)
    return "triton" if mxfp4_triton.available() else "compiled"


def glue_for(device: torch.device) -> str:
    """The glue: compiled on a GPU (faster, and fewer saved intermediates: docs/performance.md), eager elsewhere."""
    return _compiled_on_gpu("glue", device)


def _decode_in_one_pass(blocks, scales, values, powers, dtype: torch.dtype) -> torch.Tensor:
    """dequantize_mxfp4's arithmetic (each code's value times 2**(scale - 127) in float32, rounded once to `dtype`)
    as one expression, which Inductor fuses into one kernel: [..., G, 16] + [..., G] -> [..., G * 32]."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).int()  # low nibble first
    return (values[codes] * powers[scales.int()].unsqueeze(-1)).to(dtype).flatten(-2)


_decode_compiled = torch.compile(_decode_in_one_pass, dynamic=False, fullgraph=True)


def decode_weight(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, decoder: str) -> torch.Tensor:
    """The expert weight [E, in, out] of packed blocks [E, out, in/32, 16] and scales [E, out, in/32], as
    mxfp4_checkpoint.expert_from_disk decodes it (the same values, bit for bit), through `decoder`."""
    if decoder == "eager":
        return expert_from_disk(blocks, scales, dtype)
    if decoder == "triton":
        return mxfp4_triton.decode(blocks, scales, dtype).transpose(-2, -1)
    values, powers = (decode_table(name, torch.float32, blocks.device) for name in ("fp4", "e8m0"))
    return _decode_compiled(blocks, scales, values, powers, dtype).transpose(-2, -1)


def gate_up_glue(proj, bias, expert_ids, limit: float, alpha: float) -> torch.Tensor:
    """gate_up_proj's output [S, 2I] plus each row's expert bias, through gpt-oss's clamped interleaved GLU
    (GptOssExperts._apply_gate, written out so that Inductor can fuse it): [S, I]."""
    gate_up = proj + bias[expert_ids]
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def down_glue(proj, bias, expert_ids, weights, inverse, top_k: int) -> torch.Tensor:
    """down_proj's output [S, H] (rows sorted by expert) plus each row's expert bias, times its routing weight, back
    in token order (`inverse`) and summed over each token's top_k experts: [S / top_k, H]."""
    weighted = (proj + bias[expert_ids]) * weights.unsqueeze(-1)
    return weighted[inverse].view(-1, top_k, weighted.shape[-1]).sum(dim=1)


_gate_up_glue_compiled = torch.compile(gate_up_glue, dynamic=True)
_down_glue_compiled = torch.compile(down_glue, dynamic=True)


def _grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, path: str) -> torch.Tensor:
    """Rows of x [S, K] sorted by expert (offsets: each expert's end row) times weight[e] [K, N]: [S, N]."""
    if path == "grouped_mm":
        return _grouped_mm_kernel()(x, weight, offs=offsets)
    out = x.new_zeros(x.shape[0], weight.shape[-1])
    start = 0
    for e, end in enumerate(offsets.tolist()):  # one host sync for all experts
        if end > start:
            out[start:end] = x[start:end] @ weight[e]
        start = end
    return out


class PackedGroupedLinear(torch.autograd.Function):
    """x [S, in] (rows sorted by expert) times each expert's frozen weight, stored packed: blocks
    [E, out, in/32, 16] and scales [E, out, in/32] (uint8, mxfp4_checkpoint.expert_to_disk). Returns [S, out] in
    `dtype`, computed in `dtype` (autocast off).

    The weight is decoded into a temporary in the forward and again in the backward: what autograd keeps is the
    packed bytes and the offsets, never a 16-bit weight. The backward returns the gradient of x only."""

    @staticmethod
    def forward(ctx, x, blocks, scales, offsets, dtype, path, decoder):
        with torch.autocast(x.device.type, enabled=False):
            weight = decode_weight(blocks, scales, dtype, decoder)  # [E, in, out]: a temporary, freed on return
            out = _grouped(x.to(dtype), weight, offsets, path)
        ctx.save_for_backward(blocks, scales, offsets)
        ctx.dtype, ctx.path, ctx.decoder, ctx.input_dtype = dtype, path, decoder, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None, None
        blocks, scales, offsets = ctx.saved_tensors
        with torch.autocast(grad.device.type, enabled=False):
            weight = decode_weight(blocks, scales, ctx.dtype, ctx.decoder).transpose(-2, -1)  # [E, out, in]
            grad_x = _grouped(grad.to(ctx.dtype).contiguous(), weight, offsets, ctx.path)
        return grad_x.to(ctx.input_dtype), None, None, None, None, None, None


def _project(experts, name: str, x, offsets, dtype, path: str, decoder: str) -> torch.Tensor:
    """x [S, in] (rows sorted by expert) through the experts' `name` weight: decoded from its packed buffers, or
    taken as it is where pack_experts kept the layer in 16 bits (train.experts_kept_16bit)."""
    if name in experts._parameters:  # [E, in, out], frozen: autograd computes the input's gradient only
        with torch.autocast(x.device.type, enabled=False):
            return _grouped(x.to(dtype), experts._parameters[name], offsets, path)
    return PackedGroupedLinear.apply(x, getattr(experts, f"{name}_blocks"), getattr(experts, f"{name}_scales"), offsets,
                                     dtype, path, decoder)


def grouped_mm_mxfp4_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' grouped_mm_experts_forward for gpt-oss's experts (is_transposed, has_bias, has_gate), without
    expert parallelism, the weights taken packed through PackedGroupedLinear. Records the matmul path it ran in
    self.mxfp4_path."""
    if self._is_expert_parallel:
        raise NotImplementedError(f"{MXFP4_EXPERTS} does not run under expert parallelism")
    device = hidden_states.device
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.shape
    dtype = self.gate_up_proj_bias.dtype  # the model's dtype (the biases follow model.to)
    path, decoder = matmul_path(device, dtype), decoder_for(device)
    glue = glue_for(device)
    weights = KEPT_16BIT if "gate_up_proj" in self._parameters else f"{decoder} decode"  # as _project decides
    self.mxfp4_path = f"{path}, {weights}, {glue} glue"

    sample_weights = top_k_weights.reshape(-1)  # (S,) with S = num_tokens * num_top_k
    expert_ids = top_k_index.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    selected = hidden_states[perm // num_top_k]
    sample_weights_g = sample_weights[perm]
    # histc as transformers counts (no bincount: CUDA graphs; float on the CPU for deterministic algorithms)
    histc_input = expert_ids_g.float() if device.type in ("cpu", "mps") else expert_ids_g.int()
    tokens_per_expert = torch.histc(histc_input, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)

    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=device)

    proj = _project(self, "gate_up_proj", selected, offsets, dtype, path, decoder)
    if glue == "compiled":
        proj = _gate_up_glue_compiled(proj, self.gate_up_proj_bias, expert_ids_g, self.limit, self.alpha)
    else:
        proj.add_(self.gate_up_proj_bias[expert_ids_g])
        proj = self._apply_gate(proj)  # (S, intermediate)
    proj = _project(self, "down_proj", proj, offsets, dtype, path, decoder)
    if glue == "compiled":
        out = _down_glue_compiled(proj, self.down_proj_bias, expert_ids_g, sample_weights_g, inv_perm, num_top_k)
        return out.to(hidden_states.dtype)
    proj.add_(self.down_proj_bias[expert_ids_g])
    weighted = proj * sample_weights_g.unsqueeze(-1)  # (S, hidden)
    weighted = weighted[inv_perm]
    return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


ExpertsInterface.register(MXFP4_EXPERTS, grouped_mm_mxfp4_experts_forward)


def _pack(weight: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [E, in, out] -> the checkpoint's blocks [E, out, in/32, 16] and scales [E, out, in/32], one expert at a
    time (the temporaries of one expert only); ValueError naming `name` if a value does not decode back exactly."""
    experts, k, n = weight.shape
    if k % MXFP4_BLOCK:
        raise ValueError(f"{name}: its input dim {k} is not a multiple of {MXFP4_BLOCK}; not an MXFP4 weight")
    blocks = torch.empty(experts, n, k // MXFP4_BLOCK, MXFP4_BLOCK // 2, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(experts, n, k // MXFP4_BLOCK, dtype=torch.uint8, device=weight.device)
    for e in range(experts):
        blocks[e], scales[e] = expert_to_disk(weight[e])
        decoded = expert_from_disk(blocks[e], scales[e], weight.dtype)
        if not torch.equal(decoded, weight[e]):  # == on values: a -0.0 stored as +0 counts as the same
            changed = int((decoded != weight[e]).sum())
            raise ValueError(
                f"model.experts_implementation: {MXFP4_EXPERTS}: {name}, expert {e}: {changed} of {weight[e].numel()} "
                "values change when encoded in MXFP4, so these are not the weights of an MXFP4 checkpoint; allowed: "
                "grouped_mm, or a base stored in MXFP4 (as openai/gpt-oss-20b) loaded with quantization.method "
                "mxfp4-dequantize")
    return blocks, scales


def pack_experts(model, target_parameters=(), kept_16bit: int = 0) -> dict:
    """Replace, in place, every gpt-oss experts module's gate_up_proj and down_proj parameters by packed MXFP4
    buffers (`<name>_blocks`, `<name>_scales`, the checkpoint's names and orientation), and run the experts as
    grouped_mm_mxfp4. Before LoRA is applied; `target_parameters`: lora.target_parameters, which must not train
    the packed weights; `kept_16bit`: train.experts_kept_16bit, how many of the last layers' experts stay 16-bit
    parameters (their steps decode nothing). Returns what was packed: modules, values, bytes before and after."""
    model_type = getattr(model.config, "model_type", None)
    problems = packing_problems(model_type, None, target_parameters)
    modules = experts_modules(model)
    if not problems and not modules:
        problems.append(f"model.experts_implementation: {MXFP4_EXPERTS}, but the model has no MoE experts modules; "
                        "allowed: eager")
    if kept_16bit > len(modules):
        problems.append(f"train.experts_kept_16bit: {kept_16bit}, but the model has {len(modules)} experts modules "
                        f"(one a decoder layer); allowed: 0 to {len(modules)}")
    if problems:
        raise ValueError("\n".join(problems))
    names = {id(m): name for name, m in model.named_modules()}
    values = before = after = 0
    for module in modules[:len(modules) - kept_16bit]:
        for name in PACKED:
            weight = module._parameters.get(name)
            if weight is None:
                if hasattr(module, f"{name}_blocks"):
                    continue  # packed already
                raise ValueError(f"model.experts_implementation: {MXFP4_EXPERTS}: {names[id(module)]} has no "
                                 f"{name} parameter to pack")
            if weight.ndim != 3 or not weight.is_floating_point():
                raise ValueError(f"model.experts_implementation: {MXFP4_EXPERTS}: {names[id(module)]}.{name} is "
                                 f"{weight.dtype} {tuple(weight.shape)}, not a 3-D [experts, in, out] float weight")
            with torch.no_grad():
                blocks, scales = _pack(weight.detach(), f"{names[id(module)]}.{name}")
            values += weight.numel()
            before += weight.numel() * weight.element_size()
            after += blocks.numel() + scales.numel()
            del module._parameters[name]
            module.register_buffer(f"{name}_blocks", blocks)
            module.register_buffer(f"{name}_scales", scales)
            del weight
    set_experts_implementation(model, MXFP4_EXPERTS)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the 16-bit experts' memory back to the device
    packed = {"modules": len(modules) - kept_16bit, "values": values, "bytes_before": before, "bytes_after": after}
    return packed | ({"kept_16bit": kept_16bit} if kept_16bit else {})  # only then: other adapters' records unchanged


def paths_run(model) -> list[str]:
    """The matmul paths (grouped_mm, loop), decoders and glue the packed experts ran in their last forward, e.g.
    "grouped_mm, compiled decode, eager glue"."""
    return sorted({m.mxfp4_path for m in experts_modules(model) if getattr(m, "mxfp4_path", None)})
