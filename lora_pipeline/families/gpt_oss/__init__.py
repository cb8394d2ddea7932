"""openai/gpt-oss: MXFP4 weights (mxfp4), its checkpoints (mxfp4_checkpoint), its frozen experts kept in MXFP4 while
training (mxfp4_experts, mxfp4_triton), the rules of both (rules), its attention sinks when decoding
(sink_attention) and its masks for packed rows (packed_masks)."""
