"""What one model family needs beyond the general code, a folder each: gpt_oss (MXFP4 weights and checkpoints, its
experts, its attention sinks and packed-row masks). The general modules branch on a family only to call into it."""
