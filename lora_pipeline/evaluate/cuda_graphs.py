"""The CUDA-graph decode step's torch.compile backend: torch's "cudagraphs" backend (CUDA graph trees over the traced
step, no code generation) with the model's weights kept in place."""
from __future__ import annotations

import torch
from torch._dynamo.backends import cudagraphs as torch_cudagraphs
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters


def static_inputs(fixed: int) -> list[int]:
    """The inputs of the traced step that a CUDA graph may read where they lie: the `fixed` first, which AOT autograd
    adds, and those dynamo marks static (the parameters and buffers it lifts into the graph's inputs, and tensors
    given torch._dynamo.mark_static_address, as transformers' static KV caches are). torch's backend takes only the
    first: since dynamo lifts every parameter (torch 2.5 on), each replay would copy all the weights into the graph's
    memory pool, twice the model's memory and a full read and write of it every token."""
    context = torch._guards.TracingContext.try_get()
    marked = set(context.fw_metadata.static_input_indices) if context and context.fw_metadata else set()
    return sorted(set(range(fixed)) | marked)


def cudagraphs_in_place(dynamo_model: torch.fx.GraphModule, dynamo_inputs: list) -> object:
    """A torch.compile backend for inference steps (under torch.no_grad, as generate decodes): torch's "cudagraphs"
    backend with static_inputs kept in place. Where torch's would not record (a CPU tensor in the step, say), the
    traced step runs without a CUDA graph, as there."""
    from torch._inductor.cudagraph_trees import cudagraphify_impl

    def inference(aot_model: torch.fx.GraphModule, aot_inputs: list):
        step = torch_cudagraphs.boxed_nop(aot_model, aot_inputs)
        fixed = torch_cudagraphs.num_fw_fixed_arguments(len(dynamo_inputs), len(aot_inputs))
        static = static_inputs(fixed)
        counters["cudagraphs_in_place"]["static_inputs"] += len(static)
        counters["cudagraphs_in_place"]["copied_inputs"] += len(aot_inputs) - len(static)
        if torch_cudagraphs.check_for_skip(aot_model, fixed):
            counters["cudagraphs_in_place"]["not_recorded"] += 1
            return step
        graph = cudagraphify_impl(
            step, aot_inputs, static, device_index=torch_cudagraphs.get_device_index(aot_model), is_backward=False,
            is_inference=True, stack_traces=torch_cudagraphs.get_stack_traces(aot_model),
            placeholders=torch_cudagraphs.get_placeholder_info(aot_model.graph),
            mutated_input_idxs=torch_cudagraphs.find_input_mutations(aot_model.graph))
        graph._boxed_call = True
        return graph

    return aot_autograd(fw_compiler=inference)(dynamo_model, dynamo_inputs)
