"""Hugging Face model types the torch program treats specially: plain constants, no torch.

`hf_modules` (which builds them, importing torch) and `torch_checks` (which refuses plans, without
torch) both read these.
"""

GPT2_TYPES = ("gpt2",)
"""Model types whose matmuls are transformers Conv1D modules (the program does not split them)."""
HEAD_NORM_TYPES = ("qwen3",)
"""Model types whose attention normalises q and k per head with one weight shared by every head: split
over tp ranks, that weight's gradient would need a sum over the tp group the program does not do."""
